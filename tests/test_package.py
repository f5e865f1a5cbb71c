"""Packaging promises: no torch at import, typed, one explicit public API."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import arrow_outputs


def test_import_arrow_outputs_does_not_import_torch():
    code = "import sys, arrow_outputs; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_package_ships_py_typed():
    assert (Path(arrow_outputs.__file__).parent / "py.typed").is_file()


def test_all_names_exist_and_are_sorted_public():
    for name in arrow_outputs.__all__:
        assert hasattr(arrow_outputs, name), name
    public = {n for n in dir(arrow_outputs) if not n.startswith("_") and n[0].isupper()}
    assert public <= set(arrow_outputs.__all__)


def test_errors_share_one_base_class():
    for name in arrow_outputs.__all__:
        obj = getattr(arrow_outputs, name)
        if isinstance(obj, type) and issubclass(obj, Exception) and not issubclass(obj, Warning):
            assert issubclass(obj, arrow_outputs.ArrowOutputsError), name


def test_numpy_only_round_trip_imports_neither_torch_nor_pandas():
    # pandas and torch are installed for development; block them to prove the runtime
    # dependencies (pyarrow, numpy) suffice for a numpy-only step, through IPC and back.
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "pandas"):
            raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, Block())
import numpy as np, pyarrow as pa, arrow_outputs as ao
out = ao.ModelRunnerOutput(
    ["a", "b"], {"a": 0, "b": 1}, [[1], [2, 3]],
    ao.LogprobsLists(np.zeros((3, 4), np.int32), np.zeros((3, 4), np.float32),
                     np.zeros(3, np.int64), [0, 1, 3]),
    sampling_masks=ao.SamplingMaskLists(np.arange(5, dtype=np.int32),
                                        np.array([0, 2, 3, 5]), [0, 1, 3]),
    aux_output_connector_output={"b": ao.AuxRequestOutput(3, np.zeros((2, 3, 2), np.uint16))},
)
batch = ao.to_record_batch(out, step=1)
sink = pa.BufferOutputStream()
with pa.ipc.new_stream(sink, ao.run_schema(batch)) as writer:
    writer.write_batch(batch, custom_metadata=ao.step_custom_metadata(batch))
read, meta = pa.ipc.open_stream(sink.getvalue()).read_next_batch_with_custom_metadata()
back = ao.from_record_batch(read, custom_metadata=meta)
assert back.sampled_token_ids == [[1], [2, 3]]
assert back.sampling_masks.to_nested_list() == out.sampling_masks.to_nested_list()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
