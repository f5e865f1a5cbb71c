"""CSR ``SamplingMaskLists`` <-> nested Arrow lists, zero-copy.

Layout (one list element per request, one inner list per generated position)::

    list<large_list<int32>>

* the inner ``large_list`` offsets buffer *is* the CSR ``offsets`` array (int64), and its
  values buffer *is* ``token_ids`` (int32): no copy of either;
* the outer offsets are ``cu_num_generated_tokens`` (or one position per request when it
  is None).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from . import _accel
from ._checks import (
    INT32_MAX,
    arange_offsets,
    check_dtype,
    check_monotonic,
    check_ndim,
    check_offsets,
    describe,
    host_array,
    is_arange,
    offsets_from_list,
)
from ._stepmeta import shared_layout
from .errors import FieldTypeError, OffsetsError, SchemaMismatchError, ShapeError
from .logprobs import list_offsets

__all__ = ["SAMPLING_MASK_TYPE", "sampling_masks_from_arrow", "sampling_masks_to_arrow"]

SAMPLING_MASK_TYPE = pa.list_(pa.large_list(pa.int32()))


_INT32 = np.dtype(np.int32)
_INT64 = np.dtype(np.int64)
# shared_layout's objects for the four layouts, by (offsets given, cu given).
_MASK_LAYOUTS = {
    (offsets, cu): shared_layout(offsets=offsets, cu=cu)
    for offsets in (False, True)
    for cu in (False, True)
}


def _host_masks_node(m: Any, num_rows: int | None) -> tuple[Any, dict[str, Any]] | None:
    """``encode_sampling_masks(m, as_node=True, ...)`` for what vLLM's host
    ``SamplingMaskLists`` holds (C-contiguous numpy arrays: int32 ids, int64 CSR offsets or
    None; cu a list or None), as the same node and layout; None for anything else, before
    anything is refused: the checks then run and raise their precise errors."""
    token_ids = getattr(m, "token_ids", None)
    offsets = getattr(m, "offsets", False)
    cu = getattr(m, "cu_num_generated_tokens", False)
    if (
        type(token_ids) is not np.ndarray
        or token_ids.dtype != _INT32
        or token_ids.ndim != 1
        or not token_ids.flags.c_contiguous
        or not (cu is None or type(cu) is list)
    ):
        return None
    num_ids = len(token_ids)
    if offsets is None:
        csr = np.array([0, num_ids], dtype=np.int64)  # one position holds every id
    elif (
        type(offsets) is np.ndarray
        and offsets.dtype == _INT64
        and num_ids <= INT32_MAX
        and _accel.offsets_ok(offsets, num_ids)  # 1-D, C-contiguous, 0 .. num_ids, sorted
    ):
        csr = offsets
    else:
        return None
    num_pos = len(csr) - 1
    if cu is None:
        outer: Any = arange_offsets(num_pos)
        n = num_pos
    else:
        outer = _accel.int_offsets(cu, num_pos)  # int32 offsets as bytes, or None
        if outer is None:
            return None
        n = len(outer) // 4 - 1
    if num_rows is not None and n != num_rows:
        return None
    ids_node = (num_ids, 0, (None, token_ids), ())
    node = (n, 0, (None, outer), ((num_pos, 0, (None, csr), (ids_node,)),))
    return node, _MASK_LAYOUTS[offsets is not None, cu is not None]


def encode_sampling_masks(
    m: Any, field: str = "sampling_masks", *, num_rows: int | None = None, as_node: bool = False
) -> tuple[Any, dict[str, Any]]:
    """Encode; also return what the array cannot hold (whether offsets / cu were None).

    ``as_node``: return the column as a node for the C assembly
    (:func:`arrow_outputs._pyspeedups.record_batch`) instead of an array (the column's type
    is fixed: :data:`SAMPLING_MASK_TYPE`).
    """
    if as_node:
        fast = _host_masks_node(m, num_rows)
        if fast is not None:
            return fast
    if not hasattr(m, "token_ids") or not hasattr(m, "offsets"):
        raise FieldTypeError(field, "a SamplingMaskLists", describe(m))
    token_ids, dt = host_array(m.token_ids, f"{field}.token_ids")
    check_ndim(token_ids, 1, f"{field}.token_ids")
    check_dtype(dt, ("int32",), f"{field}.token_ids")
    token_ids = np.ascontiguousarray(token_ids)
    layout = shared_layout(offsets=m.offsets is not None, cu=m.cu_num_generated_tokens is not None)
    if m.offsets is None:
        csr = np.array([0, len(token_ids)], dtype=np.int64)  # one position holds every id
    else:
        csr, odt = host_array(m.offsets, f"{field}.offsets")
        check_ndim(csr, 1, f"{field}.offsets")
        check_dtype(odt, ("int64",), f"{field}.offsets")
        check_offsets(csr, f"{field}.offsets", last=len(token_ids), what="token_ids")
        csr = np.ascontiguousarray(csr)
    num_pos = len(csr) - 1
    if m.cu_num_generated_tokens is None:
        outer = arange_offsets(num_pos)
    else:
        outer = offsets_from_list(
            m.cu_num_generated_tokens,
            f"{field}.cu_num_generated_tokens",
            last=num_pos,
            what="mask positions",
        )
    n = len(outer) - 1
    if num_rows is not None and n != num_rows:
        raise ShapeError(
            field,
            f"masks for {num_rows} requests",
            f"masks for {n} ({num_pos} positions, cu_num_generated_tokens "
            f"{'given' if layout['cu'] else 'None'})",
        )
    if as_node:
        ids_node = (len(token_ids), 0, (None, token_ids), ())
        return (n, 0, (None, outer), ((num_pos, 0, (None, csr), (ids_node,)),)), layout
    inner = pa.Array.from_buffers(
        pa.large_list(pa.int32()),
        num_pos,
        [None, pa.py_buffer(csr)],
        children=[
            pa.Array.from_buffers(pa.int32(), len(token_ids), [None, pa.py_buffer(token_ids)])
        ],
    )
    arr = pa.Array.from_buffers(
        SAMPLING_MASK_TYPE, n, [None, pa.py_buffer(outer)], children=[inner]
    )
    return arr, layout


def sampling_masks_to_arrow(m: Any) -> pa.ListArray:
    """CSR ``SamplingMaskLists`` (ours or vLLM's) -> ``list<large_list<int32>>``.

    Examples
    --------
    >>> import numpy as np
    >>> from arrow_outputs.outputs import SamplingMaskLists
    >>> m = SamplingMaskLists(np.array([3, 9, 4, 5, 7], np.int32),
    ...                       np.array([0, 2, 2, 5], np.int64), [0, 1, 3])
    >>> sampling_masks_to_arrow(m).to_pylist()
    [[[3, 9]], [[], [4, 5, 7]]]
    """
    return encode_sampling_masks(m)[0]


def decode_sampling_masks(arr: pa.Array, layout: dict[str, Any], field: str) -> Any:
    from .outputs import SamplingMaskLists

    if arr.type != SAMPLING_MASK_TYPE:
        raise SchemaMismatchError(field, str(SAMPLING_MASK_TYPE), str(arr.type))
    if arr.null_count:
        raise SchemaMismatchError(field, "no null entries", f"{arr.null_count} nulls")
    outer = list_offsets(arr, np.int32)
    inner_arr = arr.values
    if inner_arr.null_count:
        raise SchemaMismatchError(f"{field} positions", "no nulls", f"{inner_arr.null_count}")
    check_monotonic(outer, field, limit=len(inner_arr))
    p0, p1 = int(outer[0]), int(outer[-1])
    csr = list_offsets(inner_arr, np.int64)[p0 : p1 + 1]
    values = inner_arr.values
    check_monotonic(csr, f"{field}.offsets", limit=len(values))
    if values.null_count:
        raise SchemaMismatchError(f"{field}.token_ids", "no nulls", f"{values.null_count}")
    lo, hi = int(csr[0]), int(csr[-1])
    buf = values.buffers()[1]
    end = values.offset + hi
    if buf is None or buf.size < end * 4:
        raise OffsetsError(f"{field}.token_ids", f"a buffer of {end} int32 values", "a shorter one")
    token_ids = np.frombuffer(memoryview(buf), np.int32, count=end)[values.offset + lo :]
    # Rebase only when the array was sliced: a copy then, since offsets must start at 0.
    offsets = csr if lo == 0 else csr - lo
    if layout.get("cu", True):
        cu = (outer - p0).tolist()
    elif not is_arange(outer - p0):
        raise OffsetsError(
            field,
            "one position per request (cu_num_generated_tokens is None)",
            f"offsets {(outer - p0)[:8].tolist()}",
        )
    else:
        cu = None
    if not layout.get("offsets", True):
        if len(csr) != 2:
            raise ShapeError(
                f"{field}.offsets", "one position (layout says None)", str(len(csr) - 1)
            )
        return SamplingMaskLists(token_ids, None, cu)
    return SamplingMaskLists(token_ids, offsets, cu)


def sampling_masks_from_arrow(
    arr: pa.Array, *, offsets: bool = True, cu_num_generated_tokens: bool = True
) -> Any:
    """``list<large_list<int32>>`` -> ``SamplingMaskLists`` over the Arrow buffers (zero-copy).

    Parameters
    ----------
    offsets
        False returns ``offsets=None`` (needs exactly one position).
    cu_num_generated_tokens
        False returns ``cu_num_generated_tokens=None``.

    Examples
    --------
    >>> import pyarrow as pa
    >>> arr = pa.array([[[3, 9]], [[], [4]]], type=SAMPLING_MASK_TYPE)
    >>> m = sampling_masks_from_arrow(arr)
    >>> m.token_ids.tolist(), m.offsets.tolist(), m.cu_num_generated_tokens
    ([3, 9, 4], [0, 2, 2, 3], [0, 1, 3])
    """
    return decode_sampling_masks(
        arr, {"offsets": offsets, "cu": cu_num_generated_tokens}, "sampling_masks"
    )
