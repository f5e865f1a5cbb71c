"""Per-request tensors (pooler outputs, prompt token-id logprobs, aux rows) as Arrow columns.

Two layouts, chosen per run and fixed in its schema:

* **fixed shape**: the canonical ``arrow.fixed_shape_tensor`` extension type, when every row
  of a run has one shape (embeddings);
* **variable shape**: ``struct<data: list<T>, shape: fixed_size_list<int32>[ndim]>``, the
  storage layout of Arrow's canonical variable-shape tensor, for rows of differing shapes.

The element type ``T`` is the producer's dtype. Arrow has no bfloat16, so bfloat16 rows are
stored as their uint16 bit patterns; the field metadata key ``arrow_outputs.dtype`` names
the real dtype for every tensor column.

When the rows are consecutive in memory (views of one tensor, the usual case for pooler
outputs) the values buffer is that memory itself: no copy.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import pyarrow as pa

from ._checks import check_dtype, check_monotonic, describe, dtype_name, host_array, row_label
from ._torch import is_tensor, numpy_to_tensor, tensor_dtype_name
from .errors import DTypeError, FieldTypeError, OffsetsError, SchemaMismatchError, ShapeError

__all__ = ["TENSOR_DTYPES", "TensorSpec"]

#: Element types a tensor column may hold, and their Arrow storage types.
TENSOR_DTYPES: dict[str, pa.DataType] = {
    "float32": pa.float32(),
    "float16": pa.float16(),
    "bfloat16": pa.uint16(),  # bit patterns; the field metadata says bfloat16
    "float64": pa.float64(),
    "int8": pa.int8(),
    "uint8": pa.uint8(),
    "int16": pa.int16(),
    "uint16": pa.uint16(),
    "int32": pa.int32(),
    "int64": pa.int64(),
}
_NUMPY_OF = {"bfloat16": np.dtype(np.uint16)}

#: Highest tensor rank a column may declare (numpy's own limit is 64).
MAX_NDIM = 32

DTYPE_KEY = b"arrow_outputs.dtype"
LAYOUT_KEY = b"arrow_outputs.tensor"


@dataclass(frozen=True)
class TensorSpec:
    """What a tensor column holds: element dtype, rank, and the shape when it is fixed.

    Examples
    --------
    >>> TensorSpec("bfloat16", 1, (4096,)).arrow_type()
    FixedShapeTensorType(extension<arrow.fixed_shape_tensor[value_type=uint16, shape=[4096]]>)
    """

    dtype: str = "float32"
    ndim: int = 1
    shape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_dtype(self.dtype, tuple(TENSOR_DTYPES), "TensorSpec.dtype")
        if type(self.ndim) is not int or not 0 <= self.ndim <= MAX_NDIM:
            raise FieldTypeError("TensorSpec.ndim", f"an int within 0..{MAX_NDIM}", repr(self.ndim))
        if self.shape is not None and (
            len(self.shape) != self.ndim or any(type(d) is not int or d < 0 for d in self.shape)
        ):
            raise FieldTypeError(
                "TensorSpec.shape", f"{self.ndim} non-negative ints or None", repr(self.shape)
            )

    def arrow_type(self) -> pa.DataType:
        return _arrow_type(self)

    def field(self, name: str) -> pa.Field:
        layout = b"fixed_shape" if self.shape is not None else b"variable_shape"
        return pa.field(
            name, _arrow_type(self), metadata={DTYPE_KEY: self.dtype.encode(), LAYOUT_KEY: layout}
        )

    @staticmethod
    def from_field(field: pa.Field) -> TensorSpec:
        """Read the spec back from a schema field; refuses fields of another layout."""
        meta = field.metadata or {}
        # Bytes from a file: compared against the table, never decoded or looked up.
        raw = meta.get(DTYPE_KEY, b"")
        dtype = next((name for name in TENSOR_DTYPES if name.encode() == raw), "")
        t = field.type
        spec: TensorSpec | None = None
        if dtype in TENSOR_DTYPES:
            if isinstance(t, pa.FixedShapeTensorType):
                if len(t.shape) <= MAX_NDIM and all(d >= 0 for d in t.shape):
                    spec = TensorSpec(dtype, len(t.shape), tuple(int(d) for d in t.shape))
            elif pa.types.is_struct(t) and t.num_fields == 2:
                shape_t = t.field("shape").type if t.get_field_index("shape") >= 0 else None
                if (
                    shape_t is not None
                    and pa.types.is_fixed_size_list(shape_t)
                    and 0 <= shape_t.list_size <= MAX_NDIM
                ):
                    spec = TensorSpec(dtype, shape_t.list_size, None)
        if spec is None or spec.field(field.name) != field:
            raise SchemaMismatchError(
                field.name, "a tensor column (fixed_shape_tensor or struct<data, shape>)", str(t)
            )
        return spec


@cache
def _arrow_type(spec: TensorSpec) -> pa.DataType:
    value_t = TENSOR_DTYPES[spec.dtype]
    if spec.shape is not None:
        return pa.fixed_shape_tensor(value_t, list(spec.shape))
    return pa.struct(
        [pa.field("data", pa.list_(value_t)), pa.field("shape", pa.list_(pa.int32(), spec.ndim))]
    )


def _row_facts(row: Any, field: Any) -> tuple[int, int, bool, str, tuple[int, ...]]:
    """(address, nbytes, contiguous, dtype name, shape) without copying.

    ``field`` is the row's label, or a zero-argument callable making it (only on error).
    """
    if is_tensor(row):
        if row.device.type != "cpu":
            from .errors import UnsupportedValueError

            raise UnsupportedValueError(
                _text(field), "a host (CPU) tensor", f"a tensor on {row.device}"
            )
        return (
            row.data_ptr(),
            row.numel() * row.element_size(),
            row.is_contiguous(),
            tensor_dtype_name(row),
            tuple(row.shape),
        )
    if isinstance(row, np.ndarray):
        return (
            row.__array_interface__["data"][0],
            row.nbytes,
            row.flags.c_contiguous,
            dtype_name(row.dtype),
            row.shape,
        )
    raise FieldTypeError(_text(field), "a torch tensor, a numpy array or None", describe(row))


def _text(label: Any) -> str:
    return label() if callable(label) else label


def _validity(valid: np.ndarray) -> pa.Buffer | None:
    return None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))


def infer_spec(rows: list[Any], field: str, *, ndim: int, fixed: bool) -> TensorSpec:
    """The spec a run's first step implies (``fixed`` allows the fixed-shape layout)."""
    present = [r for r in rows if r is not None]
    if not present:
        return TensorSpec("float32" if ndim != 3 else "uint16", ndim, None)
    facts = [_row_facts(r, f"{field}[{i}]") for i, r in enumerate(present)]
    dtype, shape = facts[0][3], facts[0][4]
    uniform = all(f[4] == shape for f in facts)
    return TensorSpec(dtype, len(shape), shape if fixed and uniform else None)


def encode_tensor_rows(
    rows: list[Any], spec: TensorSpec, field: str, keys: list[Any] | None = None
) -> tuple[pa.Array, str]:
    """Rows (tensor / array / None) -> one Arrow array of ``spec``'s type, and the rows' kind
    (``"torch"`` or ``"numpy"``) so they come back as they went in."""
    n = len(rows)
    valid = np.fromiter((r is not None for r in rows), dtype=bool, count=n)
    facts: list[tuple[int, int, bool, str, tuple[int, ...]] | None] = []
    kinds = set()
    for i, r in enumerate(rows):
        if r is None:
            facts.append(None)
            continue
        label = functools.partial(row_label, field, i, keys)
        f = _row_facts(r, label)
        kinds.add("torch" if is_tensor(r) else "numpy")
        check_dtype(f[3], tuple(TENSOR_DTYPES), label())
        if f[3] != spec.dtype:
            raise DTypeError(label(), f"{spec.dtype} (the run's tensor dtype)", f[3])
        if len(f[4]) != spec.ndim:
            raise ShapeError(label(), f"a {spec.ndim}-D tensor", f"shape {f[4]}")
        if spec.shape is not None and f[4] != spec.shape:
            raise ShapeError(
                label(), f"shape {spec.shape} (the run's fixed shape)", f"shape {f[4]}"
            )
        facts.append(f)
    if len(kinds) > 1:
        raise FieldTypeError(field, "rows of one kind (all torch or all numpy)", "a mix")
    kind = kinds.pop() if kinds else "torch"
    np_dtype = _numpy_dtype(spec.dtype)
    sizes = np.array([math.prod(f[4]) if f else 0 for f in facts], dtype=np.int64)
    values = _values(rows, facts, np_dtype, spec, sizes, valid, field)
    value_arr = pa.Array.from_buffers(
        TENSOR_DTYPES[spec.dtype], len(values) // np_dtype.itemsize, [None, values]
    )
    if spec.shape is not None:
        storage = pa.Array.from_buffers(
            pa.list_(TENSOR_DTYPES[spec.dtype], math.prod(spec.shape)),
            n,
            [_validity(valid)],
            children=[value_arr],
        )
        return pa.ExtensionArray.from_storage(_arrow_type(spec), storage), kind
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    if offsets[-1] > 2**31 - 1:
        raise OffsetsError(field, "at most 2**31 - 1 tensor elements per step", str(offsets[-1]))
    shapes = np.zeros((n, spec.ndim), dtype=np.int32)
    for i, fact in enumerate(facts):
        if fact is not None:
            shapes[i] = fact[4]
    data = pa.Array.from_buffers(
        pa.list_(TENSOR_DTYPES[spec.dtype]),
        n,
        [None, pa.py_buffer(offsets.astype(np.int32))],
        children=[value_arr],
    )
    shape_arr = pa.Array.from_buffers(
        pa.list_(pa.int32(), spec.ndim),
        n,
        [None],
        children=[pa.array(shapes.reshape(-1), pa.int32())],
    )
    storage_t = _arrow_type(spec)
    return pa.Array.from_buffers(storage_t, n, [_validity(valid)], children=[data, shape_arr]), kind


def _values(
    rows: list[Any],
    facts: list[Any],
    np_dtype: np.dtype,
    spec: TensorSpec,
    sizes: np.ndarray,
    valid: np.ndarray,
    field: str,
) -> pa.Buffer:
    """One buffer of every row's elements: the rows' own memory when it is one span."""
    present = [f for f in facts if f is not None]
    fixed_with_nulls = spec.shape is not None and not valid.all()
    if present and not fixed_with_nulls and all(f[2] for f in present):
        addr, total = present[0][0], 0
        for f in present:
            if f[0] != addr + total:
                break
            total += f[1]
        else:
            # Consecutive rows (views of one tensor): wrap their memory; base keeps it alive.
            return pa.foreign_buffer(addr, total, base=tuple(r for r in rows if r is not None))
    if spec.shape is not None:
        out = np.zeros((len(rows), *spec.shape), dtype=np_dtype)
        for i, r in enumerate(rows):
            if r is not None:
                out[i] = host_array(r, f"{field}[{i}]")[0]
        return pa.py_buffer(out)
    parts = [
        host_array(r, f"{field}[{i}]")[0].reshape(-1) for i, r in enumerate(rows) if r is not None
    ]
    out = np.concatenate(parts) if parts else np.empty(0, dtype=np_dtype)
    return pa.py_buffer(out)


def decode_tensor_rows(arr: pa.Array, spec: TensorSpec, kind: str, field: str) -> list[Any]:
    """Inverse of :func:`encode_tensor_rows`: views over the Arrow buffers (read-only)."""
    n = len(arr)
    np_dtype = _numpy_dtype(spec.dtype)
    if spec.dtype == "bfloat16" and kind != "torch":
        # numpy has no bfloat16: no writer made numpy rows of it, and uint16 would lose it.
        raise SchemaMismatchError(field, "torch rows for a bfloat16 column", f"{kind} rows")
    valid = arr.is_valid().to_numpy(zero_copy_only=False) if arr.null_count else None
    if spec.shape is not None:
        storage = arr.storage if isinstance(arr, pa.ExtensionArray) else arr
        size = math.prod(spec.shape)
        vals = storage.values
        if vals.null_count:
            raise SchemaMismatchError(f"{field}.values", "no null elements", "nulls")
        # FixedSizeListArray.values ignores the list's own slice offset: apply it here.
        start = storage.offset * size + vals.offset
        flat = _view(vals, np_dtype, start, n * size, field)
        base = flat.reshape(n, *spec.shape)
        rows: list[Any] = (
            list(numpy_to_tensor(base, spec.dtype).unbind(0))
            if kind == "torch" and n
            else list(base)
        )
        return rows if valid is None else [r if v else None for r, v in zip(rows, valid)]
    data, shape_arr = arr.field(0), arr.field(1)
    offs = _view(data, np.dtype(np.int32), data.offset, n + 1, f"{field}.data", index=1)
    check_monotonic(offs, f"{field}.data", limit=len(data.values))
    present = np.ones(n, dtype=bool) if valid is None else valid
    for name, part in (("data", data), ("shape", shape_arr)):
        if part.null_count and (present & ~part.is_valid().to_numpy(zero_copy_only=False)).any():
            raise SchemaMismatchError(f"{field}.{name}", "a value in every present row", "a null")
    if shape_arr.values.null_count or data.values.null_count:
        raise SchemaMismatchError(f"{field}", "no null dimensions or elements", "nulls")
    vals = data.values
    flat = _view(vals, np_dtype, vals.offset + int(offs[0]), int(offs[-1] - offs[0]), field)
    shapes = _view(
        shape_arr.values,
        np.dtype(np.int32),
        shape_arr.values.offset + shape_arr.offset * spec.ndim,
        n * spec.ndim,
        field,
    ).reshape(n, spec.ndim)
    whole = numpy_to_tensor(flat, spec.dtype) if kind == "torch" else flat
    out: list[Any] = []
    first = int(offs[0])
    for i in range(n):
        if valid is not None and not valid[i]:
            out.append(None)
            continue
        lo, hi = int(offs[i]) - first, int(offs[i + 1]) - first
        shape = tuple(int(s) for s in shapes[i])
        if min(shape, default=0) < 0 or math.prod(shape) != hi - lo:
            raise ShapeError(f"{field}[{i}]", f"{hi - lo} elements", f"shape {shape}")
        out.append(whole[lo:hi].reshape(shape))
    return out


def _view(
    child: pa.Array, dtype: np.dtype, start: int, count: int, field: str, index: int = 1
) -> np.ndarray:
    """``count`` values of ``child``'s buffer ``index`` from ``start``, bounds checked."""
    buf = child.buffers()[index]
    have = 0 if buf is None else buf.size // dtype.itemsize
    if start < 0 or start + count > have:
        raise OffsetsError(field, f"values within a buffer of {have}", f"{start + count}")
    # Through a memoryview: numpy takes a pyarrow Buffer's memory 3x faster that way.
    return np.frombuffer(memoryview(buf), dtype=dtype, count=start + count)[start:]


def _numpy_dtype(dtype: str) -> np.dtype:
    """numpy's dtype for a tensor dtype name (bfloat16 -> its uint16 bit patterns)."""
    return _NUMPY_OF[dtype] if dtype in _NUMPY_OF else np.dtype(dtype)
