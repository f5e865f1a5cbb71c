"""``ModelRunnerOutput`` <-> ``pyarrow.RecordBatch``: one row per request, lossless.

Per-request data goes into columns (see ``docs/schema.md``). What a column cannot say
(``None`` vs ``{}``, whether ``cu_num_generated_tokens`` was given, the connector outputs
and CUDA-graph stats of the step, the step number of a 0-row step) goes into the JSON value
of the ``arrow_outputs.step`` metadata key, so every step round-trips exactly.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from functools import lru_cache
from typing import Any

import numpy as np
import pyarrow as pa

from ._checks import arange_offsets, describe, is_arange
from ._jsonish import Dropped, from_jsonable, to_jsonable
from .errors import (
    ConsistencyError,
    FieldTypeError,
    SchemaMismatchError,
    ShapeError,
    UnsupportedValueError,
)
from .logprobs import (
    decode_logprobs,
    decode_prompt_logprobs,
    encode_logprobs,
    encode_prompt_logprobs,
    list_offsets,
)
from .masks import decode_sampling_masks, encode_sampling_masks
from .schema import (
    KEY_STEP,
    ColumnTypes,
    check_format,
    column_types,
    infer_column_types,
    output_schema,
)
from .tensors import decode_tensor_rows, encode_tensor_rows

__all__ = [
    "from_record_batch",
    "run_schema",
    "step_custom_metadata",
    "step_metadata",
    "to_record_batch",
]

_JSON = json.JSONEncoder(separators=(",", ":"))  # one encoder: no per-call setup
_NP_INT = {"int32": np.int32, "int64": np.int64}
_KV_FIELDS = (
    "finished_sending",
    "finished_recving",
    "kv_connector_stats",
    "kv_cache_events",
    "kv_connector_worker_meta",
    "invalid_block_ids",
    "expected_finished_count",
)
_EC_FIELDS = ("finished_sending", "finished_recving", "ec_connector_worker_meta")
_CG_FIELDS = ("num_unpadded_tokens", "num_padded_tokens", "num_paddings", "runtime_mode")


class _Run:
    """What one run schema implies, computed once: types, column types, metadata, nulls.

    Steps of a run pass the same schema object, so lookups are by identity first.
    """

    __slots__ = ("column_type", "metadata", "null_columns", "schema", "types")

    def __init__(self, schema: pa.Schema, types: ColumnTypes) -> None:
        self.schema = schema
        self.types = types
        self.column_type = schema.types
        self.metadata = dict(schema.metadata or {})
        # A batch's schema may be passed as a run schema: its step key is that step's, not ours.
        self.metadata.pop(KEY_STEP, None)
        self.null_columns: dict[int, list[pa.Array]] = {}

    def nulls(self, n: int) -> list[pa.Array]:
        """All-null columns of ``n`` rows (absent fields); steps repeat sizes."""
        cols = self.null_columns.get(n)
        if cols is None:
            if len(self.null_columns) > 64:
                self.null_columns.clear()
            cols = self.null_columns[n] = [pa.nulls(n, t) for t in self.column_type]
        return cols


_RUNS: list[_Run] = []  # most recent first


def _run_of(schema: pa.Schema) -> _Run:
    for run in _RUNS:
        if run.schema is schema:
            return run
    for run in _RUNS:
        if run.schema.equals(schema, check_metadata=True):
            return run
    run = _Run(schema, column_types(schema))
    _RUNS.insert(0, run)
    del _RUNS[8:]
    return run


_DECODE: list[tuple[pa.Schema, ColumnTypes]] = []  # most recent first


def _decode_types(schema: pa.Schema) -> ColumnTypes:
    """The column types of a batch's schema, cached across the batches of a run.

    The key drops the schema-level metadata (its step key changes every batch) but keeps the
    field metadata (``arrow_outputs.dtype`` tells bfloat16 from uint16).
    """
    key = schema.remove_metadata()
    for cached, types in _DECODE:
        if cached.equals(key, check_metadata=True):
            return types
    types = column_types(schema)
    _DECODE.insert(0, (key, types))
    del _DECODE[8:]
    return types


_INFERRED: dict[tuple[ColumnTypes, str], pa.Schema] = {}


def _inferred_schema(output: Any, metadata: dict[str, Any] | None) -> pa.Schema:
    types = infer_column_types(output)
    key = (types, json.dumps(metadata, sort_keys=True, default=repr))
    schema = _INFERRED.get(key)
    if schema is None:
        if len(_INFERRED) > 64:
            _INFERRED.clear()
        schema = _INFERRED[key] = output_schema(types, metadata=metadata)
    return schema


@lru_cache(maxsize=64)
def _req_index(n: int) -> pa.Array:
    return pa.array(np.arange(n, dtype=np.int32))


@lru_cache(maxsize=64)
def _range_list(n: int) -> list[int]:
    return list(range(n))


# ----------------------------------------------------------------------------- encode


def _check_req_ids(req_ids: Any, index: Any) -> int:
    if type(req_ids) is not list:
        raise FieldTypeError("req_ids", "a list of str", describe(req_ids))
    if not isinstance(index, dict):
        raise FieldTypeError("req_id_to_index", "a dict of str to int", describe(index))
    n = len(req_ids)
    # Fast path: vLLM builds the dict in req_ids order. Equal key lists also prove that
    # req_ids has no duplicates (dict keys are unique).
    if list(index) == req_ids and list(index.values()) == _range_list(n):
        return n
    if len(set(req_ids)) != n:
        dup = next(r for r, count in Counter(req_ids).items() if count > 1)
        raise ConsistencyError("req_ids", "unique request ids", f"{dup!r} twice")
    if len(index) != n:
        raise ConsistencyError(
            "req_id_to_index", f"{n} entries (one per req_id)", f"{len(index)} entries"
        )
    for i, rid in enumerate(req_ids):
        if index.get(rid) != i:
            raise ConsistencyError(
                f"req_id_to_index[{rid!r}]", f"{i} (its position in req_ids)", repr(index.get(rid))
            )
    return n


def _req_id_array(req_ids: list[Any]) -> pa.Array:
    try:
        return pa.array(req_ids, pa.string())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        i = next(i for i, r in enumerate(req_ids) if type(r) is not str)
        raise FieldTypeError(f"req_ids[{i}]", "a str", describe(req_ids[i])) from None


def _sampled(st: Any, n: int, id_type: str, null_column: pa.Array) -> tuple[pa.Array, str]:
    if type(st) is not list:
        raise FieldTypeError("sampled_token_ids", "a list of lists of int", describe(st))
    if not st:
        # A pooling step: no sampled ids at all, while requests exist.
        return null_column, "none"
    if len(st) != n:
        raise ShapeError("sampled_token_ids", f"{n} lists (one per request) or []", f"{len(st)}")
    if list(map(type, st)).count(list) != n:  # the C-level form of all(type(x) is list)
        i = next(i for i, x in enumerate(st) if type(x) is not list)
        raise FieldTypeError(f"sampled_token_ids[{i}]", "a list of int", describe(st[i]))
    flat_list = list(itertools.chain.from_iterable(st))
    # Exactly int: a float would be truncated and a bool stored as 1 otherwise.
    if list(map(type, flat_list)).count(int) != len(flat_list):
        i = next(i for i, x in enumerate(st) if any(type(v) is not int for v in x))
        raise FieldTypeError(f"sampled_token_ids[{i}]", "a list of int", describe(st[i]))
    try:
        flat = np.array(flat_list, dtype=np.int64)
    except OverflowError:
        big = max(flat_list, key=abs)
        raise UnsupportedValueError(
            "sampled_token_ids", f"token ids within {id_type} (the run's id type)", str(big)
        ) from None
    if len(flat) == n and all(st):
        offsets = arange_offsets(n)  # n ids and no list empty: one id each (a decode step)
    else:
        lens = np.fromiter(map(len, st), dtype=np.int64, count=n)
        if lens.sum() > 2**31 - 1:
            raise ShapeError("sampled_token_ids", "at most 2**31 - 1 ids per step", str(lens.sum()))
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(lens, out=offsets[1:])
    np_type = _NP_INT[id_type]
    if flat.dtype != np_type:
        info = np.iinfo(np_type)
        if flat.size and (flat.min() < info.min or flat.max() > info.max):
            raise UnsupportedValueError(
                "sampled_token_ids",
                f"token ids within {id_type} (the run's id type)",
                f"values from {flat.min()} to {flat.max()}",
            )
        flat = flat.astype(np_type)
    t = null_column.type
    values = pa.Array.from_buffers(t.value_type, len(flat), [None, pa.py_buffer(flat)])
    arr = pa.Array.from_buffers(t, n, [None, pa.py_buffer(offsets)], children=[values])
    return arr, "lists"


def _keyed_rows(d: Any, index: dict[str, int], n: int, field: str) -> tuple[list[Any], list[int]]:
    """Per-row values of a req_id-keyed dict (missing -> None) and rows present with None.

    ``index`` is the step's ``req_id_to_index``, already proven to map req_ids[i] to i.
    """
    if not isinstance(d, dict):
        raise FieldTypeError(field, "a dict keyed by request id", describe(d))
    rows: list[Any] = [None] * n
    none_rows: list[int] = []
    for key, value in d.items():
        i = index.get(key)
        if i is None:
            raise ConsistencyError(field, "keys that are request ids of this step", repr(key))
        rows[i] = value
        if value is None:
            none_rows.append(i)
    return rows, none_rows


def _step_object(
    obj: Any, names: tuple[str, ...], field: str, opaque: str, dropped: Dropped
) -> dict[str, Any] | None:
    if obj is None:
        return None
    missing = [name for name in names if not hasattr(obj, name)]
    if missing:
        raise FieldTypeError(field, f"an object with {', '.join(names)}", describe(obj))
    return {
        name: to_jsonable(getattr(obj, name), f"{field}.{name}", opaque, dropped) for name in names
    }


def to_record_batch(
    output: Any,
    *,
    step: int | None = None,
    metadata: dict[str, Any] | None = None,
    schema: pa.Schema | None = None,
    opaque: str = "drop",
) -> pa.RecordBatch:
    """A ``ModelRunnerOutput`` (ours or vLLM's) as one record batch, one row per request.

    Parameters
    ----------
    output
        The step's output; any object with ``ModelRunnerOutput``'s attribute names.
    step
        The engine step number, stored in the ``step`` column and the step metadata.
    metadata
        User run metadata (JSON-serialisable dict); only without ``schema``.
    schema
        The run's schema (the first batch's, or :func:`output_schema`). Without it the
        schema is inferred from this step. With it, data of other dtypes is refused.
    opaque
        ``"drop"`` (default): connector objects that are not plain data are dropped with an
        :class:`OpaqueValueWarning` and listed in the step metadata; ``"error"`` raises.
        Nothing is ever pickled.

    Examples
    --------
    >>> from arrow_outputs.outputs import ModelRunnerOutput
    >>> out = ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, [[7], [8, 9]])
    >>> batch = to_record_batch(out, step=3)
    >>> batch.num_rows, batch.column("sampled_token_ids").to_pylist()
    (2, [[7], [8, 9]])
    >>> from_record_batch(batch) == out
    True
    """
    if opaque not in ("drop", "error"):
        raise FieldTypeError("opaque", "'drop' or 'error'", repr(opaque))
    for name in ("req_ids", "req_id_to_index"):
        if not hasattr(output, name):
            raise FieldTypeError("output", "a ModelRunnerOutput", describe(output))
    if step is not None and type(step) is not int:
        raise FieldTypeError("step", "an int or None", describe(step))
    if step is not None and not -(2**63) <= step < 2**63:
        raise UnsupportedValueError("step", "a step number within int64", str(step))
    req_ids = output.req_ids
    index = output.req_id_to_index
    n = _check_req_ids(req_ids, index)
    if schema is None:
        schema = _inferred_schema(output, metadata)
    elif metadata is not None:
        raise ConsistencyError(
            "metadata", "None when a schema is given (run metadata lives in the schema)", "a dict"
        )
    run = _run_of(schema)
    types = run.types
    nulls = run.nulls(n)
    # "rows" lets a reader notice step metadata that belongs to another batch.
    meta: dict[str, Any] = {"step": step, "rows": n}
    dropped: Dropped = []

    step_col = nulls[0] if step is None else pa.array(np.full(n, step, dtype=np.int64))
    sampled, meta["sampled_token_ids"] = _sampled(
        output.sampled_token_ids, n, types.sampled_token_ids, nulls[3]
    )

    lp = output.logprobs
    if lp is None:
        logprobs = nulls[4]
        meta["logprobs"] = None
    else:
        logprobs, meta["logprobs"] = encode_logprobs(
            lp,
            "logprobs",
            id_type=types.logprob_token_ids,
            rank_type=types.logprob_ranks,
            num_rows=n,
        )

    prompt = output.prompt_logprobs_dict
    if prompt:
        rows, none_rows = _keyed_rows(prompt, index, n, "prompt_logprobs_dict")
        prompt_arr, layout = encode_prompt_logprobs(
            rows,
            "prompt_logprobs_dict",
            keys=req_ids,
            id_type=types.prompt_logprob_token_ids,
            rank_type=types.prompt_logprob_ranks,
        )
        meta["prompt_logprobs"] = {"none_rows": none_rows, **layout}
    else:
        if not isinstance(prompt, dict):
            raise FieldTypeError("prompt_logprobs_dict", "a dict", describe(prompt))
        prompt_arr = nulls[5]

    tid = output.prompt_token_id_logprobs_dict
    if tid:
        rows, none_rows = _keyed_rows(tid, index, n, "prompt_token_id_logprobs_dict")
        if none_rows:
            raise FieldTypeError(
                f"prompt_token_id_logprobs_dict[{req_ids[none_rows[0]]!r}]", "a tensor", "None"
            )
        tid_arr, kind = encode_tensor_rows(
            rows, types.prompt_token_id_logprobs, "prompt_token_id_logprobs_dict", req_ids
        )
        meta["prompt_token_id_logprobs"] = kind
    else:
        if not isinstance(tid, dict):
            raise FieldTypeError("prompt_token_id_logprobs_dict", "a dict", describe(tid))
        tid_arr = nulls[6]

    pooler = output.pooler_output
    if pooler is None:
        pooler_arr = nulls[7]
        meta["pooler_output"] = None
    else:
        if type(pooler) is not list:
            raise FieldTypeError("pooler_output", "a list of tensors (or None)", describe(pooler))
        if len(pooler) != n:
            raise ShapeError("pooler_output", f"{n} rows (one per request)", str(len(pooler)))
        pooler_arr, meta["pooler_output"] = encode_tensor_rows(
            pooler, types.pooler_output, "pooler_output"
        )

    nans = output.num_nans_in_logits
    if nans is None:
        nans_arr = nulls[8]
        meta["num_nans_in_logits"] = None
    else:
        rows, none_rows = _keyed_rows(nans, index, n, "num_nans_in_logits")
        bad = [i for i, v in enumerate(rows) if v is not None and type(v) is not int]
        if none_rows or bad:
            i = (none_rows + bad)[0]
            raise FieldTypeError(f"num_nans_in_logits[{req_ids[i]!r}]", "an int", describe(rows[i]))
        try:
            nans_arr = pa.array(rows, pa.int32())
        except (pa.ArrowInvalid, OverflowError) as e:
            raise UnsupportedValueError(
                "num_nans_in_logits",
                "counts within int32",
                str(max(v for v in rows if v is not None)),
            ) from e
        meta["num_nans_in_logits"] = "dict"

    masks = output.sampling_masks
    if masks is None:
        mask_arr = nulls[9]
        meta["sampling_mask"] = None
    else:
        mask_arr, meta["sampling_mask"] = encode_sampling_masks(masks, "sampling_masks", num_rows=n)

    aux = output.aux_output_connector_output
    if aux is None:
        aux_arr = nulls[10]
        meta["aux_output"] = None
    else:
        aux_arr, meta["aux_output"] = _encode_aux(aux, req_ids, index, types, run.column_type[10])

    meta["kv_connector_output"] = _step_object(
        output.kv_connector_output, _KV_FIELDS, "kv_connector_output", opaque, dropped
    )
    meta["ec_connector_output"] = _step_object(
        output.ec_connector_output, _EC_FIELDS, "ec_connector_output", opaque, dropped
    )
    meta["cudagraph_stats"] = _step_object(
        output.cudagraph_stats, _CG_FIELDS, "cudagraph_stats", opaque, dropped
    )
    if dropped:
        meta["dropped"] = dropped

    arrays = [
        step_col,
        _req_id_array(req_ids),
        _req_index(n),
        sampled,
        logprobs,
        prompt_arr,
        tid_arr,
        pooler_arr,
        nans_arr,
        mask_arr,
        aux_arr,
    ]
    run_meta = run.metadata.copy()
    run_meta[KEY_STEP] = _JSON.encode(meta).encode()
    return pa.RecordBatch.from_arrays(arrays, schema=schema.with_metadata(run_meta))


def _encode_aux(
    aux: Any, req_ids: list[str], index: dict[str, int], types: ColumnTypes, aux_type: pa.DataType
) -> tuple[pa.Array, Any]:
    n = len(req_ids)
    items = getattr(aux, "items", None)
    if items is None:
        raise FieldTypeError(
            "aux_output_connector_output",
            "a mapping of request id to AuxRequestOutput",
            describe(aux),
        )
    rows, none_rows = _keyed_rows(dict(items()), index, n, "aux_output_connector_output")
    if none_rows:
        raise FieldTypeError(
            f"aux_output_connector_output[{req_ids[none_rows[0]]!r}]", "an AuxRequestOutput", "None"
        )
    starts = np.zeros(n, dtype=np.int64)
    tensors: list[Any] = []
    for i, r in enumerate(rows):
        if r is None:
            tensors.append(None)
            continue
        f = f"aux_output_connector_output[{req_ids[i]!r}]"
        if not hasattr(r, "token_start") or not hasattr(r, "rows"):
            raise FieldTypeError(f, "an object with token_start and rows", describe(r))
        for extra in ("logprobs", "prompt_logprobs"):
            if getattr(r, extra, None) is not None:
                raise UnsupportedValueError(
                    f"{f}.{extra}", "None (not part of the format)", describe(getattr(r, extra))
                )
        if type(r.token_start) is not int:
            raise FieldTypeError(f"{f}.token_start", "an int", describe(r.token_start))
        if r.rows is None:
            raise FieldTypeError(f"{f}.rows", "a 3-D uint8/uint16 array", "None")
        starts[i] = r.token_start
        tensors.append(r.rows)
    rows_arr, kind = encode_tensor_rows(
        tensors, types.aux_rows, "aux_output_connector_output", req_ids
    )
    valid = np.fromiter((t is not None for t in tensors), dtype=bool, count=n)
    validity = None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))
    start_arr = pa.array(starts)
    arr = pa.Array.from_buffers(aux_type, n, [validity], children=[start_arr, rows_arr])
    return arr, {"kind": kind}


# ----------------------------------------------------------------------------- decode


def run_schema(batch_or_schema: pa.RecordBatch | pa.Schema) -> pa.Schema:
    """The run's schema: a batch's schema without its step metadata.

    Open IPC writers with it; per-step metadata then travels with each batch
    (:func:`step_custom_metadata`), never in the stream's one schema message.

    Examples
    --------
    >>> from arrow_outputs.outputs import ModelRunnerOutput
    >>> batch = to_record_batch(ModelRunnerOutput(["a"], {"a": 0}, [[1]]), step=0)
    >>> b"arrow_outputs.step" in run_schema(batch).metadata
    False
    """
    schema = getattr(batch_or_schema, "schema", batch_or_schema)
    meta = dict(schema.metadata or {})
    meta.pop(KEY_STEP, None)
    return schema.with_metadata(meta)


def step_custom_metadata(batch: pa.RecordBatch) -> dict[bytes, bytes]:
    """The IPC custom metadata that carries a batch's step metadata through a stream or file.

    Examples
    --------
    >>> import pyarrow as pa
    >>> from arrow_outputs.outputs import ModelRunnerOutput
    >>> batch = to_record_batch(ModelRunnerOutput(["a"], {"a": 0}, [[1]]), step=4)
    >>> sink = pa.BufferOutputStream()
    >>> with pa.ipc.new_stream(sink, run_schema(batch)) as writer:
    ...     writer.write_batch(batch, custom_metadata=step_custom_metadata(batch))
    >>> read, meta = pa.ipc.open_stream(sink.getvalue()).read_next_batch_with_custom_metadata()
    >>> step_metadata(read, meta)["step"]
    4
    """
    raw = (batch.schema.metadata or {}).get(KEY_STEP)
    if raw is None:
        raise SchemaMismatchError(
            "batch.schema.metadata",
            "an arrow_outputs.step key (a batch of to_record_batch)",
            "no such key",
        )
    return {KEY_STEP: raw}


def step_metadata(batch: pa.RecordBatch, custom_metadata: Any = None) -> dict[str, Any]:
    """The step-level JSON of a batch (from IPC custom metadata when given, else the schema).

    Absent (a batch that went through a tool that drops metadata), every field takes its
    plain reading: columns' nulls mean None, offsets are explicit, no connector outputs.
    """
    raw = None
    if custom_metadata is not None:
        raw = dict(custom_metadata).get(KEY_STEP, dict(custom_metadata).get(KEY_STEP.decode()))
    if raw is None:
        raw = (batch.schema.metadata or {}).get(KEY_STEP)
    if raw is None:
        return {}
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise SchemaMismatchError("schema.metadata[arrow_outputs.step]", "JSON", str(e)) from e
    if not isinstance(meta, dict):
        raise SchemaMismatchError(
            "schema.metadata[arrow_outputs.step]", "a JSON object", type(meta).__name__
        )
    rows, step = meta.get("rows", batch.num_rows), meta.get("step")
    stale = rows != batch.num_rows
    if not stale and step is not None and rows:
        first = batch.column(0)[0].as_py()
        stale = first is not None and first != step
    if stale:
        raise SchemaMismatchError(
            "arrow_outputs.step",
            f"this batch's step metadata ({batch.num_rows} rows); IPC streams and files carry "
            "it as each batch's custom metadata (step_custom_metadata, "
            "read_next_batch_with_custom_metadata / get_batch_with_custom_metadata)",
            f"the metadata of another batch ({rows} rows, step {step})",
        )
    return meta


def from_record_batch(
    batch: pa.RecordBatch, *, custom_metadata: Any = None, validate: bool = True
) -> Any:
    """A record batch made by :func:`to_record_batch` back into a ``ModelRunnerOutput``.

    Arrays and tensors are views of the batch's buffers (zero-copy): read-only when the
    batch came from IPC, and to be treated as read-only always, since they share memory with
    the batch (and, in memory, with the producer's arrays). Python lists are made where vLLM
    has lists.

    Parameters
    ----------
    batch
        A batch of this format (its schema metadata names the format and version).
    custom_metadata
        The batch's IPC custom metadata, when step metadata travelled there.
    validate
        Run ``batch.validate(full=True)`` first: batches from elsewhere are untrusted, and
        only full validation catches bad offsets. ``False`` is for batches this process
        made itself: the checks that full validation makes are then skipped, not redone.
    """
    from .outputs import (
        CUDAGraphStat,
        ECConnectorOutput,
        KVConnectorOutput,
        ModelRunnerOutput,
    )

    if not isinstance(batch, pa.RecordBatch):
        raise FieldTypeError("batch", "a pyarrow.RecordBatch", describe(batch))
    schema = batch.schema
    check_format(schema)  # every batch: the run cache below ignores metadata
    types = _decode_types(schema)
    meta = step_metadata(batch, custom_metadata)
    if validate:
        try:
            batch.validate(full=True)
        except pa.ArrowInvalid as e:
            raise SchemaMismatchError("batch", "a valid Arrow record batch", str(e)) from e
    n = batch.num_rows
    column = batch.column

    req_ids = column(1).to_numpy(zero_copy_only=False).tolist() if n else []
    index = column(2).to_numpy()
    # The writer's index column is 0..n-1; a cheap byte compare proves it and skips tolist.
    req_id_to_index = dict(zip(req_ids, range(n) if _is_arange_values(index) else index.tolist()))

    sampled_mode = meta.get("sampled_token_ids")
    if sampled_mode == "none" or (sampled_mode is None and n and column(3).null_count == n):
        sampled: list[Any] = []  # a pooling step
    else:
        sampled = _decode_sampled(column(3))

    lp_layout = _layout(meta, "logprobs", batch, 4)
    logprobs = (
        None
        if lp_layout is None
        else decode_logprobs(column(4), lp_layout, "logprobs", validated=True)
    )

    prompt: dict[str, Any] = {}
    prompt_layout = _layout(meta, "prompt_logprobs", batch, 5)
    if prompt_layout is not None:
        entries = decode_prompt_logprobs(column(5), prompt_layout, "prompt_logprobs")
        none_rows = set(prompt_layout.get("none_rows", ()))
        prompt = {req_ids[i]: e for i, e in enumerate(entries) if e is not None or i in none_rows}

    tid: dict[str, Any] = {}
    tid_kind = _layout(meta, "prompt_token_id_logprobs", batch, 6, "torch")
    if tid_kind is not None:
        rows = decode_tensor_rows(
            column(6), types.prompt_token_id_logprobs, tid_kind, "prompt_token_id_logprobs"
        )
        tid = {req_ids[i]: r for i, r in enumerate(rows) if r is not None}

    pooler_kind = _layout(meta, "pooler_output", batch, 7, "torch")
    pooler = (
        None
        if pooler_kind is None
        else decode_tensor_rows(column(7), types.pooler_output, pooler_kind, "pooler_output")
    )

    nans = None
    if _layout(meta, "num_nans_in_logits", batch, 8, "dict") is not None:
        values = column(8).to_pylist()
        nans = {req_ids[i]: v for i, v in enumerate(values) if v is not None}

    mask_layout = _layout(meta, "sampling_mask", batch, 9)
    masks = (
        None
        if mask_layout is None
        else decode_sampling_masks(column(9), mask_layout, "sampling_mask")
    )

    aux_layout = _layout(meta, "aux_output", batch, 10)
    aux = None if aux_layout is None else _decode_aux(column(10), req_ids, types, aux_layout)

    kv = meta.get("kv_connector_output")
    ec = meta.get("ec_connector_output")
    cg = meta.get("cudagraph_stats")
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index=req_id_to_index,
        sampled_token_ids=sampled,
        logprobs=logprobs,
        prompt_logprobs_dict=prompt,
        prompt_token_id_logprobs_dict=tid,
        pooler_output=pooler,
        kv_connector_output=None
        if kv is None
        else KVConnectorOutput(**{k: from_jsonable(v) for k, v in kv.items() if k in _KV_FIELDS}),
        ec_connector_output=None
        if ec is None
        else ECConnectorOutput(**{k: from_jsonable(v) for k, v in ec.items() if k in _EC_FIELDS}),
        num_nans_in_logits=nans,
        cudagraph_stats=None
        if cg is None
        else CUDAGraphStat(**{k: from_jsonable(v) for k, v in cg.items() if k in _CG_FIELDS}),
        aux_output_connector_output=aux,
        sampling_masks=masks,
    )


def _layout(
    meta: dict[str, Any], key: str, batch: pa.RecordBatch, i: int, default: Any = None
) -> Any:
    """A field's layout facts: from the step metadata, else read off the column's nulls."""
    if key in meta:
        return meta[key]
    col = batch.column(i)
    if col.null_count < len(col):
        return {} if default is None else default
    return None


def _is_arange_values(values: np.ndarray) -> bool:
    """True for ``[0, 1, ..., n-1]``."""
    return len(values) == 0 or (values.dtype == np.int32 and is_arange(values))


def _decode_sampled(col: pa.Array) -> list[list[int]]:
    if col.null_count:
        raise SchemaMismatchError(
            "sampled_token_ids",
            "no nulls, or nulls in every row (a pooling step)",
            f"{col.null_count} nulls of {len(col)}",
        )
    offs = list_offsets(col, np.int32)  # monotonic and in bounds: validated (or trusted)
    lo, hi = int(offs[0]), int(offs[-1])
    values = col.values.to_numpy()[lo:hi]
    n = len(col)
    if n and is_arange(offs, int(offs[1]) - lo):
        # Uniform lengths (every decode step without speculation): one C-level tolist.
        return values.reshape(n, -1).tolist()
    flat = values.tolist()
    bounds = (offs - lo).tolist()
    return [flat[a:b] for a, b in itertools.pairwise(bounds)]


def _decode_aux(
    col: pa.Array, req_ids: list[str], types: ColumnTypes, layout: dict[str, Any]
) -> dict[str, Any]:
    from .outputs import AuxRequestOutput

    starts = col.field(0).to_numpy(zero_copy_only=False).tolist()
    valid = col.is_valid().to_numpy(zero_copy_only=False)
    rows = decode_tensor_rows(
        col.field(1), types.aux_rows, layout.get("kind", "numpy"), "aux_output.rows"
    )
    return {
        req_ids[i]: AuxRequestOutput(starts[i], rows[i]) for i in range(len(req_ids)) if valid[i]
    }
