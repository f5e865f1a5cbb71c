"""docs/schema.md is the format's specification: these tests hold the code to it.

The column table and the metadata-key table are parsed from the page and compared with what
the code builds; every key the code writes into the step JSON must be named on the page. A
change to the schema without the page (or the page without the code) fails here. The Python
code blocks of every docs page run too, so the examples stay true.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import types
import uuid
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

import arrow_outputs as ao
from arrow_outputs import schema as schema_mod
from arrow_outputs._jsonish import _TAGS
from arrow_outputs.outputs import (
    AuxRequestOutput,
    CUDAGraphStat,
    ECConnectorOutput,
    KVConnectorOutput,
    LogprobsLists,
    LogprobsTensors,
    ModelRunnerOutput,
    SamplingMaskLists,
)
from arrow_outputs.tensors import DTYPE_KEY, LAYOUT_KEY, TENSOR_DTYPES

DOCS = Path(__file__).resolve().parent.parent / "docs"
SCHEMA_DOC = DOCS / "schema.md"

COLUMN_HEADER = ["column", "Arrow type", "nullable", "null means", "from"]
METADATA_HEADER = ["key", "value", "required"]


# ----------------------------------------------------------------------------- parsing


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _table(text: str, header: list[str]) -> list[list[str]]:
    """The body rows of the one markdown table whose header row is ``header``."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("|") and _cells(line) == header]
    assert len(starts) == 1, f"expected one table with header {header}, found {len(starts)}"
    i = starts[0] + 1
    assert re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i].strip()), "no separator row"
    rows = []
    for line in lines[i + 1 :]:
        if not line.startswith("|"):
            break
        cells = _cells(line)
        assert len(cells) == len(header), f"row {line!r} has {len(cells)} cells"
        rows.append(cells)
    return rows


def _code(cell: str) -> str:
    """The content of a cell that is exactly one backticked span."""
    m = re.fullmatch(r"`([^`]+)`", cell)
    assert m, f"expected one backticked value, got {cell!r}"
    return m.group(1)


def _backticked(text: str) -> set[str]:
    return set(re.findall(r"`([^`\n]+)`", text))


@pytest.fixture(scope="module")
def doc() -> str:
    return SCHEMA_DOC.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def column_rows(doc: str) -> list[list[str]]:
    return _table(doc, COLUMN_HEADER)


@pytest.fixture(scope="module")
def metadata_rows(doc: str) -> dict[str, list[str]]:
    rows = _table(doc, METADATA_HEADER)
    keys = [_code(r[0]) for r in rows]
    assert len(set(keys)) == len(keys), f"duplicate keys in {keys}"
    return {k: r for k, r in zip(keys, rows)}


# ----------------------------------------------------------------------------- outputs


def _rich_output() -> ModelRunnerOutput:
    """A step with every field present, the layouts that carry the most step facts."""
    req = ["a", "b", "c"]
    logprobs = LogprobsTensors(
        torch.tensor([[5, 1], [6, 2], [7, 3], [8, 4]], dtype=torch.int32),
        torch.zeros(4, 2),
        torch.tensor([1, 1, 2, 3]),
        None,
        torch.tensor([0, 1, 3, 4]),
    )
    ids, ranks = torch.int64, torch.int64
    prompt = {
        "a": LogprobsTensors(
            torch.zeros(2, 3, dtype=ids), torch.zeros(2, 3), torch.ones(2, dtype=ranks)
        ),
        "b": None,  # present with None: a null row listed in none_rows
        "c": LogprobsTensors(
            torch.zeros(0, 3, dtype=ids), torch.zeros(0, 3), torch.ones(0, dtype=ranks)
        ),
    }
    return ModelRunnerOutput(
        req,
        {r: i for i, r in enumerate(req)},
        [[1], [2, 3], [4]],
        logprobs=logprobs,
        prompt_logprobs_dict=prompt,
        prompt_token_id_logprobs_dict={"a": torch.zeros(2, 5)},
        pooler_output=list(torch.randn(3, 4, dtype=torch.bfloat16)),
        kv_connector_output=KVConnectorOutput(
            finished_sending={"a"},
            kv_connector_stats={"x": (1, float("nan")), 2: b"ab"},
            kv_cache_events=frozenset({1}),
            kv_connector_worker_meta=object(),
            invalid_block_ids={1, 2},
        ),
        ec_connector_output=ECConnectorOutput(finished_recving={"b"}),
        num_nans_in_logits={"a": 0, "c": 2},
        cudagraph_stats=CUDAGraphStat(4, 8, 4, "FULL"),
        aux_output_connector_output={"b": AuxRequestOutput(3, np.zeros((2, 4, 2), np.uint8))},
        sampling_masks=SamplingMaskLists(
            np.array([1, 2, 3, 4, 5], np.int32), np.array([0, 2, 2, 4, 5], np.int64), [0, 1, 3, 4]
        ),
    )


def _encode(output: Any, **kw: Any) -> pa.RecordBatch:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ao.OpaqueValueWarning)
        return ao.to_record_batch(output, **kw)


def _step_json_variants() -> list[dict[str, Any]]:
    """Step JSON of outputs that between them take every layout value the writer knows."""
    lists = LogprobsLists(
        np.zeros((2, 2), np.int64), np.zeros((2, 2), np.float32), np.ones(2, np.int64)
    )
    outputs = [
        _rich_output(),
        ModelRunnerOutput(
            ["a"], {"a": 0}, [[1, 2]], logprobs=lists._replace(cu_num_generated_tokens=[0, 2])
        ),
        ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, [[1], [2]], logprobs=lists),
        ModelRunnerOutput(
            ["a"],
            {"a": 0},
            [],
            pooler_output=[np.ones(3, np.float32)],
            aux_output_connector_output={
                "a": AuxRequestOutput(0, torch.zeros(1, 2, 2, dtype=torch.uint8))
            },
            sampling_masks=SamplingMaskLists(np.array([1], np.int32)),
        ),
    ]
    return [ao.step_metadata(_encode(o, step=i)) for i, o in enumerate(outputs)]


# ----------------------------------------------------------------------------- columns


def test_schema_doc_columns_are_the_code_columns_in_order(column_rows):
    names = [_code(r[0]) for r in column_rows]
    assert names == list(schema_mod.COLUMNS)
    assert names == ao.output_schema().names


def test_schema_doc_column_types_are_the_default_schema_types(column_rows):
    schema = ao.output_schema()
    for row in column_rows:
        name, type_str = _code(row[0]), _code(row[1])
        assert type_str == str(schema.field(name).type), name


def test_schema_doc_nullable_flags_match_code(column_rows):
    schema = ao.output_schema()
    for row in column_rows:
        assert row[2] in ("yes", "no"), row
        assert (row[2] == "yes") == schema.field(_code(row[0])).nullable, row[0]


def test_schema_doc_every_column_says_null_means_and_from(column_rows):
    for row in column_rows:
        assert row[3], row
        assert row[4], row


def test_schema_doc_column_types_table_matches_code(doc):
    rows = _table(doc, ["ColumnTypes field", "sets", "default", "allowed"])
    defaults = ao.ColumnTypes()
    assert [_code(r[0]) for r in rows] == list(ao.ColumnTypes.__dataclass_fields__)
    for row in rows:
        value = getattr(defaults, _code(row[0]))
        assert _code(row[2]) == (value if isinstance(value, str) else repr(value)), row[0]


def test_schema_doc_names_the_tensor_choices(doc):
    for dtype in TENSOR_DTYPES:
        assert f"`{dtype}`" in doc, dtype
    for key in (DTYPE_KEY, LAYOUT_KEY):
        assert f"`{key.decode()}`" in doc
    assert "`fixed_shape`" in doc
    assert "`variable_shape`" in doc


def test_schema_doc_tensor_layout_values_match_code():
    fixed = ao.TensorSpec("bfloat16", 1, (4,)).field("x")
    variable = ao.TensorSpec("float32", 2).field("x")
    assert fixed.metadata == {DTYPE_KEY: b"bfloat16", LAYOUT_KEY: b"fixed_shape"}
    assert variable.metadata == {DTYPE_KEY: b"float32", LAYOUT_KEY: b"variable_shape"}
    assert fixed.type.storage_type == pa.list_(pa.uint16(), 4)


# ----------------------------------------------------------------------------- metadata keys


def test_schema_doc_metadata_keys_are_the_code_keys(metadata_rows):
    code_keys = {
        getattr(schema_mod, name).decode() for name in dir(schema_mod) if name.startswith("KEY_")
    }
    assert set(metadata_rows) == code_keys


def _written_by_code() -> dict[str, str]:
    """Required-ness as the code writes it: yes / no / per batch."""
    plain = set(ao.output_schema().metadata)
    with_run = set(ao.output_schema(metadata={"model": "m"}).metadata)
    batch = set(_encode(_rich_output(), step=1).schema.metadata)
    empty = set(ao.to_record_batch(ModelRunnerOutput([], {})).schema.metadata)
    out = {}
    for key in plain | with_run | batch | empty:
        if key in plain and key in batch and key in empty:
            out[key.decode()] = "yes"
        elif key in with_run and key not in plain:
            out[key.decode()] = "no"
        elif key in batch and key in empty and key not in with_run:
            out[key.decode()] = "per batch"
        else:
            out[key.decode()] = "unclassified"
    return out


def test_schema_doc_metadata_required_matches_what_code_writes(metadata_rows):
    written = _written_by_code()
    documented = {k: r[2] for k, r in metadata_rows.items()}
    assert documented == written


def test_schema_doc_metadata_values_match_code(metadata_rows):
    assert ao.FORMAT_NAME in metadata_rows["arrow_outputs.format"][1]
    assert ao.FORMAT_VERSION in metadata_rows["arrow_outputs.version"][1]
    producer = ao.output_schema().metadata[b"arrow_outputs.producer"].decode()
    for lib in ("arrow_outputs", "pyarrow", "numpy", "torch"):
        assert f"`{lib}`" in metadata_rows["arrow_outputs.producer"][1], lib
    assert '"arrow_outputs"' in producer


def test_schema_doc_states_the_format_version(doc):
    assert f"version **{ao.FORMAT_VERSION}**" in doc
    assert re.fullmatch(r"\d+\.\d+", ao.FORMAT_VERSION)


# ----------------------------------------------------------------------------- step JSON


def _documented_step_keys(doc: str) -> tuple[set[str], dict[str, set[str]]]:
    """(top-level keys, nested keys by parent) from the two step JSON tables."""
    top = [_code(r[0]) for r in _table(doc, ["key", "value", "meaning"])]
    assert len(set(top)) == len(top), f"duplicate step JSON keys in {top}"
    nested: dict[str, set[str]] = {}
    for row in _table(doc, ["in", "key", "value", "meaning"]):
        names = re.findall(r"`([^`]+)`", row[1])
        assert names, row
        nested.setdefault(_code(row[0]), set()).update(names)
    return set(top), nested


def _written_step_keys() -> tuple[set[str], dict[str, set[str]]]:
    """(top-level keys, nested keys by parent) that the writer puts in the step JSON."""
    top: set[str] = set()
    nested: dict[str, set[str]] = {}
    for meta in _step_json_variants():
        top |= set(meta)
        for key, value in meta.items():
            # One level down only: deeper keys are data (empty_widths' row numbers, tags).
            if isinstance(value, dict):
                nested.setdefault(key, set()).update(value)
            elif isinstance(value, list) and value and isinstance(value[0], dict):
                for item in value:
                    nested.setdefault(f"{key}[i]", set()).update(item)
    return top, nested


def test_schema_doc_step_json_keys_are_the_written_keys(doc):
    documented_top, documented_nested = _documented_step_keys(doc)
    written_top, written_nested = _written_step_keys()
    assert documented_top == written_top
    assert documented_nested == written_nested
    # The rich output writes every top-level key, the conditional ones included.
    assert set(_step_json_variants()[0]) == written_top


def test_schema_doc_names_every_step_json_layout_value(doc):
    documented = _backticked(doc)
    values: set[str] = set()
    for meta in _step_json_variants():
        for key in ("sampled_token_ids", "prompt_token_id_logprobs", "pooler_output"):
            if isinstance(meta.get(key), str):
                values.add(meta[key])
        if isinstance(meta.get("num_nans_in_logits"), str):
            values.add(meta["num_nans_in_logits"])
        for key, sub in (("logprobs", ("kind", "cu", "cu_dtype")), ("aux_output", ("kind",))):
            if isinstance(meta.get(key), dict):
                values |= {meta[key][s] for s in sub if s in meta[key]}
    assert {"lists", "none", "tensors", "list", "tensor", "torch", "numpy", "dict"} <= values
    missing = sorted(v for v in values if f'"{v}"' not in documented)
    assert not missing, f"step JSON values not in docs/schema.md: {missing}"


def test_schema_doc_json_tags_are_the_code_tags(doc):
    rows = _table(doc, ["Python value", "JSON"])
    documented = {t for r in rows for t in re.findall(r'\{"(\$[a-z]+)"', r[1])}
    assert documented == set(_TAGS)
    # The decoder rule names every tag too.
    for tag in _TAGS:
        assert f"`{tag}`" in doc, tag


def test_schema_doc_step_json_travels_as_documented():
    batch = _encode(_rich_output(), step=7)
    meta = ao.step_metadata(batch)
    assert meta["step"] == 7
    assert meta["logprobs"] == {"kind": "tensors", "cu": "tensor", "width": 2, "cu_dtype": "int64"}
    assert meta["prompt_logprobs"] == {"none_rows": [1], "empty_widths": {"2": 3}}
    assert meta["sampling_mask"] == {"offsets": True, "cu": True}
    assert meta["dropped"] == [
        {"field": "kv_connector_output.kv_connector_worker_meta", "type": "builtins.object"}
    ]
    # In an IPC stream the step JSON rides as custom metadata; the stream schema has none.
    run_schema = ao.infer_schema(_rich_output())
    assert b"arrow_outputs.step" not in run_schema.metadata
    assert ao.run_schema(batch).equals(run_schema, check_metadata=True)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, run_schema) as writer:
        writer.write_batch(batch, custom_metadata=ao.step_custom_metadata(batch))
    ((read, custom),) = pa.ipc.open_stream(sink.getvalue()).iter_batches_with_custom_metadata()
    assert b"arrow_outputs.step" not in read.schema.metadata
    assert custom[b"arrow_outputs.step"] == batch.schema.metadata[b"arrow_outputs.step"]
    assert ao.step_metadata(read, custom) == meta
    back = ao.from_record_batch(read, custom_metadata=custom)
    assert back.prompt_logprobs_dict["b"] is None
    assert back.kv_connector_output.kv_connector_worker_meta is None


def test_schema_doc_stale_step_json_is_refused():
    # The first batch's schema (step JSON included) used as the stream schema, and the
    # batches written without custom metadata: every batch read carries step 0's JSON.
    out = ModelRunnerOutput(["a"], {"a": 0}, [[1]])
    first, second = (ao.to_record_batch(out, step=s) for s in (0, 1))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, first.schema) as writer:
        writer.write_batch(first)
        writer.write_batch(second)
    for read in pa.ipc.open_stream(sink.getvalue()):
        with pytest.raises(ao.StepMetadataError, match="custom_metadata"):
            ao.from_record_batch(read)
    two_rows = ao.to_record_batch(ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, [[1], [2]]))
    with pytest.raises(ao.StepMetadataError, match="another batch"):
        ao.from_record_batch(two_rows, custom_metadata=ao.step_custom_metadata(first))


def test_schema_doc_absent_step_json_reads_columns_alone():
    out = ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, [], pooler_output=[None, None])
    batch = ao.to_record_batch(out, step=3)
    bare = batch.replace_schema_metadata(
        {k: v for k, v in batch.schema.metadata.items() if k != b"arrow_outputs.step"}
    )
    with pytest.raises(ao.StepMetadataError, match="defaults"):
        ao.from_record_batch(bare)
    assert ao.step_metadata(bare, missing_step_metadata="defaults")["step"] == 3
    back = ao.from_record_batch(bare, missing_step_metadata="defaults")
    # The documented fallbacks: all-null sampled ids -> [], all-null pooler rows -> None.
    assert back.sampled_token_ids == []
    assert back.pooler_output is None
    assert ao.from_record_batch(batch).pooler_output == [None, None]


def test_schema_doc_newer_major_version_is_refused():
    batch = ao.to_record_batch(ModelRunnerOutput(["a"], {"a": 0}, [[1]]))
    major = int(ao.FORMAT_VERSION.split(".")[0])
    meta = dict(batch.schema.metadata)
    meta[b"arrow_outputs.version"] = f"{major}.{99}".encode()
    assert ao.from_record_batch(batch.replace_schema_metadata(meta)).sampled_token_ids == [[1]]
    meta[b"arrow_outputs.version"] = f"{major + 1}.0".encode()
    with pytest.raises(ao.FormatVersionError, match="upgrade"):
        ao.from_record_batch(batch.replace_schema_metadata(meta))


# ----------------------------------------------------------------------------- errors page


def _with_width(batch: pa.RecordBatch, width: int) -> bytes:
    """The batch's step JSON with a logprobs layout of the given width."""
    meta = json.loads(batch.schema.metadata[b"arrow_outputs.step"])
    meta["logprobs"] = {"kind": "lists", "cu": "none", "width": width}
    return json.dumps(meta).encode()


def _raised(call: Any) -> str:
    with pytest.raises(ao.ArrowOutputsError) as info:
        call()
    return str(info.value)


def _write_after_close() -> None:
    writer = ao.OutputWriter(pa.BufferOutputStream())
    writer.close()
    writer.write(ModelRunnerOutput([], {}))


def test_errors_doc_example_messages_are_what_the_code_raises():
    rows = _table(
        (DOCS / "errors.md").read_text(encoding="utf-8"),
        ["class", "raised when", "example message"],
    )
    documented = {_code(r[0]): r[2] for r in rows}
    classes = {"ArrowOutputsError", "OpaqueValueWarning"}
    todo = [ao.ArrowOutputsError]
    while todo:
        for sub in todo.pop().__subclasses__():
            classes.add(sub.__name__)
            todo.append(sub)
    assert set(documented) == classes

    def one(**fields: Any) -> ModelRunnerOutput:
        return ModelRunnerOutput(["a"], {"a": 0}, [[1]], **fields)

    def lists(ids: Any, cu: Any = None) -> LogprobsLists:
        n = len(ids)
        return LogprobsLists(ids, np.zeros(ids.shape, np.float32), np.zeros(n, np.int64), cu)

    batch = ao.to_record_batch(one())
    newer = {**batch.schema.metadata, b"arrow_outputs.version": b"2.0"}
    swapped = ModelRunnerOutput(["a", "b"], {"a": 1, "b": 0}, [[1], [2]])
    two_rows = [np.zeros(3, np.float32)] * 2
    masks64 = SamplingMaskLists(np.array([1, 2], np.int64))
    bad_cu = lists(np.zeros((2, 2), np.int64), [0, 2, 1])
    messages = {
        "FieldTypeError": _raised(lambda: ao.to_record_batch(one(), step=1.5)),
        "DTypeError": _raised(lambda: ao.to_record_batch(one(sampling_masks=masks64))),
        "ShapeError": _raised(lambda: ao.to_record_batch(one(pooler_output=two_rows))),
        "OffsetsError": _raised(lambda: ao.to_record_batch(one(logprobs=bad_cu))),
        "ConsistencyError": _raised(lambda: ao.to_record_batch(swapped)),
        "UnsupportedValueError": _raised(
            lambda: ao.to_record_batch(one(pooler_output=[torch.zeros(3, device="meta")]))
        ),
        "SchemaMismatchError": _raised(
            lambda: ao.to_record_batch(
                one(logprobs=lists(np.zeros((1, 2), np.int32))), schema=ao.output_schema()
            )
        ),
        "StepMetadataError": _raised(
            lambda: ao.from_record_batch(
                batch, custom_metadata={b"arrow_outputs.step": _with_width(batch, -1)}
            )
        ),
        "FormatVersionError": _raised(
            lambda: ao.from_record_batch(batch.replace_schema_metadata(newer))
        ),
        "CorruptFileError": _raised(lambda: ao.open_run(b"ARROW1\x00\x00garbage")),
        "WriterError": _raised(_write_after_close),
    }
    with pytest.warns(ao.OpaqueValueWarning) as caught:
        ao.to_record_batch(one(kv_connector_output=KVConnectorOutput(kv_connector_stats=object())))
    messages["OpaqueValueWarning"] = str(caught[0].message)
    for name, message in messages.items():
        assert documented[name] == f"`{message}`", name


# ----------------------------------------------------------------------------- spec rules
# Each of these once failed; they hold the code to the MUSTs of docs/schema.md.


def test_from_record_batch_honours_arrow_outputs_dtype_field_metadata():
    # Fresh run metadata makes fresh runs, so the cache state of other tests does not matter.
    nonce = {"nonce": uuid.uuid4().hex}

    def step(rows: torch.Tensor) -> pa.RecordBatch:
        out = ModelRunnerOutput(["a"], {"a": 0}, [[1]], pooler_output=[rows])
        return ao.to_record_batch(out, metadata=nonce)

    as_uint16 = step(torch.arange(4, dtype=torch.int32).to(torch.uint16))
    step(torch.ones(4, dtype=torch.bfloat16))
    assert as_uint16.schema.field("pooler_output").metadata[DTYPE_KEY] == b"uint16"
    assert ao.from_record_batch(as_uint16).pooler_output[0].dtype == torch.uint16


@pytest.mark.parametrize("dtype", [np.bool_, np.complex64, np.uint32])
def test_to_record_batch_refuses_unlisted_tensor_dtype_with_dtype_error(dtype):
    out = ModelRunnerOutput(["a"], {"a": 0}, [[1]], pooler_output=[np.zeros(3, dtype)])
    with pytest.raises(ao.DTypeError, match=r"pooler_output"):
        ao.to_record_batch(out)


def test_to_record_batch_refuses_step_outside_int64():
    out = ModelRunnerOutput(["a"], {"a": 0}, [[1]])
    with pytest.raises(ao.ArrowOutputsError, match=r"^step: "):
        ao.to_record_batch(out, step=2**63)


# ----------------------------------------------------------------------------- code blocks


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(encoding="utf-8"), re.M | re.S)


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_docs_python_code_blocks_run(page, tmp_path, monkeypatch):
    blocks = _python_blocks(DOCS / page)
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    # A real module, so that classes defined in an example (dataclasses) can find it.
    module = types.ModuleType(f"docs_{page.replace('-', '_').removesuffix('.md')}")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    namespace: dict[str, Any] = module.__dict__
    for i, block in enumerate(blocks):
        tree = ast.parse(block)
        # An example that shows an error must raise it: a try without else gets one that fails.
        for node in ast.walk(tree):
            if isinstance(node, ast.Try) and not node.orelse:
                node.orelse = ast.parse(f"raise AssertionError('docs/{page}: nothing raised')").body
        ast.fix_missing_locations(tree)
        exec(compile(tree, f"docs/{page} block {i + 1}", "exec"), namespace)
