"""The record-batch schema: column names and types, metadata keys, version rules.

``docs/schema.md`` is the specification; ``tests/test_schema_doc.py`` checks that this
module and that page agree.

A run's schema is fixed at its first step (:func:`infer_schema`) or declared up front
(:func:`output_schema`), so every batch of a run fits one IPC stream. The dtypes that
producers choose (int32 or int64 token ids, float32 or bfloat16 pooler rows...) are kept,
never converted; :class:`ColumnTypes` records them.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import pyarrow as pa

from ._checks import host_array
from .errors import FieldTypeError, FormatVersionError, SchemaMismatchError
from .logprobs import ARROW_INT, INT_TYPES, logprobs_type
from .masks import SAMPLING_MASK_TYPE
from .tensors import TensorSpec, infer_spec

__all__ = [
    "COLUMNS",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "ColumnTypes",
    "column_types",
    "infer_schema",
    "output_schema",
    "run_metadata",
]

FORMAT_NAME = "arrow_outputs.model_runner_output"
#: MAJOR.MINOR. Readers refuse a newer MAJOR; a newer MINOR only adds optional things.
FORMAT_VERSION = "1.1"

KEY_FORMAT = b"arrow_outputs.format"
KEY_VERSION = b"arrow_outputs.version"
KEY_PRODUCER = b"arrow_outputs.producer"
KEY_RUN = b"arrow_outputs.run"
KEY_STEP = b"arrow_outputs.step"
RESERVED_PREFIX = "arrow_outputs."

#: Column names, in schema order.
COLUMNS = (
    "step",
    "req_id",
    "req_index",
    "sampled_token_ids",
    "logprobs",
    "prompt_logprobs",
    "prompt_token_id_logprobs",
    "pooler_output",
    "num_nans_in_logits",
    "sampling_mask",
    "aux_output",
)


@dataclass(frozen=True)
class ColumnTypes:
    """The producer-chosen types of a run: what may differ between runs, never within one.

    Examples
    --------
    >>> ColumnTypes(logprob_token_ids="int32").logprob_ranks
    'int64'
    """

    sampled_token_ids: str = "int64"
    logprob_token_ids: str = "int64"
    logprob_ranks: str = "int64"
    prompt_logprob_token_ids: str = "int64"
    prompt_logprob_ranks: str = "int64"
    prompt_token_id_logprobs: TensorSpec = field(default_factory=lambda: TensorSpec("float32", 2))
    pooler_output: TensorSpec = field(default_factory=lambda: TensorSpec("float32", 1))
    aux_rows: TensorSpec = field(default_factory=lambda: TensorSpec("uint16", 3))

    def __post_init__(self) -> None:
        for name in (
            "sampled_token_ids",
            "logprob_token_ids",
            "logprob_ranks",
            "prompt_logprob_token_ids",
            "prompt_logprob_ranks",
        ):
            value = getattr(self, name)
            if value not in INT_TYPES:
                raise FieldTypeError(f"ColumnTypes.{name}", "'int32' or 'int64'", repr(value))


@lru_cache(maxsize=64)
def _columns_schema(types: ColumnTypes) -> pa.Schema:
    aux = pa.struct(
        [pa.field("token_start", pa.int64(), nullable=False), types.aux_rows.field("rows")]
    )
    return pa.schema(
        [
            pa.field("step", pa.int64()),
            pa.field("req_id", pa.string(), nullable=False),
            pa.field("req_index", pa.int32(), nullable=False),
            pa.field("sampled_token_ids", pa.list_(ARROW_INT[types.sampled_token_ids])),
            pa.field("logprobs", logprobs_type(types.logprob_token_ids, types.logprob_ranks)),
            pa.field(
                "prompt_logprobs",
                logprobs_type(types.prompt_logprob_token_ids, types.prompt_logprob_ranks),
            ),
            types.prompt_token_id_logprobs.field("prompt_token_id_logprobs"),
            types.pooler_output.field("pooler_output"),
            pa.field("num_nans_in_logits", pa.int32()),
            pa.field("sampling_mask", SAMPLING_MASK_TYPE),
            pa.field("aux_output", aux),
        ]
    )


def _producer() -> str:
    versions = {"arrow_outputs": _version(), "pyarrow": pa.__version__, "numpy": np.__version__}
    torch = sys.modules.get("torch")
    if torch is not None:
        versions["torch"] = torch.__version__
    return json.dumps(versions)


def _version() -> str:
    from . import __version__

    return __version__


def output_schema(
    types: ColumnTypes | None = None, *, metadata: dict[str, Any] | None = None
) -> pa.Schema:
    """The schema of a run, with its run-level metadata.

    Parameters
    ----------
    types
        The run's producer dtypes; defaults to vLLM's model runner V2 (int64 ids and ranks,
        float32 tensors).
    metadata
        User run metadata (model name, config...): any JSON-serialisable dict, kept under
        the ``arrow_outputs.run`` key.

    Examples
    --------
    >>> schema = output_schema(metadata={"model": "tiny"})
    >>> schema.names[:4]
    ['step', 'req_id', 'req_index', 'sampled_token_ids']
    >>> run_metadata(schema)
    {'model': 'tiny'}
    """
    schema = _columns_schema(types or ColumnTypes())
    meta = {
        KEY_FORMAT: FORMAT_NAME.encode(),
        KEY_VERSION: FORMAT_VERSION.encode(),
        KEY_PRODUCER: _producer().encode(),
    }
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise FieldTypeError("metadata", "a dict of JSON-serialisable values", repr(metadata))
        try:
            meta[KEY_RUN] = json.dumps(metadata, allow_nan=False).encode()
        except (TypeError, ValueError) as e:
            raise FieldTypeError("metadata", "JSON-serialisable values", str(e)) from e
    return schema.with_metadata(meta)


def run_metadata(schema_or_batch: pa.Schema | pa.RecordBatch | pa.Table) -> dict[str, Any]:
    """The user run metadata stored by :func:`output_schema` (``{}`` when there is none)."""
    schema = getattr(schema_or_batch, "schema", schema_or_batch)
    if not isinstance(schema, pa.Schema):
        raise FieldTypeError(
            "schema_or_batch", "a pyarrow Schema, RecordBatch or Table", repr(schema_or_batch)[:60]
        )
    raw = (schema.metadata or {}).get(KEY_RUN)
    if raw is None:
        return {}
    path = "schema.metadata[arrow_outputs.run]"
    try:
        value = json.loads(_utf8(raw, path))
    except (ValueError, RecursionError) as e:
        raise SchemaMismatchError(path, "a JSON object", str(e)[:80]) from e
    if type(value) is not dict:
        raise SchemaMismatchError(path, "a JSON object", type(value).__name__)
    return value


def _shown(raw: bytes) -> str:
    """Metadata bytes for a message: the text when it is UTF-8, else the bytes' repr."""
    try:
        text = repr(raw.decode("utf-8"))
    except UnicodeDecodeError:
        text = repr(raw)
    return text if len(text) <= 60 else text[:57] + "..."


def _utf8(raw: bytes, path: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SchemaMismatchError(path, "UTF-8 text", f"bytes that are not UTF-8 ({e})") from e


def check_format(schema: pa.Schema) -> dict[bytes, bytes]:
    """Refuse schemas of another format, and newer major versions of this one.

    Returns the schema's metadata as read for the check (each read of ``Schema.metadata``
    builds a new dict: a caller that needs other keys reuses this one).
    """
    meta = schema.metadata or {}
    if meta.get(KEY_VERSION) in _READABLE and meta.get(KEY_FORMAT) == _FORMAT_NAME_B:
        return meta  # a version this reader has accepted before (checked in full below)
    name = meta.get(KEY_FORMAT)
    if name != FORMAT_NAME.encode():
        raise SchemaMismatchError(
            "schema.metadata[arrow_outputs.format]",
            repr(FORMAT_NAME),
            "no such key (not an arrow_outputs batch)" if name is None else _shown(name),
        )
    version = _utf8(meta.get(KEY_VERSION, b""), "schema.metadata[arrow_outputs.version]")
    try:
        major = int(version.split(".")[0])
    except ValueError:
        raise FormatVersionError(
            "schema.metadata[arrow_outputs.version]", "MAJOR.MINOR", repr(version)
        ) from None
    if major > int(FORMAT_VERSION.split(".")[0]):
        raise FormatVersionError(
            "schema.metadata[arrow_outputs.version]",
            f"major version {FORMAT_VERSION.split('.')[0]} or older (this reader is "
            f"{FORMAT_VERSION}; upgrade arrow_outputs to read it)",
            version,
        )
    if len(_READABLE) < 16:
        _READABLE.add(meta[KEY_VERSION])
    return meta


# Version strings check_format accepted, as bytes (a run's every batch carries the same one).
_READABLE: set[bytes] = set()
_FORMAT_NAME_B = FORMAT_NAME.encode()


def column_types(schema: pa.Schema) -> ColumnTypes:
    """The :class:`ColumnTypes` of a schema of this format; refuses any other schema."""
    check_format(schema)
    try:
        names = tuple(schema.names)
    except UnicodeDecodeError as e:  # field names from a file are bytes until proven UTF-8
        raise SchemaMismatchError("schema", "UTF-8 field names", str(e)) from e
    if names != COLUMNS:
        raise SchemaMismatchError("schema", f"columns {list(COLUMNS)}", str(list(names)))

    def int_of(t: pa.DataType, name: str) -> str:
        dt = {pa.int32(): "int32", pa.int64(): "int64"}.get(t)
        if dt is None:
            raise SchemaMismatchError(name, "int32 or int64 values", str(t))
        return dt

    def logprob_ints(name: str) -> tuple[str, str]:
        t = schema.field(name).type
        st = getattr(t, "value_type", None)
        # Fields by name only on a struct: any other type's field() takes an index and raises
        # TypeError for a name (a file's schema can hold any type here).
        if (
            isinstance(st, pa.DataType)
            and pa.types.is_struct(st)
            and st.get_field_index("token_ids") >= 0
            and st.get_field_index("rank") >= 0
        ):
            ids_t = getattr(st.field("token_ids").type, "value_type", None)
            if isinstance(ids_t, pa.DataType):
                return int_of(ids_t, name), int_of(st.field("rank").type, name)
        raise SchemaMismatchError(name, "a logprobs list type", str(t))

    try:
        sampled = int_of(schema.field("sampled_token_ids").type.value_type, "sampled_token_ids")
    except AttributeError as e:
        raise SchemaMismatchError("sampled_token_ids", "list<int32|int64>", "another type") from e
    lp_ids, lp_ranks = logprob_ints("logprobs")
    pl_ids, pl_ranks = logprob_ints("prompt_logprobs")
    aux_t = schema.field("aux_output").type
    if not pa.types.is_struct(aux_t) or aux_t.get_field_index("rows") < 0:
        raise SchemaMismatchError("aux_output", "struct<token_start, rows>", str(aux_t))
    types = ColumnTypes(
        sampled_token_ids=sampled,
        logprob_token_ids=lp_ids,
        logprob_ranks=lp_ranks,
        prompt_logprob_token_ids=pl_ids,
        prompt_logprob_ranks=pl_ranks,
        prompt_token_id_logprobs=TensorSpec.from_field(schema.field("prompt_token_id_logprobs")),
        pooler_output=TensorSpec.from_field(schema.field("pooler_output")),
        aux_rows=_aux_rows(aux_t.field("rows")),
    )
    expected = _columns_schema(types)
    for want, got in zip(expected, schema):
        if not want.equals(got, check_metadata=True):
            raise SchemaMismatchError(want.name, *_difference(want, got))
    return types


def _aux_rows(field: pa.Field) -> TensorSpec:
    """The aux rows' tensor spec; an error names the field by its path in the schema."""
    try:
        return TensorSpec.from_field(field)
    except SchemaMismatchError as e:
        raise SchemaMismatchError("aux_output.rows", e.expected, e.got) from None


def _difference(want: pa.Field, got: pa.Field) -> tuple[str, str]:
    """(expected, got) naming what differs between two fields: type, nullability, metadata."""
    if not want.type.equals(got.type):
        return str(want.type), str(got.type)
    if want.nullable != got.nullable:
        return f"nullable={want.nullable}", f"nullable={got.nullable}"
    for child_want, child_got in zip(_children(want.type), _children(got.type)):
        if not child_want.equals(child_got, check_metadata=True):
            return _difference(child_want, child_got)
    return f"field metadata {want.metadata}", f"field metadata {got.metadata}"


def _children(t: pa.DataType) -> list[pa.Field]:
    return [t.field(i) for i in range(t.num_fields)]


def infer_column_types(output: Any) -> ColumnTypes:
    """The types a step implies; absent fields take :class:`ColumnTypes` defaults."""
    kw: dict[str, Any] = {}
    lp = getattr(output, "logprobs", None)
    if lp is not None and hasattr(lp, "logprob_token_ids"):
        kw["logprob_token_ids"] = _int_dtype(lp.logprob_token_ids)
        kw["logprob_ranks"] = _int_dtype(logprob_ranks(lp))
    prompt = _mapping_values(getattr(output, "prompt_logprobs_dict", None))
    first = next((v for v in prompt if v is not None), None)
    if first is not None and hasattr(first, "logprob_token_ids"):
        kw["prompt_logprob_token_ids"] = _int_dtype(first.logprob_token_ids)
        kw["prompt_logprob_ranks"] = _int_dtype(getattr(first, "selected_token_ranks", None))
    tid = _mapping_values(getattr(output, "prompt_token_id_logprobs_dict", None))
    if tid:
        kw["prompt_token_id_logprobs"] = _infer(tid, 2, fixed=False)
    pooler = getattr(output, "pooler_output", None)
    if isinstance(pooler, list) and any(r is not None for r in pooler):
        kw["pooler_output"] = _infer(pooler, 1, fixed=True)
    aux = _mapping_values(getattr(output, "aux_output_connector_output", None))
    if aux:
        kw["aux_rows"] = _infer([getattr(v, "rows", None) for v in aux], 3, fixed=False)
    return ColumnTypes(**kw)


def logprob_ranks(lp: Any) -> Any:
    """The ranks of a ``LogprobsLists`` (``sampled_token_ranks``) or ``LogprobsTensors``
    (``selected_token_ranks``); None when it has neither."""
    return getattr(lp, "sampled_token_ranks", getattr(lp, "selected_token_ranks", None))


def _mapping_values(x: Any) -> list[Any]:
    """Values of a mapping; [] for anything else (the encoder reports wrong kinds)."""
    values = getattr(x, "values", None)
    return list(values()) if callable(values) and hasattr(x, "items") else []


def _int_dtype(x: Any) -> str:
    try:
        dt = host_array(x, "dtype")[1]
    except Exception:
        return "int64"  # the encoder reports the real problem with its field name
    return dt if dt in INT_TYPES else "int64"


def _infer(rows: list[Any], ndim: int, *, fixed: bool) -> TensorSpec:
    try:
        return infer_spec(rows, "rows", ndim=ndim, fixed=fixed)
    except Exception:
        return TensorSpec("float32", ndim)  # the encoder reports the real problem


def infer_schema(output: Any, *, metadata: dict[str, Any] | None = None) -> pa.Schema:
    """The schema a run gets when ``output`` is its first step.

    Fields absent from that step take the defaults of :class:`ColumnTypes`; declare them
    with :func:`output_schema` when a later step brings them with other dtypes.
    """
    return output_schema(infer_column_types(output), metadata=metadata)
