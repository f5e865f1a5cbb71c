"""Which implementation of the codec's walks over Python objects runs: C or pure Python.

The record-batch codec imports only this module and calls ``_accel.flatten_int_lists(...)``
and so on through it, so :func:`set_pure_python` takes effect at once, everywhere. Besides the
walks, :data:`record_batch` assembles a step's batch from its columns (nodes or arrays): on
the compiled path through one Arrow C Data Interface import (``_speedups.build_array``), on
the pure-Python path through pyarrow's constructors (``_pyspeedups.record_batch``, its
specification).

- ``arrow_outputs._speedups`` (C) is used when it was compiled at install time;
  ``arrow_outputs._pyspeedups`` (its specification) otherwise.
- ``ARROW_OUTPUTS_PURE_PYTHON=1`` in the environment, read once at import, starts on the
  pure-Python path even where C is available (any value but "" and "0" counts).
- Both give the same answer for every input (``tests/test_speedups.py`` runs both), so the
  choice changes speed only, never results or error messages.

Examples
--------
>>> from arrow_outputs import _accel
>>> was = _accel.accelerated()
>>> _accel.set_pure_python(True)
>>> _accel.accelerated(), _accel.index_in_order(["a"], {"a": 0})
(False, True)
>>> _accel.set_pure_python(not was)
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import pyarrow as pa

from arrow_outputs import _pyspeedups
from arrow_outputs.errors import UnsupportedValueError

__all__ = [
    "AVAILABLE",
    "accelerated",
    "copy_from_address",
    "decode_batch",
    "flatten_int_lists",
    "index_in_order",
    "int32_head",
    "int_offsets",
    "mask_rows",
    "mask_supports",
    "message_custom_metadata",
    "offsets_ok",
    "read_message",
    "record_batch",
    "same_items",
    "sampled_rows",
    "schema_address",
    "set_pure_python",
    "split_int_lists",
    "str_list",
    "utf8_array",
    "validate_full",
    "write_message",
]

_compiled: ModuleType | None
try:
    # `import a.b as c`, not `from a import b`: only the former reports a missing module
    # as ModuleNotFoundError with its name.
    import arrow_outputs._speedups as _compiled
except ModuleNotFoundError as e:
    # Only "not built" falls back: a module that exists but fails to load is a broken build,
    # and hiding it would turn a bug into a silent slowdown.
    if e.name != "arrow_outputs._speedups":
        raise
    _compiled = None

#: Whether the compiled module was built and imported (whichever path is in use now).
AVAILABLE: bool = _compiled is not None

# The C path's crossings into pyarrow done in Arrow's C++ library (``_arrowbridge``, C++
# against the pyarrow it was built with): the encode's batch made from its nodes, the decode
# walk's tree filled from a batch's buffers, a batch's schema identity, the proof of full
# validation, and the sharing path's IPC messages written and read in one call. Unlike
# ``_speedups`` it may fail to load in a sound install: upgrading pyarrow after installing
# arrow-outputs makes it refuse to load (or its library go missing), and the C path then
# goes through pyarrow's own API, with the same results.
_bridge: ModuleType | None
try:
    import arrow_outputs._arrowbridge as _bridge
except ImportError as e:
    _bridge = None
    BRIDGE_UNAVAILABLE: str = str(e)
else:
    BRIDGE_UNAVAILABLE = ""

# The walks and the assembly, rebound by set_pure_python; typed by the specification's
# signatures.
flatten_int_lists = _pyspeedups.flatten_int_lists
utf8_array = _pyspeedups.utf8_array
index_in_order = _pyspeedups.index_in_order
str_list = _pyspeedups.str_list
split_int_lists = _pyspeedups.split_int_lists
mask_rows = _pyspeedups.mask_rows
mask_supports = _pyspeedups.mask_supports
int_offsets = _pyspeedups.int_offsets
offsets_ok = _pyspeedups.offsets_ok
same_items = _pyspeedups.same_items
copy_from_address = _pyspeedups.copy_from_address
sampled_rows = _pyspeedups.sampled_rows
int32_head = _pyspeedups.int32_head
message_custom_metadata = _pyspeedups.message_custom_metadata
record_batch = _pyspeedups.record_batch
_using_c = False


# The request ids of the last step decoded in C, for the next one (_speedups.known_matches):
# one immutable entry, replaced whole, so threads at worst miss it.
_known_req_ids: Any = None


def _c_decode_batch(batch: pa.RecordBatch, *plan: Any) -> tuple[Any, ...] | None:
    """The decoded objects of ``batch`` from one walk in C, or None (see
    ``_speedups.decode_batch``): the batch's array is handed over once through the C Data
    Interface (the schema was checked in Python) and read there. ``_arrowbridge`` fills the
    ArrowArray tree from the batch's own buffers where it can (a third of a small step's
    decode less); pyarrow's export, the same tree, otherwise."""
    global _known_req_ids
    assert _compiled is not None  # only bound when it was built
    capsule, address = _compiled.array_slot()
    if _bridge is None or not _bridge.export_into(batch, address):
        batch._export_to_c(address)
    got = _compiled.decode_batch(capsule, batch.num_rows, *plan, _known_req_ids)
    if got is None:
        return None
    _known_req_ids = got[5]
    return got[:5]


#: The decode side's walk over a whole batch (C only); None on the pure-Python path, whose
#: column decoders in ``arrow_outputs.batch`` are its specification.
decode_batch: Any = None


def _c_record_batch(
    columns: list[Any], schema: pa.Schema, n: int, metadata: dict[bytes, bytes] | None = None
) -> pa.RecordBatch:
    """:func:`_pyspeedups.record_batch` without a constructor call per array, and no copy:
    ``_arrowbridge.assemble`` makes the whole batch from the nodes in Arrow's C++ library
    where it is loaded; otherwise :func:`_import_record_batch` imports the node columns
    through the Arrow C Data Interface (about 10 us more per step).
    """
    if _compiled is None or len(columns) != len(schema):
        return _pyspeedups.record_batch(columns, schema, n, metadata)
    if _bridge is not None:
        listed = columns if type(columns) is list else list(columns)
        got = _bridge.assemble(schema, n, listed, metadata)
        # None: a column that is not what its field says, or input of another kind; the
        # specification makes that batch or raises its precise error.
        return _pyspeedups.record_batch(columns, schema, n, metadata) if got is None else got
    return _import_record_batch(columns, schema, n, metadata)


def _import_record_batch(
    columns: list[Any], schema: pa.Schema, n: int, metadata: dict[bytes, bytes] | None
) -> pa.RecordBatch:
    """:func:`_c_record_batch` through pyarrow's API: the node columns' tree imported with
    ``RecordBatch._import_from_c``.

    A column given as a pyarrow array of its field's type joins the batch after the import
    as it is (``add_column``: its arrays are not imported again, a third of the cost for the
    all-null columns of absent fields); any other column sends the whole batch to the
    specification, which raises what ``from_arrays`` raises.
    """
    assert _compiled is not None  # only called on the compiled path
    kinds = tuple(map(type, columns))
    if kinds.count(tuple) == len(columns):  # every column a node
        nodes = tuple(columns)
        arrays: tuple[int, ...] = ()
        target = schema if metadata is None else schema.with_metadata(metadata)
    else:
        fields, at, arrays, part = _columns_of(schema, kinds)
        if part is None:  # no node column, or a column neither node nor pyarrow array
            return _pyspeedups.record_batch(columns, schema, n, metadata)
        nodes = tuple(columns[i] for i in at)
        meta = schema.metadata if metadata is None else metadata
        target = part.with_metadata(meta) if meta else part
    capsule, address = _compiled.build_array((n, 0, (None,), nodes))
    batch = pa.RecordBatch._import_from_c(address, target)
    del capsule  # moved into the batch by the import; releases the tree only if it was not
    # The checks from_buffers and from_arrays make (buffer sizes, offsets against lengths);
    # the arrays added below were checked when pyarrow made them.
    batch.validate()
    try:
        for i in arrays:  # in column order: every column before i is in place
            batch = batch.add_column(i, fields[i], columns[i])
    except (pa.ArrowTypeError, pa.ArrowInvalid):  # not of its field's type, or length
        return _pyspeedups.record_batch(columns, schema, n, metadata)
    return batch


# (id(schema), the columns' types) -> (schema, its fields, the positions of the node columns,
# those of the array columns, a schema of the node columns alone or None when the C assembly
# does not apply); the schema is held, so its id is not reused while the entry lives.
_PARTS: dict[tuple[int, tuple[type, ...]], tuple[Any, ...]] = {}


def _columns_of(
    schema: pa.Schema, kinds: tuple[type, ...]
) -> tuple[tuple[Any, ...], tuple[int, ...], tuple[int, ...], pa.Schema | None]:
    """``schema``'s fields, the positions of the node columns (``kinds``: each column's type)
    and of the others, and a schema (without metadata) of the node columns alone: None when
    there is no node column or another column is no pyarrow array."""
    key = (id(schema), kinds)
    got = _PARTS.get(key)
    if got is None or got[0] is not schema:
        if len(_PARTS) >= 32:
            _PARTS.clear()
        fields = tuple(schema)
        at = tuple(i for i, kind in enumerate(kinds) if kind is tuple)
        others = tuple(i for i, kind in enumerate(kinds) if kind is not tuple)
        usable = at and all(issubclass(kinds[i], pa.Array) for i in others)
        part = pa.schema([fields[i] for i in at]) if usable else None
        got = _PARTS[key] = (schema, fields, at, others, part)
    return got[1], got[2], got[3], got[4]


def set_pure_python(flag: bool) -> None:
    """Run the pure-Python path (``True``) or the compiled one (``False``) from now on.

    Raises
    ------
    UnsupportedValueError
        For ``False`` when the compiled module is not available (:data:`AVAILABLE`).
    """
    global flatten_int_lists, utf8_array, index_in_order, str_list, split_int_lists, mask_rows
    global int_offsets, same_items, record_batch, _using_c, mask_supports, decode_batch
    global copy_from_address, sampled_rows, int32_head, message_custom_metadata, offsets_ok
    impl = _pyspeedups
    if not flag:
        if _compiled is None:
            raise UnsupportedValueError(
                "arrow_outputs._accel.set_pure_python(False)",
                "the compiled module arrow_outputs._speedups (built by pip with a C compiler)",
                "none: this install has the pure-Python path only; reinstall from source "
                "with a C compiler to build it",
            )
        impl = _compiled
    flatten_int_lists = impl.flatten_int_lists
    utf8_array = impl.utf8_array
    index_in_order = impl.index_in_order
    str_list = impl.str_list
    split_int_lists = impl.split_int_lists
    mask_rows = impl.mask_rows
    mask_supports = impl.mask_supports
    int_offsets = impl.int_offsets
    offsets_ok = impl.offsets_ok
    same_items = impl.same_items
    copy_from_address = impl.copy_from_address
    sampled_rows = impl.sampled_rows
    int32_head = impl.int32_head
    message_custom_metadata = impl.message_custom_metadata
    record_batch = _pyspeedups.record_batch if flag else _c_record_batch
    decode_batch = None if flag else _c_decode_batch
    _using_c = not flag


def schema_address(batch: pa.RecordBatch) -> int | None:
    """The address of ``batch``'s C++ schema (``_arrowbridge.schema_address``), which the
    batches of one stream share, on the compiled path with the bridge loaded; else None."""
    return _bridge.schema_address(batch) if _using_c and _bridge is not None else None


def write_message(batch: pa.RecordBatch, metadata: Any, dest: Any, at: int) -> int | None:
    """The batch's IPC message with ``metadata`` as its custom metadata, then the
    end-of-stream marker, written into the writable buffer ``dest`` from offset ``at`` as
    pyarrow's stream writer writes them (``_arrowbridge.write_message``); the offset where
    they end. None where it was not written (the pure path, no bridge, a message too large
    for ``dest``, metadata that is not a dict of bytes): the caller then writes with pyarrow."""
    if not _using_c or _bridge is None:
        return None
    end: int | None = _bridge.write_message(batch, metadata, dest, at)
    return end


def read_message(data: pa.Buffer, schema: pa.Schema) -> tuple[pa.RecordBatch, Any] | None:
    """The record batch of the one IPC message that fills ``data`` (its buffers slices of
    ``data``), read against ``schema``, and the message's custom metadata as a list of byte
    pairs (``_arrowbridge.read_message``: Arrow's own reader in one call). None on the pure
    path, without the bridge, or for anything but one whole record-batch message: the caller
    then reads with pyarrow, which says what is wrong."""
    if not _using_c or _bridge is None:
        return None
    got: tuple[pa.RecordBatch, Any] | None = _bridge.read_message(data, schema)
    return got


def validate_full(batch: pa.RecordBatch) -> None:
    """``batch.validate(full=True)``, raising what it raises. On the compiled path the bridge
    first tries to prove the batch valid by a stricter check of the same rules
    (``_arrowbridge.proven_valid``, several times cheaper for a small step); pyarrow's own
    validation runs whenever that is not proven, so it alone decides what is refused and how
    the error reads, on both paths."""
    if _using_c and _bridge is not None and _bridge.proven_valid(batch):
        return
    batch.validate(full=True)


def accelerated() -> bool:
    """Whether the compiled path is in use now."""
    return _using_c


set_pure_python(not AVAILABLE or os.environ.get("ARROW_OUTPUTS_PURE_PYTHON", "") not in ("", "0"))
