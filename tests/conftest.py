"""Shared fixtures and builders. GPU tests take ``cuda_device`` and skip cleanly without
CUDA, so the same suite reruns unchanged on a machine with a GPU."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import arrow_outputs as ao
from arrow_outputs import LogprobsLists, ModelRunnerOutput, SamplingMaskLists, _accel, _pyspeedups

try:
    import arrow_outputs._speedups as speedups_c
except ModuleNotFoundError:
    speedups_c = None  # type: ignore[assignment]

#: Both implementations of the accelerator's walks, as test parameters (C skipped if unbuilt).
SPEEDUP_IMPLS = [
    pytest.param(_pyspeedups, id="python"),
    pytest.param(
        speedups_c,
        id="c",
        marks=pytest.mark.skipif(speedups_c is None, reason="arrow_outputs._speedups not built"),
    ),
]
#: The implementations present here.
BUILT_IMPLS = [m for m in (_pyspeedups, speedups_c) if m is not None]
needs_c = pytest.mark.skipif(speedups_c is None, reason="arrow_outputs._speedups not built")


def impls_agree(name: str, *args: Any) -> Any:
    """Call the walk ``name`` on every built implementation: the same result, or the same
    exception type (raised again here, so a test can expect it)."""
    outcomes = []
    for m in BUILT_IMPLS:
        try:
            outcomes.append(("ok", getattr(m, name)(*args)))
        except Exception as e:
            outcomes.append(("raised", type(e)))
    for other in outcomes[1:]:
        assert other == outcomes[0], f"{name}: {BUILT_IMPLS[0].__name__} {outcomes[0]} vs {other}"
    kind, value = outcomes[0]
    if kind == "raised":
        raise value("(raised alike by every implementation)")
    return value


@contextmanager
def codec_on(path: str) -> Iterator[None]:
    """The codec on ``path`` ("c" or "python") inside the block, the previous path after."""
    was = _accel.accelerated()
    _accel.set_pure_python(path == "python")
    try:
        yield
    finally:
        _accel.set_pure_python(not was)


def run_on(path: str, call: Callable[[], Any]) -> Any:
    """``call()`` with the codec on ``path``."""
    with codec_on(path):
        return call()


@pytest.fixture
def cuda_device():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda", 0)


@pytest.fixture(scope="module", params=["c", "python"])
def codec_path(request):
    """Run a module's tests on the C accelerator and on the pure-Python path in turn."""
    from arrow_outputs import _accel

    if request.param == "c" and not _accel.AVAILABLE:
        pytest.skip("the C accelerator is not built")
    with codec_on(request.param):
        yield request.param


def decode_step(step: int, n: int, seed: int = 0) -> ModelRunnerOutput:
    """A seeded decode step of ``n`` requests: 0-2 tokens each (speculative decoding), top-4
    logprobs with ``cu_num_generated_tokens``, a NaN count for the first request only (so
    the column has values and nulls), and CSR sampling masks."""
    rng = np.random.default_rng([seed, step])
    ids = [f"req-{step}-{i}" for i in range(n)]
    counts = rng.integers(0, 3, n)
    cu = [0, *np.cumsum(counts).tolist()]
    positions = cu[-1]
    return ModelRunnerOutput(
        ids,
        {r: i for i, r in enumerate(ids)},
        [rng.integers(0, 1000, c).tolist() for c in counts],
        LogprobsLists(
            rng.integers(0, 1000, (positions, 4)).astype(np.int64),
            -rng.random((positions, 4)).astype(np.float32),
            rng.integers(1, 10, positions).astype(np.int64),
            cu,
        ),
        num_nans_in_logits={ids[0]: 0} if ids else {},
        sampling_masks=SamplingMaskLists(
            np.arange(2 * positions, dtype=np.int32),
            np.arange(0, 2 * positions + 1, 2, dtype=np.int64),
            cu,
        ),
    )


def write_stream_lying_about_rows(path: Any, batches: list[pa.RecordBatch], at: int) -> None:
    """An IPC stream of ``batches`` whose step ``at`` has step JSON that claims 5 rows."""
    with (
        pa.OSFile(str(path), "wb") as sink,
        pa.ipc.new_stream(sink, ao.run_schema(batches[0])) as writer,
    ):
        for i, b in enumerate(batches):
            meta = ao.step_custom_metadata(b)
            if i == at:
                step = json.loads(meta[b"arrow_outputs.step"])
                step["rows"] = 5
                meta = {b"arrow_outputs.step": json.dumps(step).encode()}
            writer.write_batch(b, custom_metadata=meta)
