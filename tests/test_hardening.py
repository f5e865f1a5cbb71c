"""Decoding untrusted batches: whose step metadata it is, the step JSON as hostile input, the
column cross-checks, and fidelity with what vLLM 0.33 emits. Each test is a regression test of
a reproducer from the hardening issue."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pytest

import arrow_outputs as ao
from arrow_outputs import (
    ConsistencyError,
    FieldTypeError,
    FormatVersionError,
    KVConnectorOutput,
    ModelRunnerOutput,
    SchemaMismatchError,
    StepMetadataError,
    UnsupportedValueError,
)
from arrow_outputs.schema import check_format

# Every test here runs on the C accelerator and on the pure-Python path.
pytestmark = pytest.mark.usefixtures("codec_path")

KEY = b"arrow_outputs.step"


def _out(n: int = 3, **kw: Any) -> ModelRunnerOutput:
    req_ids = [f"r{i}" for i in range(n)]
    return ModelRunnerOutput(
        req_ids, {r: i for i, r in enumerate(req_ids)}, [[i] for i in range(n)], **kw
    )


def _stream(batches: list[pa.RecordBatch], schema: pa.Schema, *, custom: bool) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as writer:
        for b in batches:
            meta = ao.step_custom_metadata(b) if custom else None
            writer.write_batch(b, custom_metadata=meta)
    return sink.getvalue()


# ----------------------------------------------------------------------- whose metadata


def test_from_record_batch_refuses_step_metadata_inherited_from_file_schema() -> None:
    # The reproducer: no step=, the file opened with the first batch's schema.
    first = ao.to_record_batch(
        _out(kv_connector_output=KVConnectorOutput(finished_sending={"req-9"}))
    )
    second = ao.to_record_batch(_out())
    reader = pa.ipc.open_file(_stream([first, second], first.schema, custom=False))
    for i in range(2):
        with pytest.raises(StepMetadataError) as info:
            ao.from_record_batch(reader.get_batch(i))
        assert "get_batch_with_custom_metadata" in str(info.value)
    # Read correctly, each batch gets its own.
    reader = pa.ipc.open_file(_stream([first, second], ao.run_schema(first), custom=True))
    backs = [
        ao.from_record_batch(b, custom_metadata=m)
        for b, m in (reader.get_batch_with_custom_metadata(i) for i in range(2))
    ]
    assert backs[0].kv_connector_output.finished_sending == {"req-9"}
    assert backs[1].kv_connector_output is None


def test_from_record_batch_refuses_batches_of_a_table() -> None:
    batches = [ao.to_record_batch(_out(), step=s) for s in range(2)]
    first, second = pa.Table.from_batches(batches).to_batches()
    # The table's schema is the first batch's: right for it (same step buffer), not for the
    # second, which is refused rather than decoded as step 0.
    assert ao.step_metadata(first)["step"] == 0
    with pytest.raises(StepMetadataError):
        ao.from_record_batch(second)
    # A stream written without custom metadata, read with read_all(): refused, not defaulted.
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, ao.run_schema(batches[0])) as w:
        for b in batches:
            w.write_batch(b)
    for b in pa.ipc.open_stream(sink.getvalue()).read_all().to_batches():
        with pytest.raises(StepMetadataError, match=r"no arrow_outputs\.step key"):
            ao.from_record_batch(b)


def test_from_record_batch_zero_row_steps_never_share_metadata() -> None:
    a = ao.to_record_batch(ModelRunnerOutput.with_kv_conn_output_only(KVConnectorOutput({"x"})))
    b = ao.to_record_batch(ao.EMPTY_MODEL_RUNNER_OUTPUT, step=5)
    reader = pa.ipc.open_file(_stream([a, b], a.schema, custom=False))
    with pytest.raises(StepMetadataError):
        ao.from_record_batch(reader.get_batch(1))
    # In memory each 0-row batch is its own.
    assert ao.from_record_batch(a).kv_connector_output.finished_sending == {"x"}
    assert ao.step_metadata(b)["step"] == 5


def test_step_custom_metadata_refuses_inherited_schema() -> None:
    batches = [ao.to_record_batch(_out(), step=s) for s in range(2)]
    second_of_table = pa.Table.from_batches(batches).to_batches()[1]
    with pytest.raises(StepMetadataError):
        ao.step_custom_metadata(second_of_table)
    with pytest.raises(StepMetadataError, match="slice"):
        ao.step_custom_metadata(batches[0].slice(1))


def test_the_batch_object_to_record_batch_made_is_known_by_identity_only() -> None:
    from arrow_outputs import _stepmeta

    batch = ao.to_record_batch(_out(), step=3)
    raw = batch.schema.metadata[b"arrow_outputs.step"]
    assert _stepmeta.made(batch) == raw
    assert ao.step_custom_metadata(batch) == {b"arrow_outputs.step": raw}
    # Other objects over the same data are proven by their step column, as before.
    same = pa.RecordBatch.from_arrays(batch.columns, schema=batch.schema)
    assert _stepmeta.made(same) is None
    assert ao.step_custom_metadata(same) == {b"arrow_outputs.step": raw}
    assert _stepmeta.made(batch.slice(1)) is None
    # An entry whose batch is gone never matches another object that got its id.
    other = pa.record_batch([pa.array([1])], names=["x"])
    gone = pa.record_batch([pa.array([2])], names=["y"])
    dead = _stepmeta.weakref.ref(gone)
    del gone
    _stepmeta._BATCHES[id(other)] = (dead, raw)
    assert _stepmeta.made(other) is None
    del _stepmeta._BATCHES[id(other)]


def test_batches_unknown_by_identity_are_still_proven_by_their_step_column() -> None:
    from arrow_outputs import _stepmeta

    first = ao.to_record_batch(_out(), step=1)
    _stepmeta._BATCHES.clear()  # as if registered in another way, or never
    assert _stepmeta.made(first) is None
    assert ao.step_custom_metadata(first)[b"arrow_outputs.step"].startswith(b'{"step":1,')
    assert ao.from_record_batch(first).req_ids == _out().req_ids


def test_registries_keep_every_live_batch_and_drop_the_dead_ones() -> None:
    from arrow_outputs import _stepmeta

    floor = _stepmeta._BATCHES.floor
    kept = [ao.to_record_batch(_out(), step=s) for s in range(floor + 10)]  # past the limit
    slices = [b.slice(1) for b in kept[:3]]
    for s in range(3 * floor):  # each dropped at once, while the kept ones live
        ao.to_record_batch(_out(), step=s)
    for table in (_stepmeta._BATCHES, _stepmeta._OWNED):
        assert len(table) <= 2 * len(kept) + table.floor  # bounded by the live ones
    assert all(_stepmeta.made(b) is not None for b in kept)
    assert all(ao.step_custom_metadata(b) for b in kept[-3:])
    # Slices are proven by their step column buffer, whose entry stays while it lives.
    del kept
    for sl in slices:
        assert ao.step_metadata(sl)["rows"] == 3


def test_registries_lose_no_live_entry_to_a_prune_on_another_thread(monkeypatch) -> None:
    import threading

    from arrow_outputs import _stepmeta

    for table in (_stepmeta._OWNED, _stepmeta._BATCHES):
        monkeypatch.setattr(table, "floor", 8)
        monkeypatch.setattr(table, "limit", 8)  # a prune every few entries
    kept: list[list[pa.RecordBatch]] = [[] for _ in range(4)]

    def work(mine: list[pa.RecordBatch]) -> None:
        for s in range(150):
            batch = ao.to_record_batch(_out(), step=s)
            if s % 2:
                mine.append(batch)  # the others die at once: dead entries to prune

    threads = [threading.Thread(target=work, args=(mine,)) for mine in kept]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for batch in (b for mine in kept for b in mine):
        assert ao.step_metadata(batch.slice(1))["rows"] == 3  # proven by its step column


def test_registry_prune_keeps_what_another_thread_adds_or_replaces_meanwhile() -> None:
    """A prune checks each entry's reference and takes dead entries out one dict operation
    at a time; here another thread's work lands exactly between those operations (the
    reference's call), replacing the entry it is checking and adding another."""
    import weakref

    from arrow_outputs._stepmeta import _Table

    class Kept:
        pass

    table = _Table(4)
    newer, other = Kept(), Kept()
    newer_entry = (weakref.ref(newer), b"newer")
    other_entry = (weakref.ref(other), b"other")

    def dead_but_replaced_meanwhile() -> None:
        table[1] = newer_entry  # key 1's object died; a new one took its address
        table[2] = other_entry
        return None

    table[1] = (dead_but_replaced_meanwhile, b"old")
    table[3] = (lambda: None, b"dead")
    table.prune()
    assert table == {1: newer_entry, 2: other_entry}  # the dead ones gone, no live one lost
    assert table.limit == 4


def test_run_schemas_that_differ_only_in_field_metadata_keep_their_own_types() -> None:
    from arrow_outputs import batch as batch_mod
    from arrow_outputs.schema import ColumnTypes, TensorSpec

    def types_of(dtype: str) -> ColumnTypes:
        schema = ao.output_schema(ColumnTypes(pooler_output=TensorSpec(dtype, 1)))
        return batch_mod._decode_types(schema, schema.metadata)

    # bfloat16 and uint16 columns have the same Arrow type; only field metadata tells them
    # apart, and a run schema (no step key) is looked up whole, metadata and all.
    assert types_of("bfloat16").pooler_output.dtype == "bfloat16"
    assert types_of("uint16").pooler_output.dtype == "uint16"
    assert types_of("bfloat16").pooler_output.dtype == "bfloat16"


def test_check_format_remembers_versions_not_formats() -> None:
    good = ao.output_schema()
    check_format(good)  # the version is remembered as readable
    other = good.with_metadata({**good.metadata, b"arrow_outputs.format": b"another.format"})
    with pytest.raises(SchemaMismatchError, match=r"arrow_outputs\.format"):
        check_format(other)
    newer = good.with_metadata({**good.metadata, b"arrow_outputs.version": b"9.0"})
    with pytest.raises(FormatVersionError):
        check_format(newer)


def test_custom_metadata_as_key_value_metadata_reads_like_any_mapping() -> None:
    from arrow_outputs import batch as batch_mod

    key = b"arrow_outputs.step"
    pairs = [(b"x", b"1"), (key, b"first"), (key, b"last")]

    class Pairs:
        def items(self) -> list[tuple[bytes, bytes]]:
            return pairs

    assert batch_mod._custom_raw(pa.KeyValueMetadata(pairs)) == b"last"
    assert batch_mod._custom_raw(Pairs()) == b"last"
    assert batch_mod._custom_raw(pa.KeyValueMetadata([(b"x", b"1")])) is None


def test_from_record_batch_missing_metadata_defaults_is_opt_in() -> None:
    out = _out(num_nans_in_logits={"r0": 0})
    batch = ao.to_record_batch(out, step=4)
    reader = pa.ipc.open_file(_stream([batch], ao.run_schema(batch), custom=False))
    read = reader.get_batch(0)
    with pytest.raises(StepMetadataError, match="missing_step_metadata='defaults'"):
        ao.from_record_batch(read)
    back = ao.from_record_batch(read, missing_step_metadata="defaults")
    assert back.sampled_token_ids == out.sampled_token_ids
    assert back.num_nans_in_logits == {"r0": 0}
    assert ao.step_metadata(read, missing_step_metadata="defaults")["step"] == 4
    with pytest.raises(FieldTypeError, match="missing_step_metadata"):
        ao.from_record_batch(read, missing_step_metadata="guess")


def _rich(n: int = 4) -> ModelRunnerOutput:
    from arrow_outputs import LogprobsLists, SamplingMaskLists

    rng = np.random.default_rng(0)
    cu = [0, 1, 3, 3, 5][: n + 1]
    pos = cu[-1]
    req_ids = [f"q{i}" for i in range(n)]
    return ModelRunnerOutput(
        req_ids,
        {r: i for i, r in enumerate(req_ids)},
        [list(range(cu[i + 1] - cu[i])) for i in range(n)],
        logprobs=LogprobsLists(
            rng.integers(0, 9, (pos, 3)),
            rng.random((pos, 3), dtype=np.float32),
            rng.integers(0, 9, pos),
            cu,
        ),
        num_nans_in_logits={r: i for i, r in enumerate(req_ids)},
        sampling_masks=SamplingMaskLists(
            np.arange(2 * pos, dtype=np.int32), np.arange(0, 2 * pos + 1, 2), cu
        ),
        kv_connector_output=KVConnectorOutput(finished_recving={"q1"}),
    )


def _subset(out: ModelRunnerOutput, rows: list[int]) -> ModelRunnerOutput:
    full = ao.from_record_batch(ao.to_record_batch(out))
    ids = [full.req_ids[i] for i in rows]
    cu = full.logprobs.cu_num_generated_tokens
    pos = np.concatenate([np.arange(cu[i], cu[i + 1]) for i in rows] + [np.zeros(0)]).astype(int)
    lens = [cu[i + 1] - cu[i] for i in rows]
    new_cu = [0, *np.cumsum(lens).tolist()]
    lp = full.logprobs
    m = full.sampling_masks
    mask_rows = [m.token_ids[m.offsets[p] : m.offsets[p + 1]] for p in pos]
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in mask_rows])]).astype(np.int64)
    return ModelRunnerOutput(
        ids,
        {r: i for i, r in enumerate(ids)},
        [full.sampled_token_ids[i] for i in rows],
        logprobs=type(lp)(
            lp.logprob_token_ids[pos], lp.logprobs[pos], lp.sampled_token_ranks[pos], new_cu
        ),
        num_nans_in_logits={r: full.num_nans_in_logits[r] for r in ids},
        sampling_masks=type(m)(
            np.concatenate(mask_rows).astype(np.int32) if mask_rows else np.zeros(0, np.int32),
            offsets,
            new_cu,
        ),
        kv_connector_output=full.kv_connector_output,
    )


@pytest.mark.parametrize(("start", "length"), [(0, 2), (1, 2), (2, 2), (3, 1), (1, 0)])
def test_from_record_batch_slice_decodes_its_rows(start: int, length: int) -> None:
    out = _rich()
    batch = ao.to_record_batch(out, step=2)
    back = ao.from_record_batch(batch.slice(start, length))
    ao.assert_outputs_equal(back, _subset(out, list(range(start, start + length))))


def test_from_record_batch_filter_with_custom_metadata_decodes_its_rows() -> None:
    out = _rich()
    batch = ao.to_record_batch(out, step=2)
    reader = pa.ipc.open_file(_stream([batch], ao.run_schema(batch), custom=True))
    read, meta = reader.get_batch_with_custom_metadata(0)
    picked = read.filter(pa.array([False, True, False, True]))
    ao.assert_outputs_equal(
        ao.from_record_batch(picked, custom_metadata=meta), _subset(out, [1, 3])
    )
    # A head slice cannot be told from another step's metadata: refused, saying so.
    with pytest.raises(StepMetadataError, match="slice"):
        ao.from_record_batch(read.slice(0, 2), custom_metadata=meta)
    # Rows out of order are no slice of the step.
    shuffled = read.take(pa.array([3, 1]))
    with pytest.raises(StepMetadataError, match="another batch"):
        ao.from_record_batch(shuffled, custom_metadata=meta)


# ----------------------------------------------------------------------- the step JSON


def _with_meta(batch: pa.RecordBatch, edit: Any) -> tuple[pa.RecordBatch, dict[bytes, bytes]]:
    meta = json.loads(batch.schema.metadata[KEY])
    edit(meta)
    return batch, {KEY: json.dumps(meta).encode()}


def _set(path: str, value: Any) -> Any:
    def edit(meta: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = meta
        for p in parents:
            node = node[p]
        node[last] = value

    return edit


def _rich_batch() -> pa.RecordBatch:
    from arrow_outputs import LogprobsTensors

    torch = pytest.importorskip("torch")
    out = _rich()
    out.prompt_logprobs_dict = {
        "q0": LogprobsTensors(
            torch.zeros(2, 3, dtype=torch.int64),
            torch.zeros(2, 3),
            torch.zeros(2, dtype=torch.int64),
        ),
        "q1": None,
        "q2": LogprobsTensors(
            torch.zeros(0, 4, dtype=torch.int64),
            torch.zeros(0, 4),
            torch.zeros(0, dtype=torch.int64),
        ),
    }
    out.cudagraph_stats = ao.CUDAGraphStat(1, 2, 1, "FULL")
    return ao.to_record_batch(out, step=1)


BAD_JSON = [
    ("sampling_mask", 5, "sampling_mask"),
    ("kv_connector_output", [], "kv_connector_output"),
    ("logprobs", "x", "logprobs"),
    ("prompt_logprobs", [1], "prompt_logprobs"),
    ("aux_output", 3, "aux_output"),
    ("prompt_logprobs.none_rows", 5, "none_rows"),
    ("prompt_logprobs.empty_widths", [], "empty_widths"),
    ("prompt_logprobs.empty_widths", {"2": -1}, "empty_widths[2]"),
    ("prompt_logprobs.empty_widths", {"2": 2.5}, "empty_widths[2]"),
    ("prompt_logprobs.empty_widths", {"2": 10**30}, "empty_widths[2]"),
    ("prompt_logprobs.empty_widths", {"x": 1}, "empty_widths"),
    ("prompt_logprobs.none_rows", [99], "none_rows"),
    ("logprobs.width", -1, "logprobs.width"),
    ("logprobs.width", 2.5, "logprobs.width"),
    ("logprobs.width", 10**18, "logprobs.width"),
    ("logprobs.cu", "list2", "logprobs.cu"),
    ("cudagraph_stats", {"num_paddings": 1}, "cudagraph_stats"),
    ("rows", -3, "rows"),
    ("step", "7", "step"),
    ("step", 2**70, "step"),
    ("dropped", 5, "dropped"),
    ("kv_connector_output", {"finished_sending": {"$set": [[1]]}}, "finished_sending"),
    ("kv_connector_output", {"kv_connector_stats": {"$numpy": ["int8", 1000]}}, "$numpy"),
    ("kv_connector_output", {"kv_connector_stats": {"$numpy": ["S", 10**9]}}, "$numpy"),
    ("kv_connector_output", {"kv_connector_stats": {"$numpy": ["V1", 2**31 - 1]}}, "$numpy"),
    ("kv_connector_output", {"kv_connector_stats": {"$dict": 5}}, "$dict"),
    ("kv_connector_output", {"kv_connector_stats": {"$float": "abc"}}, "$float"),
    ("kv_connector_output", {"kv_connector_stats": {"$bytes": "!!"}}, "$bytes"),
    ("kv_connector_output", {"kv_connector_stats": {"$import": "os"}}, "$import"),
    ("kv_connector_output", {"kv_connector_stats": {"$record": {"type": "x"}}}, "$record"),
    ("kv_connector_output", {"unknown_field": 1}, "kv_connector_output"),
    ("surprise", 1, "arrow_outputs.step"),
]


@pytest.mark.parametrize(("path", "value", "where"), BAD_JSON, ids=lambda x: str(x)[:30])
def test_from_record_batch_refuses_bad_step_json(path: str, value: Any, where: str) -> None:
    batch, meta = _with_meta(_rich_batch(), _set(path, value))
    with pytest.raises(StepMetadataError) as info:
        ao.from_record_batch(batch, custom_metadata=meta)
    assert where in info.value.field


@pytest.mark.parametrize("key", ["rows", "step", "cudagraph_stats", "sampled_token_ids"])
def test_from_record_batch_refuses_missing_step_json_keys(key: str) -> None:
    batch, meta = _with_meta(_rich_batch(), lambda m: m.pop(key))
    with pytest.raises(StepMetadataError, match=key):
        ao.from_record_batch(batch, custom_metadata=meta)


@pytest.mark.parametrize("depth", [65, 600, 1000, 100_000])
def test_from_record_batch_refuses_deep_nesting(depth: int) -> None:
    deep = "[" * depth + "]" * depth
    raw = json.loads(_rich_batch().schema.metadata[KEY])
    text = json.dumps(raw, separators=(",", ":"))
    assert '"kv_connector_stats":null' in text
    text = text.replace('"kv_connector_stats":null', f'"kv_connector_stats":{deep}', 1)
    with pytest.raises(StepMetadataError):
        ao.from_record_batch(_rich_batch(), custom_metadata={KEY: text.encode()})


def test_from_record_batch_refuses_non_utf8_metadata() -> None:
    batch = _rich_batch()
    with pytest.raises(StepMetadataError, match="UTF-8"):
        ao.from_record_batch(batch, custom_metadata={KEY: b"\xff\xfe{}"})
    meta = dict(batch.schema.metadata)
    meta[b"arrow_outputs.version"] = b"\xff"
    with pytest.raises(SchemaMismatchError, match="UTF-8"):
        ao.from_record_batch(batch.replace_schema_metadata(meta))
    meta = dict(batch.schema.metadata)
    meta[b"arrow_outputs.run"] = b"\xff"
    with pytest.raises(SchemaMismatchError, match="UTF-8"):
        ao.run_metadata(batch.replace_schema_metadata(meta))


def test_from_record_batch_cu_dtype_goes_through_a_table() -> None:
    code = """
import json, sys
import arrow_outputs as ao, numpy as np, torch
lp = ao.LogprobsTensors(torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2),
                        torch.zeros(2, dtype=torch.int64), None, torch.tensor([0, 1, 2]))
batch = ao.to_record_batch(ao.ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, [[1], [2]],
                                                logprobs=lp))
meta = json.loads(batch.schema.metadata[b"arrow_outputs.step"])
before = set(sys.modules)
for name in ("_inductor", "bool", "float64"):
    meta["logprobs"]["cu_dtype"] = name
    try:
        ao.from_record_batch(batch, custom_metadata={b"arrow_outputs.step": json.dumps(meta)})
    except ao.StepMetadataError:
        pass
    else:
        raise SystemExit("accepted " + name)
new = sorted(m for m in set(sys.modules) - before if m.startswith("torch"))
print(new)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("logprobs", None),
        ("sampling_mask", None),
        ("num_nans_in_logits", None),
        ("prompt_logprobs", None),
        ("sampled_token_ids", "none"),
        ("step", None),
        ("step", 9),
    ],
)
def test_from_record_batch_refuses_claims_the_columns_contradict(key: str, value: Any) -> None:
    batch, meta = _with_meta(_rich_batch(), _set(key, value))
    with pytest.raises(StepMetadataError, match=key):
        ao.from_record_batch(batch, custom_metadata=meta)


def test_from_record_batch_refuses_layouts_that_disagree_with_offsets() -> None:
    batch, meta = _with_meta(_rich_batch(), _set("sampling_mask.cu", False))
    with pytest.raises(ao.OffsetsError, match="one position per request"):
        ao.from_record_batch(batch, custom_metadata=meta)
    batch, meta = _with_meta(_rich_batch(), _set("logprobs.cu", "none"))
    with pytest.raises(ao.OffsetsError):
        ao.from_record_batch(batch, custom_metadata=meta)
    batch, meta = _with_meta(_rich_batch(), _set("prompt_logprobs.empty_widths", {"0": 3}))
    with pytest.raises(ao.ShapeError, match="no positions"):
        ao.from_record_batch(batch, custom_metadata=meta)
    batch, meta = _with_meta(_rich_batch(), _set("prompt_logprobs.none_rows", [0]))
    with pytest.raises(StepMetadataError, match="none_rows"):
        ao.from_record_batch(batch, custom_metadata=meta)


def _replace_column(batch: pa.RecordBatch, name: str, arr: pa.Array) -> pa.RecordBatch:
    i = batch.schema.get_field_index(name)
    cols = list(batch.columns)
    cols[i] = arr
    return pa.RecordBatch.from_arrays(cols, schema=batch.schema)


def test_from_record_batch_refuses_bad_request_columns() -> None:
    batch = ao.to_record_batch(_out(), step=1)
    meta = ao.step_custom_metadata(batch)
    dup = _replace_column(batch, "req_id", pa.array(["r0", "r0", "r2"]))
    with pytest.raises(ConsistencyError, match="unique"):
        ao.from_record_batch(dup, custom_metadata=meta)
    null = _replace_column(batch, "req_id", pa.array(["r0", None, "r2"]))
    with pytest.raises(SchemaMismatchError, match="req_id"):
        ao.from_record_batch(null, custom_metadata=meta)
    index = _replace_column(batch, "req_index", pa.array([2, 1, 0], pa.int32()))
    with pytest.raises(ConsistencyError, match="req_index"):
        ao.from_record_batch(index, custom_metadata=meta)


def test_from_record_batch_refuses_aux_row_without_rows() -> None:
    out = _out(
        1, aux_output_connector_output={"r0": ao.AuxRequestOutput(0, np.ones((1, 2, 2), np.uint16))}
    )
    batch = ao.to_record_batch(out)
    aux = batch.column("aux_output")
    rows = aux.field(1)
    null_rows = pa.Array.from_buffers(
        rows.type, 1, [pa.py_buffer(np.zeros(1, np.uint8))], children=[rows.field(0), rows.field(1)]
    )
    broken = pa.StructArray.from_arrays([aux.field(0), null_rows], fields=list(aux.type))
    with pytest.raises(SchemaMismatchError, match=r"aux_output\.rows"):
        ao.from_record_batch(
            _replace_column(batch, "aux_output", broken),
            custom_metadata=ao.step_custom_metadata(batch),
        )


def test_from_record_batch_buffers_arrow_allows() -> None:
    # A 0-row list array whose only offset is 7, and buffers longer than their elements.
    batch = ao.to_record_batch(_out(0))
    st = batch.column("sampled_token_ids")
    values = pa.array(np.arange(7), pa.int64())
    odd = pa.Array.from_buffers(
        st.type,
        0,
        [None, pa.py_buffer(np.array([7], np.int32).tobytes() + b"\x00\x00\x01")],
        children=[values],
    )
    back = ao.from_record_batch(
        _replace_column(batch, "sampled_token_ids", odd),
        custom_metadata=ao.step_custom_metadata(batch),
    )
    assert back.sampled_token_ids == []


def test_from_record_batch_refuses_negative_shapes() -> None:
    out = _out(1, prompt_token_id_logprobs_dict={"r0": np.zeros((2, 2), np.float32)})
    batch = ao.to_record_batch(out)
    col = batch.column("prompt_token_id_logprobs")
    shape = pa.FixedSizeListArray.from_arrays(pa.array([-2, -2], pa.int32()), 2)
    bad = pa.StructArray.from_arrays([col.field(0), shape], fields=list(col.type))
    with pytest.raises(ao.ShapeError):
        ao.from_record_batch(
            _replace_column(batch, "prompt_token_id_logprobs", bad),
            custom_metadata=ao.step_custom_metadata(batch),
        )


# ----------------------------------------------------------------------- argument kinds


@pytest.mark.parametrize(
    "call",
    [
        lambda b: ao.to_record_batch(_out(), schema=b),
        lambda b: ao.from_record_batch(b, custom_metadata="x"),
        lambda b: ao.from_record_batch(b, custom_metadata={KEY: 5}),
        lambda b: ao.from_record_batch(b, classes="KVConnectorStats"),
        lambda b: ao.run_metadata(5),
        lambda b: ao.run_schema(5),
        lambda b: ao.to_record_batch(_out(), metadata=[1]),
    ],
)
def test_wrong_argument_kinds_raise_field_type_error(call: Any) -> None:
    with pytest.raises(FieldTypeError):
        call(ao.to_record_batch(_out()))


def test_schema_mismatch_says_what_differs() -> None:
    batch = ao.to_record_batch(_out(), step=1)
    fields = [f.with_nullable(True) if f.name == "req_index" else f for f in batch.schema]
    other = pa.schema(fields, metadata=batch.schema.metadata)
    with pytest.raises(SchemaMismatchError) as info:
        ao.from_record_batch(pa.RecordBatch.from_arrays(batch.columns, schema=other))
    assert "nullable" in str(info.value)


@pytest.mark.parametrize("column", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize(
    "bad_type",
    [
        pa.int64(),
        pa.list_(pa.int64()),  # a list of something other than a struct
        pa.list_(pa.list_(pa.int64())),
        pa.map_(pa.string(), pa.int64()),
        pa.list_(pa.struct([("token_ids", pa.list_(pa.int64()))])),  # no rank
        pa.list_(pa.struct([("token_ids", pa.int64()), ("rank", pa.int64())])),  # ids not a list
    ],
    ids=str,
)
def test_file_schema_with_a_foreign_logprobs_type_is_refused_by_name(column, bad_type) -> None:
    # Found by the file fuzzer (40x): a file whose logprobs column was list<list<int64>> made
    # the schema check ask a list type for a field by name, and pyarrow raised TypeError.
    batch = ao.to_record_batch(_out(), step=1)
    schema = ao.run_schema(batch)
    schema = schema.set(schema.get_field_index(column), pa.field(column, bad_type))
    with pytest.raises(SchemaMismatchError, match=column):
        ao.schema.column_types(schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema):
        pass  # a run that ends before its first step: only the schema
    with pytest.raises(SchemaMismatchError, match=column):
        ao.open_run(sink.getvalue())


def test_to_record_batch_accepts_numpy_integer_steps() -> None:
    batch = ao.to_record_batch(_out(), step=np.int32(7))
    assert ao.step_metadata(batch)["step"] == 7
    assert batch.column("step").to_pylist() == [7, 7, 7]


# ----------------------------------------------------------------------- vLLM fidelity


def test_failed_recving_and_ec_connector_stats_round_trip() -> None:
    out = _out(
        kv_connector_output=KVConnectorOutput(failed_recving={"r1"}),
        ec_connector_output=ao.ECConnectorOutput(ec_connector_stats={"loads": [1.5]}),
    )
    assert not out.kv_connector_output.is_empty()
    assert not out.ec_connector_output.is_empty()
    back = ao.from_record_batch(ao.to_record_batch(out))
    assert back.kv_connector_output.failed_recving == {"r1"}
    assert back.ec_connector_output.ec_connector_stats == {"loads": [1.5]}


class OldOutput:
    """A ModelRunnerOutput of an older vLLM: none of the newer attributes."""

    def __init__(self) -> None:
        self.req_ids = ["a"]
        self.req_id_to_index = {"a": 0}
        self.sampled_token_ids = [[3]]
        self.logprobs = None
        self.prompt_logprobs_dict = {}
        self.pooler_output = None
        self.kv_connector_output = OldKV()


class OldKV:
    def __init__(self) -> None:
        self.finished_sending = {"a"}
        self.finished_recving = None
        self.kv_connector_stats = None
        self.kv_cache_events = None
        self.kv_connector_worker_meta = None
        self.invalid_block_ids = set()
        self.expected_finished_count = 0


def test_to_record_batch_older_vllm_objects_get_defaults() -> None:
    back = ao.from_record_batch(ao.to_record_batch(OldOutput()))
    assert back.sampling_masks is None
    assert back.aux_output_connector_output is None
    assert back.cudagraph_stats is None
    assert back.ec_connector_output is None
    assert back.prompt_token_id_logprobs_dict == {}
    assert back.kv_connector_output.failed_recving == set()
    assert back.kv_connector_output.finished_sending == {"a"}


def test_to_record_batch_refuses_unknown_fields_by_name() -> None:
    newer = OldOutput()
    newer.speculative_hidden = [1, 2]  # type: ignore[attr-defined]
    with pytest.raises(UnsupportedValueError) as info:
        ao.to_record_batch(newer)
    assert info.value.field == "output.speculative_hidden"
    kv = OldKV()
    kv.transfer_ids = {4}  # type: ignore[attr-defined]
    with pytest.raises(UnsupportedValueError, match=r"kv_connector_output\.transfer_ids"):
        ao.to_record_batch(_out(kv_connector_output=kv))
    # A field that is None carries nothing: accepted.
    newer.speculative_hidden = None  # type: ignore[attr-defined]
    assert ao.to_record_batch(newer).num_rows == 1


@dataclasses.dataclass
class KVConnectorStats:
    data: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class WorkerMeta:
    completed: dict[int, int]
    nested: tuple[Any, ...] = ()


class Event(NamedTuple):
    block_hashes: list[int]
    medium: str | None


def test_connector_payloads_travel_as_records() -> None:
    kv = KVConnectorOutput(
        kv_connector_stats=KVConnectorStats({"bytes": [1.0, 2.0], "ids": {3}}),
        kv_connector_worker_meta=WorkerMeta({1: 2}, (KVConnectorStats({"x": 1}),)),
        kv_cache_events=[Event([1, 2], "GPU"), Event([3], None)],
    )
    out = _out(kv_connector_output=kv)
    batch = ao.to_record_batch(out, opaque="error")
    assert ao.step_metadata(batch)["dropped"] == []
    back = ao.from_record_batch(batch).kv_connector_output
    stats = back.kv_connector_stats
    assert isinstance(stats, ao.Record)
    assert stats.type_name == f"{__name__}.KVConnectorStats"
    assert stats.data == {"bytes": [1.0, 2.0], "ids": {3}}
    assert stats == ao.Record(stats.type_name, {"data": {"bytes": [1.0, 2.0], "ids": {3}}})
    with pytest.raises(AttributeError):
        stats.data = {}  # type: ignore[misc]
    assert back.kv_cache_events[0].kind == "namedtuple"
    # Re-encoding records gives the same bytes: records are first-class values.
    again = ao.to_record_batch(ao.from_record_batch(batch))
    assert again.schema.metadata[KEY] == batch.schema.metadata[KEY]
    # The allow-list rebuilds exactly the named classes, nested ones too.
    rebuilt = ao.from_record_batch(batch, classes=[KVConnectorStats, WorkerMeta, Event])
    ao.assert_outputs_equal(rebuilt, out)
    partly = ao.from_record_batch(batch, classes=[WorkerMeta]).kv_connector_output
    assert type(partly.kv_connector_worker_meta) is WorkerMeta
    assert isinstance(partly.kv_connector_worker_meta.nested[0], ao.Record)


def test_records_never_import_the_named_class() -> None:
    batch = ao.to_record_batch(
        _out(kv_connector_output=KVConnectorOutput(kv_connector_stats=KVConnectorStats()))
    )
    meta = json.loads(batch.schema.metadata[KEY])
    meta["kv_connector_output"]["kv_connector_stats"]["$record"]["type"] = "antigravity.Fly"
    back = ao.from_record_batch(
        batch, custom_metadata={KEY: json.dumps(meta)}, classes=[KVConnectorStats]
    )
    assert back.kv_connector_output.kv_connector_stats.type_name == "antigravity.Fly"
    assert "antigravity" not in sys.modules


# ----------------------------------------------------------------------- fuzz findings


def _one_stream(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, ao.run_schema(batch)) as w:
        w.write_batch(batch, custom_metadata=ao.step_custom_metadata(batch))
    return sink.getvalue().to_pybytes()


def test_from_record_batch_non_utf8_field_name() -> None:
    data = _one_stream(ao.to_record_batch(_out(2), step=1)).replace(
        b"req_index", b"req_inde\x80", 1
    )
    batch, meta = pa.ipc.open_stream(data).read_next_batch_with_custom_metadata()
    with pytest.raises(SchemaMismatchError, match="UTF-8"):
        ao.from_record_batch(batch, custom_metadata=meta)


def test_tensor_spec_refuses_impossible_ranks() -> None:
    for ndim in (-2, 33, 2.0):
        with pytest.raises(FieldTypeError, match="ndim"):
            ao.TensorSpec("float32", ndim)  # type: ignore[arg-type]
    with pytest.raises(FieldTypeError, match="shape"):
        ao.TensorSpec("float32", 1, (-4,))


def test_from_record_batch_mask_values_offset_past_buffer() -> None:
    masks = ao.SamplingMaskLists(np.empty(0, np.int32), np.zeros(1, np.int64), [0])
    b = ao.to_record_batch(ModelRunnerOutput([], {}, [], sampling_masks=masks), step=1)
    c = b.column("sampling_mask")
    leaf = pa.Array.from_buffers(pa.int32(), 0, [None, pa.py_buffer(b"")], offset=1)
    inner = pa.Array.from_buffers(c.values.type, 0, c.values.buffers()[:2], children=[leaf])
    c = pa.Array.from_buffers(c.type, 0, c.buffers()[:2], children=[inner])
    with pytest.raises(ao.OffsetsError):
        ao.from_record_batch(
            _replace_column(b, "sampling_mask", c), custom_metadata=ao.step_custom_metadata(b)
        )


@pytest.mark.parametrize("index", [[0, 1, -(2**31)], [5, -(2**31) + 1, 0]])
def test_from_record_batch_req_index_overflow_is_no_filter(index: list[int]) -> None:
    b = ao.to_record_batch(_out(), step=1)
    bad = _replace_column(b, "req_index", pa.array(index, pa.int32()))
    with pytest.raises(ao.ArrowOutputsError, match=r"req_index|rows"):
        ao.from_record_batch(bad, custom_metadata=ao.step_custom_metadata(b))


def test_from_record_batch_bfloat16_rows_need_torch_kind() -> None:
    torch = pytest.importorskip("torch")
    b = ao.to_record_batch(_out(1, pooler_output=[torch.ones(4, dtype=torch.bfloat16)]), step=1)
    batch, meta = _with_meta(b, _set("pooler_output", "numpy"))
    with pytest.raises(SchemaMismatchError, match="bfloat16"):
        ao.from_record_batch(batch, custom_metadata=meta)


def test_from_record_batch_null_token_start_under_absent_row() -> None:
    rows = np.zeros((2, 4, 2), np.uint16)
    out = _out(2, aux_output_connector_output={"r0": ao.AuxRequestOutput(4, rows)})
    b = ao.to_record_batch(out, step=1)
    c = b.column("aux_output")
    starts = pa.array([4, None], pa.int64())
    c = pa.Array.from_buffers(c.type, 2, c.buffers()[:1], children=[starts, c.field(1)])
    back = ao.from_record_batch(
        _replace_column(b, "aux_output", c), custom_metadata=ao.step_custom_metadata(b)
    )
    start = back.aux_output_connector_output["r0"].token_start
    assert type(start) is int
    assert start == 4


# ----------------------------------------------------------------------- byte order


def _swapped(a: np.ndarray) -> np.ndarray:
    """The same values in the other byte order: numpy calls its dtype by the native name."""
    return a.astype(a.dtype.newbyteorder())


@pytest.mark.parametrize("field", ["logprob_token_ids", "logprobs", "sampled_token_ranks"])
def test_to_record_batch_refuses_byte_swapped_logprobs(field: str) -> None:
    # Accepted as "int64"/"float32" before, their bytes were read in the wrong order.
    parts = {
        "logprob_token_ids": np.array([[5, 6], [7, 8], [9, 1]], dtype=np.int64),
        "logprobs": np.full((3, 2), -0.5, np.float32),
        "sampled_token_ranks": np.array([1, 1, 2], dtype=np.int64),
    }
    good = ao.LogprobsLists(**parts, cu_num_generated_tokens=None)
    assert ao.from_record_batch(ao.to_record_batch(_out(logprobs=good), step=1)).logprobs[
        0
    ].tolist() == [[5, 6], [7, 8], [9, 1]]
    parts[field] = _swapped(parts[field])
    lp = ao.LogprobsLists(**parts, cu_num_generated_tokens=None)
    with pytest.raises(ao.DTypeError, match=rf"^logprobs\.{field}: expected .*, got >[if]"):
        ao.to_record_batch(_out(logprobs=lp), step=1)


def test_to_record_batch_refuses_byte_swapped_rows_and_masks() -> None:
    with pytest.raises(ao.DTypeError, match=r"^pooler_output\[0\]: expected .*, got >f4$"):
        ao.to_record_batch(_out(1, pooler_output=[_swapped(np.ones(3, np.float32))]), step=1)
    masks = ao.SamplingMaskLists(
        _swapped(np.array([1, 2], np.int32)), np.array([0, 2], np.int64), None
    )
    with pytest.raises(ao.DTypeError, match=r"^sampling_masks\.token_ids: expected int32, got >i4"):
        ao.to_record_batch(_out(1, sampling_masks=masks), step=1)


@pytest.mark.parametrize("field", ["logprob_token_ids", "sampled_token_ranks"])
def test_to_record_batch_refuses_logprob_dtype_other_than_the_runs(field: str) -> None:
    # Plain numpy matrices take the checks' fast path: it must still hold the run's types.
    def lp(**dtypes: Any) -> Any:
        return ao.LogprobsLists(
            np.array([[5, 6], [7, 8], [9, 1]], dtype=dtypes.get("logprob_token_ids", np.int64)),
            np.full((3, 2), -0.5, np.float32),
            np.array([1, 1, 2], dtype=dtypes.get("sampled_token_ranks", np.int64)),
            None,
        )

    run = ao.run_schema(ao.to_record_batch(_out(logprobs=lp()), step=0))
    assert ao.to_record_batch(_out(logprobs=lp()), step=1, schema=run).num_rows == 3
    with pytest.raises(
        SchemaMismatchError,
        match=rf"^logprobs\.{field}: expected int64 \(the run's schema, .*\), got int32$",
    ):
        ao.to_record_batch(_out(logprobs=lp(**{field: np.int32})), step=1, schema=run)
