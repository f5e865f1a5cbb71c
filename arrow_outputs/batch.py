"""``ModelRunnerOutput`` <-> ``pyarrow.RecordBatch``: one row per request, lossless.

Per-request data goes into columns (see ``docs/schema.md``). What a column cannot say
(``None`` vs ``{}``, whether ``cu_num_generated_tokens`` was given, the connector outputs
and CUDA-graph stats of the step, the step number of a 0-row step) goes into the step JSON,
so every step round-trips exactly. The JSON rides in the batch's schema metadata in memory
and in each message's custom metadata in IPC; :mod:`arrow_outputs._stepmeta` decides whose
it is.

The codec is one table, :data:`_CODECS`: each column's encoder, decoder, step JSON key and
output field. Adding a vLLM field is a change in one place.
"""

from __future__ import annotations

import array as _array
import copy
import dataclasses
import itertools
import json
import operator
from collections import Counter
from collections.abc import Callable, Iterable
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from . import _accel, _stepmeta
from ._checks import arange_offsets, check_monotonic, describe, is_arange
from ._jsonish import Dropped, from_jsonable, to_jsonable
from .errors import (
    ConsistencyError,
    FieldTypeError,
    SchemaMismatchError,
    ShapeError,
    StepMetadataError,
    UnsupportedValueError,
)
from .logprobs import (
    _flat_values,
    _host_lists_node,
    decode_logprobs,
    decode_prompt_logprobs,
    encode_logprobs,
    encode_prompt_logprobs,
    list_offsets,
)
from .masks import _host_masks_node, decode_sampling_masks, encode_sampling_masks
from .outputs import (
    AuxRequestOutput,
    CUDAGraphStat,
    ECConnectorOutput,
    KVConnectorOutput,
    LogprobsLists,
    ModelRunnerOutput,
    SamplingMaskLists,
)
from .records import allow_list, rebuild
from .schema import (
    COLUMNS,
    KEY_STEP,
    ColumnTypes,
    check_format,
    column_types,
    infer_column_types,
    logprob_ranks,
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

_JSON = json.JSONEncoder(separators=(",", ":"))


def _json_writer() -> Callable[[Any], str]:
    """``_JSON.encode``, through CPython's C encoder made once: ``JSONEncoder.encode`` makes one
    on every call, a third of its cost for a step's JSON. Its arguments are an implementation
    detail of the json module, so it is used only where it gives ``_JSON.encode``'s exact
    output for a probe; step JSON is acyclic (made by the encoder from scratch), so the
    circular-reference markers are left out."""
    make = getattr(json.encoder, "c_make_encoder", None)
    probe = {"a": [1, -2.5, None, True, "é\n"], "b": {"c": {}}, "d": []}
    try:
        enc = make(  # type: ignore[misc]
            None,
            _JSON.default,
            json.encoder.encode_basestring_ascii,
            None,
            ":",
            ",",
            False,
            False,
            True,
        )
        if "".join(enc(probe, 0)) == _JSON.encode(probe):
            return lambda obj: "".join(enc(obj, 0))
    except TypeError:  # None (no C module), or another signature
        pass
    return _JSON.encode


_json_encode = _json_writer()
# dtype objects, not scalar types: numpy converts a type to its dtype on every call (0.2 us
# for each array the decode makes).
_NP_INT: dict[str, np.dtype[Any]] = {"int32": np.dtype(np.int32), "int64": np.dtype(np.int64)}
MISSING_POLICIES = ("error", "defaults")


def _declared(cls: type) -> dict[str, Any]:
    """Field name -> default (``dataclasses.MISSING`` when required), in declaration order."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = dataclasses.MISSING
    return out


# The step-level classes, their fields and defaults: objects of other vLLM versions that lack
# a newer field get its default; a field we do not know is refused (never dropped).
_STEP_CLASSES: dict[str, type] = {
    "kv_connector_output": KVConnectorOutput,
    "ec_connector_output": ECConnectorOutput,
    "cudagraph_stats": CUDAGraphStat,
}
_FIELDS: dict[type, dict[str, Any]] = {
    cls: _declared(cls) for cls in (ModelRunnerOutput, *_STEP_CLASSES.values())
}
_SPEC = _stepmeta.step_spec(
    tuple(_FIELDS[KVConnectorOutput]),
    tuple(_FIELDS[ECConnectorOutput]),
    tuple(_FIELDS[CUDAGraphStat]),
)


# ----------------------------------------------------------------------------- run caches


class _Run:
    """What one run schema implies, computed once: types, metadata, all-null columns."""

    __slots__ = (
        "arrow_types",
        "last_req_ids",
        "metadata",
        "misses",
        "null_columns",
        "schema",
        "types",
    )

    def __init__(self, schema: pa.Schema, types: ColumnTypes) -> None:
        self.schema = schema
        self.types = types
        self.arrow_types: dict[str, pa.DataType] = dict(zip(schema.names, schema.types))
        self.metadata = dict(schema.metadata or {})
        # A batch's schema may be passed as a run schema: its step key is that step's, not ours.
        self.metadata.pop(KEY_STEP, None)
        self.null_columns: dict[int, dict[str, pa.Array]] = {}
        # (a copy of the last step's req_ids, its req_id node): one tuple, so that a reader
        # on another thread never pairs one step's ids with another's column.
        self.last_req_ids: tuple[list[Any], Any] | None = None
        self.misses = 0  # steps in a row whose req_id column was not reused

    def req_id_column(self, req_ids: list[Any]) -> Any:
        """The req_id column; on the C path the last step's when req_ids holds the very same
        str objects in the same order (a decode step that kept every request), which were
        proven exact strs with a UTF-8 form when that column was built.

        The copy of req_ids that the next step is compared with costs about what a reuse
        saves, and steps that lose or gain a request never reuse: after
        ``_SNAPSHOT_AFTER`` steps in a row without reuse, the copy is taken only every
        ``_SNAPSHOT_EVERY``-th step, which notices when the steps settle again."""
        last = self.last_req_ids
        if last is not None and _accel.accelerated() and _accel.same_items(req_ids, last[0]):
            self.misses = 0
            return last[1]
        col = _req_id_array(req_ids)
        if type(col) is tuple:  # a node: the C walk accepted every id
            misses = self.misses = self.misses + 1
            keep = misses <= _SNAPSHOT_AFTER or misses % _SNAPSHOT_EVERY == 0
            self.last_req_ids = (list(req_ids), col) if keep else None
        return col

    def nulls(self, n: int) -> dict[str, pa.Array]:
        """All-null columns of ``n`` rows by name (absent fields); steps repeat sizes. Both
        paths assemble them as they are (the C assembly adds them after its import)."""
        cols = self.null_columns.get(n)
        if cols is None:
            if len(self.null_columns) > 64:
                self.null_columns.clear()
            cols = self.null_columns[n] = {
                name: pa.nulls(n, t) for name, t in zip(self.schema.names, self.schema.types)
            }
        return cols


# req_id column reuse (_Run.req_id_column): the copy of req_ids is taken every step until
# this many steps in a row missed, then every _SNAPSHOT_EVERY-th step only.
_SNAPSHOT_AFTER = 8
_SNAPSHOT_EVERY = 8

_RUNS: list[_Run] = []  # most recent first


def _run_of(schema: pa.Schema) -> _Run:
    run = _known_run(schema)
    if run is None:
        run = _Run(schema, column_types(schema))
        _RUNS.insert(0, run)
        del _RUNS[8:]
    return run


def _known_run(schema: pa.Schema) -> _Run | None:
    """The run of a schema already in use (the very object, or an equal one), else None."""
    for run in _RUNS:
        if run.schema is schema:
            return run
    for run in _RUNS:
        if run.schema.equals(schema, check_metadata=True):
            return run
    return None


_DECODE: list[tuple[pa.Schema, ColumnTypes]] = []  # most recent first
# Run schemas as batches read from IPC carry them (no step key, so the same every batch),
# metadata and all: most recent first.
_DECODE_RUN: list[tuple[pa.Schema, ColumnTypes]] = []


def _decode_types(schema: pa.Schema, schema_meta: dict[bytes, bytes]) -> ColumnTypes:
    """The column types of a batch's schema, cached across the batches of a run.

    The key drops the schema-level metadata (its step key changes every batch) but keeps the
    field metadata (``arrow_outputs.dtype`` tells bfloat16 from uint16). A schema without a
    step key (``schema_meta``: its metadata) is first looked up whole, which is cheaper
    than dropping its metadata (equal whole schemas have equal keys)."""
    run = KEY_STEP not in schema_meta
    if run:
        for cached, known in _DECODE_RUN:
            if cached.equals(schema, check_metadata=True):
                return known
    key = schema.remove_metadata()
    types = next((t for cached, t in _DECODE if cached.equals(key, check_metadata=True)), None)
    if types is None:
        types = column_types(schema)
        _DECODE.insert(0, (key, types))
        del _DECODE[8:]
    if run:
        _DECODE_RUN.insert(0, (schema, types))
        del _DECODE_RUN[8:]
    return types


_INFERRED: dict[tuple[ColumnTypes, str], pa.Schema] = {}
# The same schemas by _quick_key: inferring costs more than a tenth of a step's encoding (at
# any size), and every decode step of a run infers the same schema.
_QUICK: dict[tuple[Any, ...], pa.Schema] = {}


def _inferred_schema(output: Any, metadata: dict[str, Any] | None) -> pa.Schema:
    quick = _quick_key(output) if metadata is None else None
    if quick is not None:
        schema = _QUICK.get(quick)
        if schema is not None:
            return schema
    types = infer_column_types(output)
    if metadata is not None and not isinstance(metadata, dict):
        raise FieldTypeError("metadata", "a dict of JSON-serialisable values", describe(metadata))
    key = (types, json.dumps(metadata, sort_keys=True, default=repr))
    schema = _INFERRED.get(key)
    if schema is None:
        if len(_INFERRED) > 64:
            _INFERRED.clear()
        schema = _INFERRED[key] = output_schema(types, metadata=metadata)
    if quick is not None:
        if len(_QUICK) > 64:
            _QUICK.clear()
        _QUICK[quick] = schema
    return schema


def _quick_key(output: Any) -> tuple[Any, ...] | None:
    """What alone decides the inferred schema of a step without prompt logprobs, pooler or
    aux output whose logprobs (if any) are numpy arrays, as in every decode step: the
    logprob dtypes (``infer_column_types`` reads nothing else then). None for other steps,
    which are inferred in full."""
    for name in (
        "prompt_logprobs_dict",
        "prompt_token_id_logprobs_dict",
        "aux_output_connector_output",
    ):
        x = getattr(output, name, None)
        if x is not None and not (type(x) is dict and not x):
            return None
    if getattr(output, "pooler_output", None) is not None:
        return None
    return _logprobs_key(getattr(output, "logprobs", None))


def _logprobs_key(lp: Any) -> tuple[Any, ...] | None:
    """The logprobs' part of :func:`_quick_key`: () without logprobs, their id and rank
    dtypes for numpy arrays, None for anything else."""
    if lp is None:
        return ()
    ids = getattr(lp, "logprob_token_ids", None)
    ranks = logprob_ranks(lp)
    if type(ids) is not np.ndarray or type(ranks) is not np.ndarray:
        return None
    return (ids.dtype, ranks.dtype)


@lru_cache(maxsize=64)
def _req_index(n: int) -> pa.Array:
    return pa.array(np.arange(n, dtype=np.int32))


@lru_cache(maxsize=64)
def _req_index_node(n: int) -> Any:
    values = np.arange(n, dtype=np.int32)
    values.flags.writeable = False  # shared by every batch of n rows
    return (n, 0, (None, values.data), ())  # its memoryview: cheaper to assemble


@lru_cache(maxsize=64)
def _range_list(n: int) -> list[int]:
    return list(range(n))


@lru_cache(maxsize=64)
def _no_valid_bits(n: int) -> pa.Buffer:
    return pa.py_buffer(np.zeros((n + 7) // 8, dtype=np.uint8))


# ----------------------------------------------------------------------------- encode


class _Enc(NamedTuple):
    """What every column encoder gets for one step."""

    output: Any
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    n: int
    types: ColumnTypes
    nulls: dict[str, pa.Array]  # absent columns (_Run.nulls)
    arrow_types: dict[str, pa.DataType]


def _get(obj: Any, name: str, cls: type) -> Any:
    """``obj.name``, or the field's default when an older vLLM's object lacks it."""
    default = _FIELDS[cls][name]
    if default is dataclasses.MISSING:
        if not hasattr(obj, name):
            raise FieldTypeError(
                cls.__name__, f"an object with {', '.join(_FIELDS[cls])}", describe(obj)
            )
        return getattr(obj, name)
    return getattr(obj, name, default)


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(obj: Any) -> Iterable[str]:
    """The public fields an object declares (dataclass, NamedTuple) or holds (``__dict__``)."""
    t = type(obj)
    names = _FIELD_NAMES.get(t)
    if names is not None:
        return names
    if dataclasses.is_dataclass(obj):
        names = tuple(f.name for f in dataclasses.fields(obj))
    elif isinstance(obj, tuple) and isinstance(getattr(t, "_fields", None), tuple):
        names = t._fields
    else:
        return [k for k in getattr(obj, "__dict__", ()) if not k.startswith("_")]
    _FIELD_NAMES[t] = names
    return names


def _refuse_unknown_fields(obj: Any, cls: type, path: str) -> None:
    """A field the format does not know is refused by name, never dropped (None is no data)."""
    if type(obj) is cls:
        return
    known = _FIELDS[cls]
    for name in _field_names(obj):
        if name not in known and getattr(obj, name, None) is not None:
            raise UnsupportedValueError(
                f"{path}.{name}",
                f"only the fields of vLLM 0.33's {cls.__name__} (the format has no place for "
                "others; see docs/data-model.md)",
                describe(getattr(obj, name)),
            )


def _check_req_ids(req_ids: Any, index: Any) -> int:
    if type(req_ids) is not list:
        raise FieldTypeError("req_ids", "a list of str", describe(req_ids))
    if not isinstance(index, dict):
        raise FieldTypeError("req_id_to_index", "a dict of str to int", describe(index))
    n = len(req_ids)
    # Fast path: vLLM builds the dict in req_ids order. Equal key lists also prove that
    # req_ids has no duplicates (dict keys are unique).
    if (
        _accel.index_in_order(req_ids, index)
        if _accel.accelerated()
        else list(index) == req_ids and list(index.values()) == _range_list(n)
    ):
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


def _req_id_array(req_ids: list[Any]) -> Any:
    # The C walk, when built, as a node for the C assembly; the pure path is pyarrow's own
    # (faster than _pyspeedups, which is the C code's specification, not a production path).
    fast = _accel.utf8_array(req_ids) if _accel.accelerated() else None
    if fast is not None:
        offsets, data = fast
        return (len(req_ids), 0, (None, offsets, data), ())
    # Exactly str: pyarrow would turn bytes into a string silently.
    if list(map(type, req_ids)).count(str) != len(req_ids):
        i = next(i for i, r in enumerate(req_ids) if type(r) is not str)
        raise FieldTypeError(f"req_ids[{i}]", "a str", describe(req_ids[i]))
    try:
        return pa.array(req_ids, pa.string())
    except UnicodeEncodeError as e:
        i = next(i for i, r in enumerate(req_ids) if not _utf8_ok(r))
        raise UnsupportedValueError(
            f"req_ids[{i}]", "a str with a UTF-8 form", f"{describe(req_ids[i])} ({e.reason})"
        ) from None


def _utf8_ok(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _step_column(n: int, step: int | None) -> tuple[Any, _array.array[int]]:
    """The step column's node over a fresh buffer: that buffer is the batch's identity
    (_stepmeta)."""
    # An int64 array.array: made by one repeat, weakly referable, its address at hand (a
    # numpy array's empty + fill and address cost about 4 us more a step inside a loop).
    values = _array.array("q", (0 if step is None else step,))  # n = 0 still has a buffer
    if n > 1:
        values *= n  # in place: no second array (max() and a new array cost 0.3 us a step)
    if step is None:
        return (n, n, (_no_valid_bits(n), values), ()), values
    return (n, 0, (None, values), ()), values


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


def _enc_sampled(c: _Enc) -> tuple[pa.Array, Any]:
    st = _get(c.output, "sampled_token_ids", ModelRunnerOutput)
    n, id_type = c.n, c.types.sampled_token_ids
    if type(st) is not list:
        raise FieldTypeError("sampled_token_ids", "a list of lists of int", describe(st))
    if not st:
        # A pooling step: no sampled ids at all, while requests exist.
        return c.nulls["sampled_token_ids"], "none"
    node = _sampled_node(st, n, id_type) if _accel.accelerated() else None
    if node is not None:
        return node, "lists"
    t = c.arrow_types["sampled_token_ids"]
    # The slow path: the same batch, or the precise error for what the fast path refused.
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
    values = pa.Array.from_buffers(t.value_type, len(flat), [None, pa.py_buffer(flat)])
    arr = pa.Array.from_buffers(t, n, [None, pa.py_buffer(offsets)], children=[values])
    return arr, "lists"


def _sampled_node(st: list[Any], n: int, id_type: str) -> Any:
    """The sampled-ids column as a node for the C assembly (``flatten_int_lists`` at the run
    type's item size), or None when the walk refuses the lists (the caller's checks then
    name what is wrong)."""
    itemsize = 4 if id_type == "int32" else 8
    fast = _accel.flatten_int_lists(st, n, itemsize)
    if fast is None:
        return None
    values_bytes, offsets_bytes = fast
    values_node = (len(values_bytes) // itemsize, 0, (None, values_bytes), ())
    return (n, 0, (None, offsets_bytes), (values_node,))


def _enc_logprobs(c: _Enc) -> tuple[pa.Array, Any]:
    lp = _get(c.output, "logprobs", ModelRunnerOutput)
    if lp is None:
        return c.nulls["logprobs"], None
    return encode_logprobs(
        lp,
        "logprobs",
        id_type=c.types.logprob_token_ids,
        rank_type=c.types.logprob_ranks,
        num_rows=c.n,
        as_node=_accel.accelerated(),
    )


def _enc_prompt_logprobs(c: _Enc) -> tuple[pa.Array, Any]:
    prompt = _get(c.output, "prompt_logprobs_dict", ModelRunnerOutput)
    if not isinstance(prompt, dict):
        raise FieldTypeError("prompt_logprobs_dict", "a dict", describe(prompt))
    if not prompt:
        return c.nulls["prompt_logprobs"], None
    rows, none_rows = _keyed_rows(prompt, c.req_id_to_index, c.n, "prompt_logprobs_dict")
    arr, layout = encode_prompt_logprobs(
        rows,
        "prompt_logprobs_dict",
        keys=c.req_ids,
        id_type=c.types.prompt_logprob_token_ids,
        rank_type=c.types.prompt_logprob_ranks,
    )
    return arr, {"none_rows": sorted(none_rows), **layout}


def _enc_prompt_token_id_logprobs(c: _Enc) -> tuple[pa.Array, Any]:
    tid = _get(c.output, "prompt_token_id_logprobs_dict", ModelRunnerOutput)
    if not isinstance(tid, dict):
        raise FieldTypeError("prompt_token_id_logprobs_dict", "a dict", describe(tid))
    if not tid:
        return c.nulls["prompt_token_id_logprobs"], None
    rows, none_rows = _keyed_rows(tid, c.req_id_to_index, c.n, "prompt_token_id_logprobs_dict")
    if none_rows:
        raise FieldTypeError(
            f"prompt_token_id_logprobs_dict[{c.req_ids[none_rows[0]]!r}]", "a tensor", "None"
        )
    return encode_tensor_rows(
        rows, c.types.prompt_token_id_logprobs, "prompt_token_id_logprobs_dict", c.req_ids
    )


def _enc_pooler(c: _Enc) -> tuple[pa.Array, Any]:
    pooler = _get(c.output, "pooler_output", ModelRunnerOutput)
    if pooler is None:
        return c.nulls["pooler_output"], None
    if type(pooler) is not list:
        raise FieldTypeError("pooler_output", "a list of tensors (or None)", describe(pooler))
    if len(pooler) != c.n:
        raise ShapeError("pooler_output", f"{c.n} rows (one per request)", str(len(pooler)))
    return encode_tensor_rows(pooler, c.types.pooler_output, "pooler_output")


def _enc_nans(c: _Enc) -> tuple[pa.Array, Any]:
    nans = _get(c.output, "num_nans_in_logits", ModelRunnerOutput)
    if nans is None:
        return c.nulls["num_nans_in_logits"], None
    rows, none_rows = _keyed_rows(nans, c.req_id_to_index, c.n, "num_nans_in_logits")
    bad = [i for i, v in enumerate(rows) if v is not None and type(v) is not int]
    if none_rows or bad:
        i = (none_rows + bad)[0]
        raise FieldTypeError(f"num_nans_in_logits[{c.req_ids[i]!r}]", "an int", describe(rows[i]))
    try:
        arr = pa.array(rows, pa.int32())
    except (pa.ArrowInvalid, OverflowError) as e:
        raise UnsupportedValueError(
            "num_nans_in_logits", "counts within int32", str(max(v for v in rows if v is not None))
        ) from e
    return arr, "dict"


def _enc_masks(c: _Enc) -> tuple[pa.Array, Any]:
    masks = _get(c.output, "sampling_masks", ModelRunnerOutput)
    if masks is None:
        return c.nulls["sampling_mask"], None
    return encode_sampling_masks(
        masks, "sampling_masks", num_rows=c.n, as_node=_accel.accelerated()
    )


def _enc_aux(c: _Enc) -> tuple[pa.Array, Any]:
    aux = _get(c.output, "aux_output_connector_output", ModelRunnerOutput)
    if aux is None:
        return c.nulls["aux_output"], None
    items = getattr(aux, "items", None)
    if items is None:
        raise FieldTypeError(
            "aux_output_connector_output",
            "a mapping of request id to AuxRequestOutput",
            describe(aux),
        )
    n, req_ids = c.n, c.req_ids
    rows, none_rows = _keyed_rows(
        dict(items()), c.req_id_to_index, n, "aux_output_connector_output"
    )
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
        if not -(2**63) <= r.token_start < 2**63:
            raise UnsupportedValueError(
                f"{f}.token_start", "an int within int64", str(r.token_start)
            )
        if r.rows is None:
            raise FieldTypeError(f"{f}.rows", "a 3-D uint8/uint16 array", "None")
        starts[i] = r.token_start
        tensors.append(r.rows)
    rows_arr, kind = encode_tensor_rows(
        tensors, c.types.aux_rows, "aux_output_connector_output", req_ids
    )
    valid = np.fromiter((t is not None for t in tensors), dtype=bool, count=n)
    validity = None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))
    aux_type = c.arrow_types["aux_output"]
    arr = pa.Array.from_buffers(aux_type, n, [validity], children=[pa.array(starts), rows_arr])
    return arr, {"kind": kind}


def _step_object(obj: Any, key: str, opaque: str, dropped: Dropped) -> dict[str, Any] | None:
    if obj is None:
        return None
    cls = _STEP_CLASSES[key]
    _refuse_unknown_fields(obj, cls, key)
    return {
        name: to_jsonable(_get(obj, name, cls), f"{key}.{name}", opaque, dropped)
        for name in _FIELDS[cls]
    }


# ----------------------------------------------------------------------------- decode


class _Dec(NamedTuple):
    """What every column decoder gets for one batch."""

    req_ids: list[str]
    types: ColumnTypes
    rows: np.ndarray | None  # the step's row of each batch row, for a slice; None: all rows
    step_rows: int  # rows of the whole step
    validated: bool


def _local(c: _Dec, step_rows: Iterable[int], path: str) -> dict[int, int]:
    """Step row numbers (as the step JSON names them) -> this batch's rows that hold them."""
    for r in step_rows:
        if r >= c.step_rows:
            raise StepMetadataError(path, f"row numbers below {c.step_rows}", str(r))
    if c.rows is None:
        return {r: r for r in step_rows}
    where = {int(r): i for i, r in enumerate(c.rows)}
    return {r: where[r] for r in step_rows if r in where}


def _dec_sampled(c: _Dec, col: pa.Array, mode: str) -> Any:
    if mode == "none":
        if col.null_count != len(col):
            raise _claim("sampled_token_ids", "'none' (a pooling step)", col)
        return []
    if col.null_count:
        raise SchemaMismatchError(
            "sampled_token_ids",
            "no nulls, or nulls in every row (a pooling step)",
            f"{col.null_count} nulls of {len(col)}",
        )
    offs = list_offsets(col, np.int32)  # monotonic and in bounds: validated (or trusted)
    lo, hi = int(offs[0]), int(offs[-1])
    child_col = col.values  # fetched once: pyarrow's accessors cost more than the checks
    if child_col.null_count or not 0 <= lo <= hi <= len(child_col):
        raise SchemaMismatchError(
            "sampled_token_ids", "token ids within the values, none null", f"ids {lo}..{hi}"
        )
    child = _flat_values(child_col)  # the run schema's int32/int64 (checked), zero-copy
    values = child[lo:hi]
    n = len(col)
    if n and is_arange(offs, int(offs[1]) - lo):
        # Uniform lengths (every decode step without speculation): one C-level tolist.
        return values.reshape(n, -1).tolist()
    if _accel.accelerated():
        fast = _accel.split_int_lists(child, offs, child.dtype.itemsize, n)
        if fast is not None:
            return fast
    flat = values.tolist()
    bounds = (offs - lo).tolist()
    return [flat[a:b] for a, b in itertools.pairwise(bounds)]


def _dec_logprobs(c: _Dec, col: pa.Array, layout: dict[str, Any]) -> Any:
    return decode_logprobs(col, layout, "logprobs", validated=c.validated)


def _dec_prompt_logprobs(c: _Dec, col: pa.Array, layout: dict[str, Any]) -> Any:
    path = "arrow_outputs.step.prompt_logprobs"
    if len(set(layout["none_rows"])) != len(layout["none_rows"]):
        raise StepMetadataError(f"{path}.none_rows", "distinct rows", str(layout["none_rows"]))
    none = set(_local(c, layout["none_rows"], f"{path}.none_rows").values())
    step_widths = {int(k): w for k, w in layout.get("empty_widths", {}).items()}
    widths = {i: step_widths[r] for r, i in _local(c, step_widths, f"{path}.empty_widths").items()}
    entries = decode_prompt_logprobs(col, widths, "prompt_logprobs")
    for i in none:
        if entries[i] is not None:
            raise StepMetadataError(
                f"{path}.none_rows",
                "rows that are null in the prompt_logprobs column",
                f"row {i}, which holds prompt logprobs",
            )
    return {c.req_ids[i]: e for i, e in enumerate(entries) if e is not None or i in none}


def _dec_prompt_token_id_logprobs(c: _Dec, col: pa.Array, kind: str) -> Any:
    rows = decode_tensor_rows(
        col, c.types.prompt_token_id_logprobs, kind, "prompt_token_id_logprobs"
    )
    return {c.req_ids[i]: r for i, r in enumerate(rows) if r is not None}


def _dec_pooler(c: _Dec, col: pa.Array, kind: str) -> Any:
    return decode_tensor_rows(col, c.types.pooler_output, kind, "pooler_output")


def _dec_nans(c: _Dec, col: pa.Array, layout: str) -> Any:
    values = col.to_pylist()
    return {c.req_ids[i]: v for i, v in enumerate(values) if v is not None}


def _dec_masks(c: _Dec, col: pa.Array, layout: dict[str, Any]) -> Any:
    return decode_sampling_masks(col, layout, "sampling_mask")


def _dec_aux(c: _Dec, col: pa.Array, layout: dict[str, Any]) -> Any:
    starts_col, rows_col = col.field(0), col.field(1)
    valid = col.is_valid().to_numpy(zero_copy_only=False)
    # A present row needs both parts (nulls inside an absent row are fine).
    for name, child in (("token_start", starts_col), ("rows", rows_col)):
        if child.null_count and (valid & ~child.is_valid().to_numpy(zero_copy_only=False)).any():
            raise SchemaMismatchError(
                f"aux_output.{name}", "a value in every present aux row", "a null"
            )
    # Nulls under absent rows are fine; fill them so the present starts stay ints.
    starts = starts_col.fill_null(0).to_numpy(zero_copy_only=False).tolist()
    rows = decode_tensor_rows(rows_col, c.types.aux_rows, layout["kind"], "aux_output.rows")
    return {
        c.req_ids[i]: AuxRequestOutput(starts[i], rows[i])
        for i in range(len(c.req_ids))
        if valid[i]
    }


class _Codec(NamedTuple):
    """One column: its step JSON key, output field, encoder and decoder.

    ``encode(ctx) -> (array, layout)``; layout None means absent (an all-null column).
    ``decode(ctx, column, layout) -> value``; absent columns decode to ``absent``.
    """

    meta_key: str
    output_field: str
    encode: Callable[[_Enc], tuple[pa.Array, Any]]
    decode: Callable[[_Dec, pa.Array, Any], Any]
    absent: Callable[[], Any]


_CODECS: dict[str, _Codec] = {
    "sampled_token_ids": _Codec(
        "sampled_token_ids", "sampled_token_ids", _enc_sampled, _dec_sampled, list
    ),
    "logprobs": _Codec("logprobs", "logprobs", _enc_logprobs, _dec_logprobs, lambda: None),
    "prompt_logprobs": _Codec(
        "prompt_logprobs", "prompt_logprobs_dict", _enc_prompt_logprobs, _dec_prompt_logprobs, dict
    ),
    "prompt_token_id_logprobs": _Codec(
        "prompt_token_id_logprobs",
        "prompt_token_id_logprobs_dict",
        _enc_prompt_token_id_logprobs,
        _dec_prompt_token_id_logprobs,
        dict,
    ),
    "pooler_output": _Codec(
        "pooler_output", "pooler_output", _enc_pooler, _dec_pooler, lambda: None
    ),
    "num_nans_in_logits": _Codec(
        "num_nans_in_logits", "num_nans_in_logits", _enc_nans, _dec_nans, lambda: None
    ),
    "sampling_mask": _Codec(
        "sampling_mask", "sampling_masks", _enc_masks, _dec_masks, lambda: None
    ),
    "aux_output": _Codec(
        "aux_output", "aux_output_connector_output", _enc_aux, _dec_aux, lambda: None
    ),
}
# The columns a staged decode step (encode_staged_step) may have absent: (column, output
# field, the type of the field's empty value: None for None).
_STAGED_ABSENT = tuple(
    (
        name,
        codec.output_field,
        None if codec.absent() is None else type(codec.absent()),
        _FIELDS[ModelRunnerOutput][codec.output_field],  # what an older vLLM's object lacks
    )
    for name, codec in _CODECS.items()
    if name not in ("sampled_token_ids", "logprobs")
)
assert dataclasses.MISSING not in (default for *_, default in _STAGED_ABSENT)
# _everyday builds the columns in this order: sampled ids, logprobs, then _STAGED_ABSENT's.
assert tuple(_CODECS)[:2] == ("sampled_token_ids", "logprobs")
# encode_step's table: (column, codec, output field, the type of the field's empty value as
# in _STAGED_ABSENT, or _NEVER_ABSENT for the fields whose encoder always runs, and the
# field's default).
_NEVER_ABSENT: Any = object()
_ABSENT_OF = {name: (kind, default) for name, _, kind, default in _STAGED_ABSENT}
_ENCODERS = tuple(
    (name, codec, codec.output_field, *_ABSENT_OF.get(name, (_NEVER_ABSENT, None)))
    for name, codec in _CODECS.items()
)
# step, req_id and req_index identify the rows; every other column has a codec.
assert COLUMNS[3:] == tuple(_CODECS), "the codec table and the schema disagree"
# Column lookups by name cost 3x lookups by position; positions come from the schema's table.
_AT = {name: i for i, name in enumerate(COLUMNS)}
_DECODERS = tuple((_AT[name], codec) for name, codec in _CODECS.items())


def _claim(key: str, claim: str, col: pa.Array) -> StepMetadataError:
    return StepMetadataError(
        f"arrow_outputs.step.{key}",
        f"a column that matches the claim {claim}",
        f"{len(col) - col.null_count} non-null rows of {len(col)}",
    )


# ----------------------------------------------------------------------------- public


def to_record_batch(
    output: Any,
    *,
    step: int | None = None,
    metadata: dict[str, Any] | None = None,
    schema: pa.Schema | None = None,
    opaque: str = "drop",
) -> pa.RecordBatch:
    """A ``ModelRunnerOutput`` (ours or vLLM's) as one record batch, one row per request.

    The batch's schema metadata carries its step metadata (``arrow_outputs.step``). To write
    batches to an IPC stream or file, open the writer with :func:`run_schema` and pass
    :func:`step_custom_metadata` with each batch.

    Parameters
    ----------
    output
        The step's output; any object with ``ModelRunnerOutput``'s attribute names. Objects
        of older vLLM versions that lack a newer field get that field's default.
    step
        The engine step number (an int or numpy integer), stored in the ``step`` column and
        the step metadata.
    metadata
        User run metadata (JSON-serialisable dict); only without ``schema``.
    schema
        The run's schema (:func:`run_schema` of the first batch, or :func:`output_schema`).
        Without it the schema is inferred from this step. With it, data of other dtypes is
        refused.
    opaque
        ``"drop"`` (default): connector objects that are not plain data (nor dataclasses,
        NamedTuples or msgspec Structs of it) are dropped with an
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
    return encode_step(output, step=step, metadata=metadata, schema=schema, opaque=opaque)


def encode_step(
    output: Any,
    *,
    step: int | None = None,
    metadata: dict[str, Any] | None = None,
    schema: pa.Schema | None = None,
    opaque: str = "drop",
    prebuilt: dict[str, tuple[pa.Array, Any]] | None = None,
) -> pa.RecordBatch:
    """:func:`to_record_batch`, with some columns already built (``prebuilt``: column name to
    (array, step JSON layout)), as a producer that holds the data in another form builds them
    (``AsyncArrowOutput`` from staged device tensors). The arrays must be what the column's
    encoder would make of ``output``'s field, and a layout object is never changed once
    handed over (the step JSON writer reuses the JSON of the last step's layout objects)."""
    if opaque not in ("drop", "error"):
        raise FieldTypeError("opaque", "'drop' or 'error'", repr(opaque))
    for name in ("req_ids", "req_id_to_index"):
        if not hasattr(output, name):
            raise FieldTypeError("output", "a ModelRunnerOutput", describe(output))
    step = _step_number(step)
    _refuse_unknown_fields(output, ModelRunnerOutput, "output")
    req_ids = output.req_ids
    index = output.req_id_to_index
    n = _check_req_ids(req_ids, index)
    if schema is None:
        schema = _inferred_schema(output, metadata)
    elif not isinstance(schema, pa.Schema):
        raise FieldTypeError("schema", "a pyarrow.Schema (run_schema(batch))", describe(schema))
    elif metadata is not None:
        raise ConsistencyError(
            "metadata", "None when a schema is given (run metadata lives in the schema)", "a dict"
        )
    run = _run_of(schema)
    nulls = run.nulls(n)
    everyday = (
        None if prebuilt or not n or not _accel.accelerated() else _everyday(output, run, n, nulls)
    )
    if everyday is not None:
        arrays, identity = _row_columns(run, req_ids, n, step)
        arrays += everyday[0]
        return _finish(output, run, schema, step, n, identity, arrays, everyday[1], opaque)
    # tuple.__new__: the NamedTuple's own __new__ costs 0.2 us more a step.
    ctx = tuple.__new__(_Enc, (output, req_ids, index, n, run.types, nulls, run.arrow_types))
    arrays, identity = _row_columns(run, req_ids, n, step)
    layouts = []
    for name, codec, field, kind, default in _ENCODERS:
        if prebuilt and name in prebuilt:
            arr, layout = prebuilt[name]
        elif kind is not _NEVER_ABSENT and (
            getattr(output, field, default) is None
            if kind is None
            else type(value := getattr(output, field, default)) is kind and not value
        ):
            # An absent field (None, or an empty dict): what its encoder makes of it, without
            # the call; most fields are absent from most steps.
            arr, layout = nulls[name], None
        else:
            arr, layout = codec.encode(ctx)
        arrays.append(arr)
        layouts.append(layout)
    return _finish(output, run, schema, step, n, identity, arrays, layouts, opaque)


def _everyday(
    output: Any, run: _Run, n: int, nulls: dict[str, pa.Array]
) -> tuple[list[Any], list[Any]] | None:
    """The codec columns and layouts of the step vLLM makes every step (sampled ids; host
    ``LogprobsLists`` or None; host ``SamplingMaskLists`` or None; every other field
    absent), on the C path: what the column loop of :func:`encode_step` makes of it, without
    the loop's generic calls. None for any other step, before anything is refused: the loop
    then encodes it or raises its precise error."""
    st = getattr(output, "sampled_token_ids", None)
    if type(st) is not list or not st:
        return None
    types = run.types
    sampled = _sampled_node(st, n, types.sampled_token_ids)
    if sampled is None:
        return None
    lp = getattr(output, "logprobs", None)
    if lp is None:
        lp_col: Any = (nulls["logprobs"], None)
    else:
        lp_col = _host_lists_node(lp, types.logprob_token_ids, types.logprob_ranks, n)
        if lp_col is None:
            return None
    columns = [sampled, lp_col[0]]
    layouts = ["lists", lp_col[1]]
    for name, field, kind, default in _STAGED_ABSENT:
        value = getattr(output, field, default)  # _get, for fields that have a default
        if value is None if kind is None else (type(value) is kind and not value):
            columns.append(nulls[name])
            layouts.append(None)
        elif name == "sampling_mask":
            got = _host_masks_node(value, n)
            if got is None:
                return None
            columns.append(got[0])
            layouts.append(got[1])
        else:
            return None
    return columns, layouts


def _row_columns(run: _Run, req_ids: list[Any], n: int, step: int | None) -> tuple[list[Any], Any]:
    """The columns that identify the rows (step, req_id, req_index), and the step column's
    buffer (the batch's identity, :mod:`._stepmeta`)."""
    step_col, identity = _step_column(n, step)
    req_index = _req_index_node(n) if _accel.accelerated() else _req_index(n)
    return [step_col, run.req_id_column(req_ids), req_index], identity


def _finish(
    output: Any,
    run: _Run,
    schema: pa.Schema,
    step: int | None,
    n: int,
    identity: Any,
    arrays: list[Any],
    layouts: list[Any],
    opaque: str,
) -> pa.RecordBatch:
    """The batch of a step's columns (in schema order) and codec layouts: the step-level
    objects and the step JSON go into its schema metadata, as one C assembly."""
    dropped: Dropped = []
    objects = []
    for key in _STEP_CLASSES:
        obj = getattr(output, key, None)  # None is these fields' default (an older vLLM's)
        objects.append(None if obj is None else _step_object(obj, key, opaque, dropped))
    raw = _step_json(step, n, layouts, objects, dropped)
    run_meta = run.metadata.copy()
    run_meta[KEY_STEP] = raw
    batch = _accel.record_batch(arrays, schema, n, run_meta)
    _stepmeta.register(identity, raw, batch, run.types)
    return batch


def encode_staged_step(
    output: Any,
    logprobs: Any,
    prebuilt: dict[str, tuple[Any, Any]],
    *,
    step: Any = None,
    schema: pa.Schema | None = None,
) -> pa.RecordBatch | None:
    """:func:`encode_step` for the step a decode run makes every step from staged buffers
    (``AsyncArrowOutput``): every column prebuilt as a node for the C assembly but the
    logprobs (``logprobs``: the staged ``LogprobsLists``, or None), every other field of
    ``output`` absent (empty prompt dicts, no pooler or aux output), request ids already in
    ``req_id_to_index`` order, and a run schema already in use (or none, for a decode
    step's inferred schema that is cached already).

    The same batch as ``encode_step``, with the same checks in the same order, minus the
    generic work that such a step does not need: no view of the output, no encoder called
    for an absent column. None for any other step, and before anything is refused: the
    caller then runs ``encode_step``, which encodes it or raises its precise error.
    """
    if not _accel.accelerated() or "sampled_token_ids" not in prebuilt:
        return None
    req_ids = getattr(output, "req_ids", None)
    index = getattr(output, "req_id_to_index", None)
    if type(req_ids) is not list or type(index) is not dict or not req_ids:
        return None
    if not (step is None or (type(step) is int and -(2**63) <= step < 2**63)):
        return None
    for name, field, kind, default in _STAGED_ABSENT:
        if name in prebuilt:
            continue
        value = getattr(output, field, default)  # _get, for fields that have a default
        if not (value is None if kind is None else (type(value) is kind and not value)):
            return None
    if not _accel.index_in_order(req_ids, index):
        return None
    if logprobs is None:
        logprobs = _get(output, "logprobs", ModelRunnerOutput)
    if schema is None:
        key = _logprobs_key(logprobs)  # the other fields of _quick_key are absent (above)
        schema = None if key is None else _QUICK.get(key)
        if schema is None:
            return None  # encode_step infers it, and caches it for the next steps
    elif type(schema) is not pa.Schema:
        return None
    run = _known_run(schema)
    if run is None:
        return None
    n = len(req_ids)
    arrays, identity = _row_columns(run, req_ids, n, step)
    nulls = run.nulls(n)
    layouts = []
    for name in _CODECS:  # the columns in the table's (and the schema's) order
        if name in prebuilt:
            column, layout = prebuilt[name]
        elif name == "logprobs" and logprobs is not None:
            column, layout = encode_logprobs(
                logprobs,
                "logprobs",
                id_type=run.types.logprob_token_ids,
                rank_type=run.types.logprob_ranks,
                num_rows=n,
                as_node=True,
            )
        else:
            column, layout = nulls[name], None
        arrays.append(column)
        layouts.append(layout)
    return _finish(output, run, schema, step, n, identity, arrays, layouts, "drop")


# The last step JSON's tail (everything after "step" and "rows") and the layout objects it
# was written from: one tuple, replaced whole (threads at worst miss it).
_TAIL: tuple[list[Any], bytes] | None = None


def _step_json(
    step: int | None, n: int, layouts: list[Any], objects: list[Any], dropped: Dropped
) -> bytes:
    """The step JSON: ``{"step", "rows"}`` (``rows`` lets a reader notice step metadata
    that belongs to another batch), each codec's layout, the step-level objects, the dropped
    values; as ``_json_encode`` writes it.

    A step whose layouts are the very objects of the last step's (shared layouts, constant
    strings) and that has no step-level objects reuses the last tail's bytes: the same
    objects write the same JSON. Anything else is written in full."""
    global _TAIL
    if dropped or objects.count(None) != len(objects):
        meta = {"step": step, "rows": n, **dict(zip(_META_KEYS, layouts))}
        meta.update(zip(_STEP_CLASSES, objects))
        meta["dropped"] = dropped
        return _json_encode(meta).encode()
    last = _TAIL
    if last is not None and _accel.same_items(layouts, last[0]):
        tail = last[1]
    else:
        tail_meta = dict(zip(_META_KEYS, layouts))
        tail_meta.update(dict.fromkeys(_STEP_CLASSES))
        tail_meta["dropped"] = []
        tail = _json_encode(tail_meta).encode()[1:]  # after its "{"
        _TAIL = (list(layouts), tail)  # a copy: the caller's list is the caller's
    if step is None:
        return b'{"step":null,"rows":%d,%b' % (n, tail)
    return b'{"step":%d,"rows":%d,%b' % (step, n, tail)


def _step_number(step: Any) -> int | None:
    if type(step) is int and -(2**63) <= step < 2**63:  # the usual case, first
        return step
    if step is None:
        return None
    if isinstance(step, np.integer):
        step = int(step)
    if type(step) is not int:
        raise FieldTypeError("step", "an int (or numpy integer) or None", describe(step))
    if not -(2**63) <= step < 2**63:
        raise UnsupportedValueError("step", "a step number within int64", str(step))
    return step


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
    if not isinstance(schema, pa.Schema):
        raise FieldTypeError(
            "batch_or_schema", "a pyarrow RecordBatch, Table or Schema", describe(batch_or_schema)
        )
    meta = dict(schema.metadata or {})
    meta.pop(KEY_STEP, None)
    return schema.with_metadata(meta)


def step_custom_metadata(batch: pa.RecordBatch) -> dict[bytes, bytes]:
    """The IPC custom metadata that carries a batch's step metadata through a stream or file.

    Only for a batch made by :func:`to_record_batch` (or a slice of it): a batch that merely
    inherited a schema with a step key (from a table, stream or file) is refused, so another
    batch's step metadata is never written out as this one's.

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
    if not isinstance(batch, pa.RecordBatch):
        raise FieldTypeError("batch", "a pyarrow.RecordBatch", describe(batch))
    raw = _stepmeta.made(batch)
    if raw is not None:  # the whole batch to_record_batch made: nothing to prove
        return {KEY_STEP: raw}
    raw = (batch.schema.metadata or {}).get(KEY_STEP)
    if raw is None:
        raise StepMetadataError(
            "batch.schema.metadata",
            "an arrow_outputs.step key (a batch of to_record_batch)",
            "no such key",
        )
    if not _owned(batch, raw):
        raise _inherited_error()
    if batch.num_rows != _stepmeta.parse(raw, _SCHEMA_PATH, _SPEC)["rows"]:
        raise StepMetadataError(
            "batch",
            "a whole step's batch (IPC custom metadata describes whole batches)",
            f"a slice of {batch.num_rows} rows; write the step's whole batch",
        )
    return {KEY_STEP: raw}


_SCHEMA_PATH = "schema.metadata[arrow_outputs.step]"
_CUSTOM_PATH = "custom_metadata[arrow_outputs.step]"
_HOW = (
    "read IPC batches together with their custom metadata (pyarrow's "
    "read_next_batch_with_custom_metadata / get_batch_with_custom_metadata, then "
    "from_record_batch(batch, custom_metadata=...)); or pass "
    "missing_step_metadata='defaults' to decode with the documented defaults"
)


def _owned(batch: pa.RecordBatch, raw: bytes) -> bool:
    known = _stepmeta.made(batch)
    if known is not None:
        return known == raw
    return batch.num_columns > 0 and _stepmeta.owns(batch.column(_AT["step"]), raw)


def _inherited_error() -> StepMetadataError:
    return StepMetadataError(
        _SCHEMA_PATH,
        f"step metadata that belongs to this batch: {_HOW}",
        "step metadata this batch was not made with (a stream, file or table shares one "
        "schema, so its step key is another batch's)",
    )


def _custom_raw(custom_metadata: Any) -> Any:
    """The step key of IPC custom metadata (None when absent); checks the argument's kind."""
    if custom_metadata is None:
        return None
    if type(custom_metadata) is pa.KeyValueMetadata:  # bytes keys and values by construction
        # The last one, as the loop below; by position (get_all costs twice as much).
        for i in range(len(custom_metadata) - 1, -1, -1):
            if custom_metadata.key(i) == KEY_STEP:
                return custom_metadata.value(i)
        return None
    items = getattr(custom_metadata, "items", None)
    if not callable(items):
        raise FieldTypeError(
            "custom_metadata",
            "a mapping of bytes to bytes (a message's IPC custom metadata) or None",
            describe(custom_metadata),
        )
    raw = None
    for key, value in items():
        if not isinstance(key, (bytes, str)) or not isinstance(value, (bytes, str)):
            raise FieldTypeError(
                "custom_metadata",
                "a mapping of bytes to bytes (a message's IPC custom metadata)",
                f"the entry {describe(key)}: {describe(value)}",
            )
        if key in (KEY_STEP, KEY_STEP.decode()):
            raw = value
    return raw


def step_metadata(
    batch: pa.RecordBatch, custom_metadata: Any = None, *, missing_step_metadata: str = "error"
) -> dict[str, Any]:
    """A batch's step JSON, checked: from its IPC custom metadata when given, else from its
    schema when the batch is the one :func:`to_record_batch` made it for.

    Parameters
    ----------
    batch
        A batch of this format.
    custom_metadata
        The IPC custom metadata of the message the batch was read from.
    missing_step_metadata
        ``"error"`` (default): a batch without its own step metadata is refused with a
        :class:`StepMetadataError` that says how to read it. ``"defaults"``: its step
        metadata is read off the columns instead (``docs/schema.md`` lists the defaults).
    """
    meta, _, _ = _resolve(batch, custom_metadata, missing_step_metadata)
    # A copy: parsed step JSON shares its nested values with the parse cache (_stepmeta).
    return copy.deepcopy(meta)


def _resolve(
    batch: Any,
    custom_metadata: Any,
    missing: str,
    schema_meta: dict[bytes, bytes] | None = None,
    made: bool = False,
) -> tuple[dict[str, Any], bool, dict[str, Any] | None]:
    """(checked step JSON, whether a head slice of its step may be decoded, the shared tail
    it was copied from or None: ``_stepmeta.parse_shared``).

    ``schema_meta``: the batch's schema metadata, read and format-checked by the caller;
    None: read and checked here. ``made``: the caller found ``batch`` registered by
    ``to_record_batch`` (:func:`._stepmeta.made_with`), with ``schema_meta``'s step key, so
    its ownership is already proven."""
    if not isinstance(batch, pa.RecordBatch):
        raise FieldTypeError("batch", "a pyarrow.RecordBatch", describe(batch))
    if schema_meta is None:
        schema_meta = check_format(batch.schema)
    if missing not in MISSING_POLICIES:
        raise FieldTypeError(
            "missing_step_metadata", " or ".join(map(repr, MISSING_POLICIES)), repr(missing)
        )
    raw = _custom_raw(custom_metadata)
    if raw is not None:
        # IPC custom metadata belongs to its message: trusted as this batch's.
        meta, tail = _stepmeta.parse_shared(raw, _CUSTOM_PATH, _SPEC)
        return meta, False, tail
    raw = schema_meta.get(KEY_STEP)
    if raw is not None and (made or _owned(batch, raw)):
        meta, tail = _stepmeta.parse_shared(raw, _SCHEMA_PATH, _SPEC)
        return meta, True, tail
    if missing == "defaults":
        return _default_meta(batch), False, None
    if raw is not None:
        raise _inherited_error()
    raise StepMetadataError(
        "arrow_outputs.step",
        f"the batch's step metadata: {_HOW}",
        "no arrow_outputs.step key in the custom metadata or the schema (written without "
        "custom_metadata=, or through a tool that drops metadata)",
    )


def _all_null(col: pa.Array) -> bool:
    return col.null_count == len(col)


def _default_meta(batch: pa.RecordBatch) -> dict[str, Any]:
    """The documented reading of a batch without step metadata (``docs/schema.md``)."""
    col = {name: batch.column(name) for name in COLUMNS}
    n = batch.num_rows
    step_col = col["step"]
    step = None
    if n and not step_col.null_count:
        values = np.unique(step_col.to_numpy())
        if len(values) == 1:
            step = int(values[0])

    def present(name: str, layout: Any) -> Any:
        return None if _all_null(col[name]) else layout

    return {
        "step": step,
        "rows": n,
        "sampled_token_ids": "none" if n and _all_null(col["sampled_token_ids"]) else "lists",
        "logprobs": present("logprobs", {"kind": "lists", "cu": "list", "width": None}),
        "prompt_logprobs": present("prompt_logprobs", {"none_rows": [], "empty_widths": {}}),
        "prompt_token_id_logprobs": present("prompt_token_id_logprobs", "torch"),
        "pooler_output": present("pooler_output", "torch"),
        "num_nans_in_logits": present("num_nans_in_logits", "dict"),
        "sampling_mask": present("sampling_mask", {"offsets": True, "cu": True}),
        "aux_output": present("aux_output", {"kind": "numpy"}),
        "kv_connector_output": None,
        "ec_connector_output": None,
        "cudagraph_stats": None,
        "dropped": [],
    }


def _check_rows(batch: pa.RecordBatch, meta: dict[str, Any], head_slice_ok: bool) -> Any:
    """Which of the step's rows this batch holds: None for all of them in order, else their
    step row numbers (a slice or filter of the step's batch)."""
    n, rows = batch.num_rows, meta["rows"]
    for name in ("req_id", "req_index"):
        if batch.column(_AT[name]).null_count:
            raise SchemaMismatchError(name, "no nulls (a non-nullable column)", "nulls")
    index = _flat_values(batch.column(_AT["req_index"]))  # int32 (schema checked)
    arange = len(index) == 0 or (int(index[0]) == 0 and is_arange(index))
    if n == rows and arange:
        return None
    # int64: a difference of int32 values can overflow.
    increasing = len(index) < 2 or bool((np.diff(index.astype(np.int64)) > 0).all())
    inside = len(index) == 0 or (int(index[0]) >= 0 and int(index[-1]) < rows)
    if n > rows or not (increasing and inside):
        if n == rows:
            raise ConsistencyError(
                "req_index", f"0..{n - 1} (each request's position)", _head(index)
            )
        raise StepMetadataError(
            "arrow_outputs.step.rows",
            f"{n} (this batch's rows), or more for a slice of the step",
            f"{rows}: the metadata of another batch",
        )
    if arange and not head_slice_ok:
        raise StepMetadataError(
            "arrow_outputs.step.rows",
            f"{n} (this batch's rows)",
            f"{rows}: this batch is a slice of the step's first {n} rows, or the metadata is "
            "another step's; decode the whole batch, then select requests",
        )
    return index.astype(np.int64)


def _head(a: np.ndarray, k: int = 8) -> str:
    return str(a[:k].tolist())[:-1] + (", ...]" if len(a) > k else "]")


def _req_ids_of(col: pa.Array, n: int, validated: bool) -> list[str]:
    if not n:
        return []
    _, offsets, data = col.buffers()
    fast = (
        _accel.str_list(offsets, data, col.offset, n)
        if data is not None and _accel.accelerated()
        else None
    )
    if fast is not None:
        return fast
    if not validated:
        # pyarrow's conversion trusts the offsets: out of order, it would read past the data.
        check_monotonic(
            list_offsets(col, np.int32), "req_id", limit=0 if data is None else data.size
        )
    return col.to_numpy(zero_copy_only=False).tolist()


def _check_step_column(col: pa.Array, step: int | None) -> None:
    if step is None:
        if col.null_count != len(col):
            raise _claim("step", "None (no step number)", col)
        return
    if col.null_count:
        raise _claim("step", f"step {step} in every row", col)
    values = _flat_values(col)  # int64 (schema checked)
    if len(values) and not (values == step).all():
        bad = values[values != step][0]
        raise StepMetadataError(
            "arrow_outputs.step.step", f"{step}, the step column's value", f"a row of step {bad}"
        )


def _decode_columns(
    batch: pa.RecordBatch,
    meta: dict[str, Any],
    types: ColumnTypes,
    head_slice_ok: bool,
    validated: bool,
) -> tuple[list[str], dict[str, int], dict[str, Any]]:
    """The rows' request ids, their index and the output fields, column by column through
    the codec table: the specification of the C walk (:func:`_decode_fast`)."""
    rows = _check_rows(batch, meta, head_slice_ok)
    _check_step_column(batch.column(_AT["step"]), meta["step"])
    n = batch.num_rows

    req_ids = _req_ids_of(batch.column(_AT["req_id"]), n, validated)
    req_id_to_index = dict(zip(req_ids, _range_list(n)))
    if len(req_id_to_index) != n:
        dup = next(r for r, count in Counter(req_ids).items() if count > 1)
        raise ConsistencyError("req_id", "unique request ids", f"{dup!r} twice")

    ctx = _Dec(req_ids, types, rows, meta["rows"], validated)
    fields: dict[str, Any] = {}
    for at, codec in _DECODERS:
        col = batch.column(at)
        layout = meta[codec.meta_key]
        if layout is None:
            if col.null_count != len(col):
                raise _claim(codec.meta_key, "None (absent)", col)
            fields[codec.output_field] = codec.absent()
        else:
            fields[codec.output_field] = codec.decode(ctx, col, layout)
    return req_ids, req_id_to_index, fields


# The columns the C walk reads, by position: (step, req_id, req_index, sampled_token_ids,
# logprobs, sampling_mask); every other column it only proves all-null (absent).
_FAST_COLUMNS = tuple(
    _AT[name]
    for name in ("step", "req_id", "req_index", "sampled_token_ids", "logprobs", "sampling_mask")
)
_FAST_KEYS = frozenset(("sampled_token_ids", "logprobs", "sampling_mask"))
_F32 = np.dtype(np.float32)
_ITEMSIZE = {"int32": 4, "int64": 8}
_META_KEYS = tuple(codec.meta_key for codec in _CODECS.values())
# One C call instead of a generator over the keys: this runs once per decoded step.
_LAYOUTS_OF = operator.itemgetter(*_META_KEYS)
# The absent columns that decode to a fresh empty list or dict per output (the others: None).
_ABSENT_FRESH = tuple(
    (c.output_field, c.absent) for c in _CODECS.values() if c.absent() is not None
)
# Every field of ModelRunnerOutput, in its order, None: the walk's output starts from a copy
# and sets each field it decodes (absent ones included), so the output is made without its
# __init__ (object.__new__ and this whole dict as its __dict__: a fifth of the cost).
_OUTPUT_FIELDS: dict[str, Any] = {f.name: None for f in dataclasses.fields(ModelRunnerOutput)}
_new_object = object.__new__
# A NamedTuple made from all its fields at once (LogprobsLists: what its __new__ makes).
_new_tuple = tuple.__new__


class _FastPlan(NamedTuple):
    """What the C walk is told for one shape of step (its layouts and column types)."""

    absent: tuple[int, ...]
    sampled: int
    logprobs: tuple[int, int, bool, int] | None
    mask: tuple[bool] | None
    id_dtype: Any
    rank_dtype: Any


# Parsed step JSON shares its layout objects between steps of one shape (_stepmeta), so a
# plan is found by their identity: (layouts, types) are kept with it, alive, so a key's ids
# are those very objects' (a live object's id is never another's).
_PLANS: dict[tuple[int, ...], tuple[tuple[Any, ...], ColumnTypes, _FastPlan | None]] = {}


# The same plans by (types, the shared tail the step JSON was copied from: parse_shared),
# which holds every layout a plan reads: one lookup of two ids instead of a dozen.
_TAIL_PLANS: dict[tuple[int, int], tuple[dict[str, Any], ColumnTypes, _FastPlan | None]] = {}


def _fast_plan(
    meta: dict[str, Any], types: ColumnTypes, tail: dict[str, Any] | None = None
) -> _FastPlan | None:
    if tail is not None:
        by_tail = _TAIL_PLANS.get((id(types), id(tail)))
        if by_tail is not None and by_tail[0] is tail and by_tail[1] is types:
            return by_tail[2]
        plan = _fast_plan(meta, types)
        if len(_TAIL_PLANS) >= 64:
            _TAIL_PLANS.clear()
        _TAIL_PLANS[id(types), id(tail)] = (tail, types, plan)
        return plan
    layouts = _LAYOUTS_OF(meta)
    key = (id(types), *map(id, layouts))
    hit = _PLANS.get(key)
    if hit is not None:
        return hit[2]
    plan = _make_plan(meta, types)
    if len(_PLANS) >= 64:
        _PLANS.clear()
    _PLANS[key] = (layouts, types, plan)
    return plan


def _make_plan(meta: dict[str, Any], types: ColumnTypes) -> _FastPlan | None:
    """The walk's plan for a step's layouts; None for a step it does not take (a layout of
    another kind: tensors, prompt logprobs, pooler output, NaN counts, aux rows)."""
    absent = []
    for at, codec in _DECODERS:
        layout = meta[codec.meta_key]
        if layout is None:
            absent.append(at)
        elif codec.meta_key not in _FAST_KEYS:
            return None
    sampled = meta["sampled_token_ids"]
    if sampled == "none":
        sampled_size = 0
    elif sampled == "lists":
        sampled_size = _ITEMSIZE[types.sampled_token_ids]
    else:
        return None
    lp_spec = None
    lp = meta["logprobs"]
    if lp is not None:
        cu, width = lp.get("cu", "list"), lp.get("width")
        if (
            lp.get("kind", "lists") != "lists"
            or cu not in ("list", "none")
            or not (width is None or (type(width) is int and 0 <= width < 2**31))
        ):
            return None
        lp_spec = (
            _ITEMSIZE[types.logprob_token_ids],
            _ITEMSIZE[types.logprob_ranks],
            cu == "list",
            -1 if width is None else width,
        )
    mask_spec = None
    mask = meta["sampling_mask"]
    if mask is not None:
        cu_mask = mask.get("cu", True)
        if mask.get("offsets", True) is not True or type(cu_mask) is not bool:
            return None
        mask_spec = (cu_mask,)
    return _FastPlan(
        tuple(absent),
        sampled_size,
        lp_spec,
        mask_spec,
        _NP_INT[types.logprob_token_ids],
        _NP_INT[types.logprob_ranks],
    )


def _decode_fast(
    batch: pa.RecordBatch,
    meta: dict[str, Any],
    types: ColumnTypes,
    validated: bool,
    tail: dict[str, Any] | None = None,
) -> tuple[list[str], dict[str, int], dict[str, Any]] | None:
    """:func:`_decode_columns` in one C walk over the batch's exported ArrowArray tree, for the
    steps vLLM makes every step (sampled ids, logprobs lists, sampling masks, the rest
    absent), whole and in order; None for anything else, or for anything the walk does not
    accept, and the column decoders then decode it or raise their precise error.

    Arrays come back as read-only numpy views of the batch's buffers (zero-copy)."""
    n = batch.num_rows
    if not n or meta["rows"] != n:
        return None  # an empty step or a slice: the column decoders' cases
    plan = _fast_plan(meta, types, tail)
    if plan is None:
        return None
    if not validated:
        # The interface carries no buffer sizes: pyarrow's O(1) checks prove them (and the
        # last offsets) first; what they refuse goes to the column decoders.
        try:
            batch.validate()
        except pa.ArrowInvalid:
            return None
    got = _accel.decode_batch(
        batch, _FAST_COLUMNS, meta["step"], plan.absent, plan.sampled, plan.logprobs, plan.mask
    )
    if got is None:
        return None
    req_ids, index, sampled_ids, lp_parts, mask_parts = got
    fields = _OUTPUT_FIELDS.copy()  # absent fields None, but the fresh containers below
    for name, factory in _ABSENT_FRESH:
        fields[name] = factory()
    fields["sampled_token_ids"] = sampled_ids
    if lp_parts is not None:
        # Each region holds exactly its array's bytes (num x w values, num ranks): arrays
        # made straight over them, half the cost of frombuffer + reshape.
        r_ids, r_lps, r_ranks, num, w, cu_list = lp_parts
        fields["logprobs"] = _new_tuple(
            LogprobsLists,
            (
                np.ndarray((num, w), plan.id_dtype, r_ids),
                np.ndarray((num, w), _F32, r_lps),
                np.ndarray((num,), plan.rank_dtype, r_ranks),
                cu_list,
            ),
        )
    if mask_parts is not None:
        r_tok, r_csr, cu_list = mask_parts
        fields["sampling_masks"] = _new_tuple(
            SamplingMaskLists,
            (
                np.frombuffer(r_tok, _NP_INT["int32"]),
                np.frombuffer(r_csr, _NP_INT["int64"]),
                cu_list,
            ),
        )
    return req_ids, index, fields


def from_record_batch(
    batch: pa.RecordBatch,
    *,
    custom_metadata: Any = None,
    validate: bool = True,
    missing_step_metadata: str = "error",
    classes: Iterable[type] | None = None,
) -> Any:
    """A record batch made by :func:`to_record_batch` back into a ``ModelRunnerOutput``.

    Arrays and tensors are views of the batch's buffers (zero-copy): read-only when the
    batch came from IPC or was decoded by the C accelerator, and to be treated as read-only
    always, since they share memory with the batch (and, in memory, with the producer's
    arrays). Python lists are made where vLLM has lists; the C accelerator leaves the rows of
    ``sampled_token_ids`` (lists of ints) to reference counting alone, out of the cycle
    collector (``docs/accelerator.md``, decoded rows and the garbage collector).

    A slice or filter of a step's batch decodes to the output of its rows (the step-level
    connector outputs and CUDA-graph stats stay those of the step).

    Parameters
    ----------
    batch
        A batch of this format (its schema metadata names the format and version).
    custom_metadata
        The batch's IPC custom metadata (``read_next_batch_with_custom_metadata`` or
        ``get_batch_with_custom_metadata``): a batch read from a stream or file needs it.
    validate
        Run ``batch.validate(full=True)`` first: batches from elsewhere are untrusted, and
        only full validation catches bad offsets. ``False`` is for batches this process
        made itself: the checks that full validation makes are then skipped, not redone
        (the C accelerator's walk still runs pyarrow's constant-time ``validate()``: it
        reads buffers whose sizes only pyarrow knows).
    missing_step_metadata
        ``"error"`` (default) refuses a batch without its own step metadata;
        ``"defaults"`` decodes it with the defaults of ``docs/schema.md``.
    classes
        Connector payload classes to rebuild (an allow-list). Payloads travel as tagged
        records; without their class here they decode to read-only
        :class:`~arrow_outputs.Record` objects. Nothing is imported by a name in the data.
    """
    return decode_checked(batch, custom_metadata, validate, missing_step_metadata, classes)


def _validate_full(batch: pa.RecordBatch) -> None:
    try:
        _accel.validate_full(batch)
    except pa.ArrowInvalid as e:
        raise SchemaMismatchError("batch", "a valid Arrow record batch", str(e)) from e


# C++ schema address -> (the schema, its metadata as check_format read it, its column types):
# the schema is held, so its address is not reused while the entry lives.
_SCHEMAS: dict[int, tuple[pa.Schema, dict[bytes, bytes], ColumnTypes]] = {}


def _schema_of(batch: pa.RecordBatch) -> tuple[dict[bytes, bytes], ColumnTypes]:
    """A batch's schema metadata, format-checked (every batch: the run cache of
    _decode_types ignores metadata), and its column types. The batches of one stream share
    one C++ schema: keyed by its address where the C++ bridge gives it, each is checked once
    (the metadata dict is shared between calls then: read it, never change it)."""
    key = _accel.schema_address(batch)
    hit = None if key is None else _SCHEMAS.get(key)
    if hit is not None:
        return hit[1], hit[2]
    schema = batch.schema
    schema_meta = check_format(schema)
    types = _decode_types(schema, schema_meta)
    if key is not None:
        if len(_SCHEMAS) >= 32:
            _SCHEMAS.clear()
        _SCHEMAS[key] = (schema, schema_meta, types)
    return schema_meta, types


def decode_checked(
    batch: pa.RecordBatch,
    custom_metadata: Any,
    validate: bool,
    missing_step_metadata: str,
    classes: Iterable[type] | None,
    validated: bool = False,
) -> Any:
    """:func:`from_record_batch`, for readers that already ran ``batch.validate(full=True)``
    on this very batch object (``validated``): the decode then trusts its buffers as full
    validation would, without running it again."""
    if not isinstance(batch, pa.RecordBatch):
        raise FieldTypeError("batch", "a pyarrow.RecordBatch", describe(batch))
    known = _stepmeta.made_with(batch)
    if known is None:
        schema_meta, types = _schema_of(batch)
    else:
        # The very batch to_record_batch made: its schema is the run's (checked when the run
        # was first used) with this step key, so its format and types are the run's.
        raw, types = known
        schema_meta = {KEY_STEP: raw}
    meta, head_slice_ok, tail = _resolve(
        batch, custom_metadata, missing_step_metadata, schema_meta, made=known is not None
    )
    allowed = allow_list(classes)
    if validate not in (True, False):
        raise FieldTypeError("validate", "True or False", describe(validate))
    if validate and not validated:
        _validate_full(batch)
    validated = validated or validate
    fast = _decode_fast(batch, meta, types, validated, tail) if _accel.decode_batch else None
    if fast is not None:
        req_ids, req_id_to_index, fields = fast
    else:
        req_ids, req_id_to_index, fields = _decode_columns(
            batch, meta, types, head_slice_ok, validated
        )
    for key, cls in _STEP_CLASSES.items():
        value = meta[key]
        if value is not None:
            path = f"arrow_outputs.step.{key}"
            fields[key] = cls(
                **{
                    k: rebuild(from_jsonable(v, f"{path}.{k}"), allowed, f"{key}.{k}")
                    for k, v in value.items()
                }
            )
    if fast is None:
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index=req_id_to_index, **fields)
    # The walk's fields are every field of the dataclass (_OUTPUT_FIELDS): what __init__
    # would store, stored at once.
    fields["req_ids"] = req_ids
    fields["req_id_to_index"] = req_id_to_index
    out = _new_object(ModelRunnerOutput)
    out.__dict__ = fields
    return out
