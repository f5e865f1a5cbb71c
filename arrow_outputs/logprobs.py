"""``LogprobsLists`` / ``LogprobsTensors`` <-> Arrow list arrays.

Layout (one list element per request, one struct per generated position)::

    list<struct<token_ids: list<ID>, logprobs: list<float32>, rank: RANK>>

* the outer list offsets are ``cu_num_generated_tokens`` (or ``0..n`` when it is None);
* ``token_ids`` / ``logprobs`` values are the source arrays' own buffers (zero-copy), and
  their offsets are the arithmetic sequence ``0, W, 2W, ...`` (W = max_num_logprobs + 1),
  so a run's schema does not change when W changes from step to step;
* ``rank`` values are the ranks array's own buffer.

ID and RANK are int32 or int64, as the producer made them.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
import pyarrow as pa

from . import _accel
from ._checks import (
    arange_offsets,
    check_dtype,
    check_monotonic,
    check_ndim,
    contiguous,
    describe,
    dtype_name,
    host_array,
    is_arange,
    offsets_from_list,
    row_label,
)
from ._stepmeta import shared_layout
from ._torch import as_tensor, numpy_to_tensor
from .errors import (
    FieldTypeError,
    OffsetsError,
    SchemaMismatchError,
    ShapeError,
)

__all__ = ["logprobs_from_arrow", "logprobs_to_arrow", "logprobs_type"]

INT_TYPES = ("int32", "int64")
_INT_DTYPE_NAMES = {np.dtype(name): name for name in INT_TYPES}
_FLOAT32 = np.dtype(np.float32)
ARROW_INT = {"int32": pa.int32(), "int64": pa.int64()}
INT_NAMES = {t: name for name, t in ARROW_INT.items()}


@cache
def logprobs_type(id_type: str = "int64", rank_type: str = "int64") -> pa.ListType:
    """The Arrow type of a logprobs column for the given token-id and rank dtypes.

    Examples
    --------
    >>> logprobs_type("int32", "int64").value_type
    StructType(struct<token_ids: list<item: int32>, logprobs: list<item: float>, rank: int64>)
    """
    return pa.list_(
        pa.struct(
            [
                pa.field("token_ids", pa.list_(ARROW_INT[id_type])),
                pa.field("logprobs", pa.list_(pa.float32())),
                pa.field("rank", ARROW_INT[rank_type]),
            ]
        )
    )


def _kind_of(x: Any, field: str) -> tuple[str, Any]:
    """("lists", ranks) for LogprobsLists-like, ("tensors", ranks) for LogprobsTensors-like."""
    if not hasattr(x, "logprob_token_ids") or not hasattr(x, "logprobs"):
        raise FieldTypeError(field, "a LogprobsLists or LogprobsTensors", describe(x))
    if hasattr(x, "sampled_token_ranks"):
        return "lists", x.sampled_token_ranks
    if hasattr(x, "selected_token_ranks"):
        return "tensors", x.selected_token_ranks
    raise FieldTypeError(field, "a LogprobsLists or LogprobsTensors", describe(x))


def _matrices(
    x: Any, field: str, id_type: str | None, rank_type: str | None
) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
    """Validated numpy views of (ids, logprobs, ranks); returns the kind too."""
    kind, ranks_in = _kind_of(x, field)
    # getattr: a missing attribute fails here as it did before, in the checks' order.
    ids, lps = getattr(x, "logprob_token_ids", None), getattr(x, "logprobs", None)
    # Fast path for vLLM's host lists (numpy arrays that pass every check below): the same
    # result in a few C-level tests; anything else takes the checks, and their errors.
    if (
        type(ids) is np.ndarray
        and type(lps) is np.ndarray
        and type(ranks_in) is np.ndarray
        and ids.ndim == 2
        and ranks_in.ndim == 1
        and lps.dtype == _FLOAT32
        and lps.shape == ids.shape
        and len(ranks_in) == len(ids)
        and _INT_DTYPE_NAMES.get(ids.dtype, "") == (id_type or _INT_DTYPE_NAMES.get(ids.dtype))
        and _INT_DTYPE_NAMES.get(ranks_in.dtype, "")
        == (rank_type or _INT_DTYPE_NAMES.get(ranks_in.dtype))
    ):
        return kind, ids, lps, ranks_in
    ranks_name = "sampled_token_ranks" if kind == "lists" else "selected_token_ranks"
    ids, ids_dt = host_array(x.logprob_token_ids, f"{field}.logprob_token_ids")
    lps, lps_dt = host_array(x.logprobs, f"{field}.logprobs")
    ranks, ranks_dt = host_array(ranks_in, f"{field}.{ranks_name}")
    check_ndim(ids, 2, f"{field}.logprob_token_ids")
    check_ndim(lps, 2, f"{field}.logprobs")
    check_ndim(ranks, 1, f"{field}.{ranks_name}")
    check_dtype(ids_dt, INT_TYPES, f"{field}.logprob_token_ids")
    check_dtype(lps_dt, ("float32",), f"{field}.logprobs")
    check_dtype(ranks_dt, INT_TYPES, f"{field}.{ranks_name}")
    if lps.shape != ids.shape:
        raise ShapeError(
            f"{field}.logprobs",
            f"shape {tuple(ids.shape)} (the shape of logprob_token_ids)",
            f"shape {tuple(lps.shape)}",
        )
    if len(ranks) != len(ids):
        raise ShapeError(
            f"{field}.{ranks_name}",
            f"{len(ids)} ranks (one per position)",
            f"{len(ranks)}",
        )
    for name, want, got in (
        ("logprob_token_ids", id_type, ids_dt),
        (ranks_name, rank_type, ranks_dt),
    ):
        if want is not None and want != got:
            raise SchemaMismatchError(
                f"{field}.{name}", f"{want} (the run's schema, fixed at its first step)", got
            )
    return kind, ids, lps, ranks


def _buffer(a: np.ndarray) -> pa.Buffer:
    # py_buffer wraps the array's memory and keeps the array alive: no copy.
    return pa.py_buffer(a)


def _positions(
    ids: np.ndarray, lps: np.ndarray, ranks: np.ndarray, inner: np.ndarray, n: int
) -> pa.StructArray:
    """The struct array of ``n`` positions over ``ids``/``lps`` (C-contiguous, read as their
    flat values) with ``inner`` offsets."""
    id_t = ARROW_INT[dtype_name(ids.dtype)]
    off = _buffer(inner)
    tok = pa.Array.from_buffers(
        pa.list_(id_t),
        n,
        [None, off],
        children=[pa.Array.from_buffers(id_t, ids.size, [None, _buffer(ids)])],
    )
    lp = pa.Array.from_buffers(
        pa.list_(pa.float32()),
        n,
        [None, off],
        children=[pa.Array.from_buffers(pa.float32(), lps.size, [None, _buffer(lps)])],
    )
    rank_t = ARROW_INT[dtype_name(ranks.dtype)]
    rank = pa.Array.from_buffers(rank_t, n, [None, _buffer(ranks)])
    # from_buffers skips StructArray.from_arrays' checks: the children were just built right.
    return pa.Array.from_buffers(
        logprobs_type(dtype_name(ids.dtype), dtype_name(ranks.dtype)).value_type,
        n,
        [None],
        children=[tok, lp, rank],
    )


# What the checks of encode_logprobs proved of a host LogprobsLists' arrays, by everything they
# depend on: (ids.dtype, lps.dtype, ranks.dtype, ids.shape, lps.shape, ranks.shape, their
# strides, id_type, rank_type, whether cu_num_generated_tokens is None) -> (positions, the
# inner offsets, the outer offsets or None (from cu, each step), the shared layout). Steps
# repeat shapes.
_HOST_LISTS: dict[tuple[Any, ...], tuple[Any, ...]] = {}


def _host_lists_node(
    x: Any, id_type: str, rank_type: str, num_rows: int | None
) -> tuple[Any, dict[str, Any]] | None:
    """``encode_logprobs(x, as_node=True, ...)`` for what vLLM's host ``LogprobsLists`` holds
    every decode step (C-contiguous numpy arrays of the run's dtypes, offsets None or a
    list), as the same node and layout; None for anything else, before anything is refused:
    the checks then run and raise their precise errors."""
    ids = getattr(x, "logprob_token_ids", None)
    lps = getattr(x, "logprobs", None)
    ranks = getattr(x, "sampled_token_ranks", None)
    if type(ids) is not np.ndarray or type(lps) is not np.ndarray or type(ranks) is not np.ndarray:
        return None
    cu = getattr(x, "cu_num_generated_tokens", False)
    if cu is not None and type(cu) is not list:
        return None
    key = (
        ids.dtype, lps.dtype, ranks.dtype, ids.shape, lps.shape, ranks.shape,
        ids.strides, lps.strides, ranks.strides, id_type, rank_type, cu is None,
    )  # fmt: skip
    known = _HOST_LISTS.get(key)
    if known is None:
        known = _host_lists_layout(x, ids, lps, ranks, id_type, rank_type, cu is None)
        if known is None:
            return None
        if len(_HOST_LISTS) >= 64:
            _HOST_LISTS.clear()
        _HOST_LISTS[key] = known
    num_pos, inner, outer, layout = known
    if outer is None:
        outer = _accel.int_offsets(cu, num_pos)  # int32 offsets as bytes, or None
        if outer is None:
            return None
    n = len(outer) // 4 - 1 if type(outer) is bytes else len(outer) - 1
    if num_rows is not None and n != num_rows:
        return None
    size = ids.size
    struct_node = (
        num_pos,
        0,
        (None,),
        (
            (num_pos, 0, (None, inner), ((size, 0, (None, ids), ()),)),
            (num_pos, 0, (None, inner), ((size, 0, (None, lps), ()),)),
            (num_pos, 0, (None, ranks), ()),
        ),
    )
    return (n, 0, (None, outer), (struct_node,)), layout


def _host_lists_layout(
    x: Any,
    ids: np.ndarray,
    lps: np.ndarray,
    ranks: np.ndarray,
    id_type: str,
    rank_type: str,
    cu_none: bool,
) -> tuple[Any, ...] | None:
    """What ``_host_lists_node`` reuses for arrays of this kind, when ``_matrices``' fast path
    takes them as they are (C-contiguous); else None."""
    try:
        kind, got_ids, got_lps, got_ranks = _matrices(x, "logprobs", id_type, rank_type)
    except Exception:  # the full path raises it again, with its caller's field name
        return None
    same = got_ids is ids and got_lps is lps and got_ranks is ranks  # no conversion
    if (
        kind != "lists"
        or not same
        or not (ids.flags.c_contiguous and lps.flags.c_contiguous and ranks.flags.c_contiguous)
    ):
        return None
    num_pos, width = ids.shape
    inner = arange_offsets(num_pos, width)
    if cu_none:
        return (
            num_pos,
            inner,
            arange_offsets(num_pos),
            shared_layout(kind="lists", cu="none", width=int(width)),
        )
    return num_pos, inner, None, shared_layout(kind="lists", cu="list", width=int(width))


def encode_logprobs(
    x: Any,
    field: str = "logprobs",
    *,
    id_type: str | None = None,
    rank_type: str | None = None,
    num_rows: int | None = None,
    as_node: bool = False,
) -> tuple[Any, dict[str, Any]]:
    """Encode; also return the layout facts the array cannot hold (kind, cu source, width).

    ``as_node``: return the column as a node for the C assembly
    (:func:`arrow_outputs._pyspeedups.record_batch`) instead of an array; only with both
    ``id_type`` and ``rank_type`` given, since a node's type is its field's in the run schema.
    """
    if as_node and id_type is not None and rank_type is not None:
        fast = _host_lists_node(x, id_type, rank_type, num_rows)
        if fast is not None:
            return fast
    kind, ids, lps, ranks = _matrices(x, field, id_type, rank_type)
    num_pos, width = ids.shape
    cu = x.cu_num_generated_tokens
    cu_tensor = getattr(x, "cu_num_generated_tokens_tensor", None)
    # Shared per shape (never changed): the step JSON writer reuses the JSON of its objects.
    if cu is not None:
        outer = offsets_from_list(
            cu, f"{field}.cu_num_generated_tokens", last=num_pos, what="logprob positions"
        )
        layout = shared_layout(kind=kind, cu="list", width=int(width))
    elif cu_tensor is not None:
        cu_np, cu_dt = host_array(cu_tensor, f"{field}.cu_num_generated_tokens_tensor")
        outer = offsets_from_list(
            cu_np.tolist(),
            f"{field}.cu_num_generated_tokens_tensor",
            last=num_pos,
            what="logprob positions",
        )
        layout = shared_layout(kind=kind, cu="tensor", width=int(width), cu_dtype=cu_dt)
    else:
        outer = arange_offsets(num_pos)
        layout = shared_layout(kind=kind, cu="none", width=int(width))
    n = len(outer) - 1
    if num_rows is not None and n != num_rows:
        expected = (
            f"{num_rows} positions (one per request: cu_num_generated_tokens is None)"
            if layout["cu"] == "none"
            else f"{num_rows + 1} offsets (one per request, plus one)"
        )
        got = f"{num_pos} positions" if layout["cu"] == "none" else f"{len(outer)} offsets"
        raise ShapeError(f"{field}.cu_num_generated_tokens", expected, got)
    # C-contiguous [positions, width] matrices are their values' buffers as they are (no
    # reshape: Arrow reads the bytes, and each view would be one more array per step).
    ids, lps = contiguous(ids), contiguous(lps)
    if as_node and id_type is not None and rank_type is not None:
        # The dtypes were checked against the run's types above: the node reads as them.
        inner = arange_offsets(num_pos, width)
        struct_node = (
            num_pos,
            0,
            (None,),
            (
                (num_pos, 0, (None, inner), ((ids.size, 0, (None, ids), ()),)),
                (num_pos, 0, (None, inner), ((lps.size, 0, (None, lps), ()),)),
                (num_pos, 0, (None, contiguous(ranks)), ()),
            ),
        )
        return (n, 0, (None, outer), (struct_node,)), layout
    struct = _positions(ids, lps, contiguous(ranks), arange_offsets(num_pos, width), num_pos)
    arr = pa.Array.from_buffers(pa.list_(struct.type), n, [None, _buffer(outer)], children=[struct])
    return arr, layout


def logprobs_to_arrow(x: Any) -> pa.ListArray:
    """``LogprobsLists`` or ``LogprobsTensors`` (ours or vLLM's) -> an Arrow list array.

    One list element per request: its positions are ``cu_num_generated_tokens[i]`` to
    ``cu_num_generated_tokens[i + 1]`` (one position per request when it is None). The
    token-id, logprob and rank values are the source arrays' buffers, not copies.

    Examples
    --------
    >>> import numpy as np
    >>> from arrow_outputs.outputs import LogprobsLists
    >>> lists = LogprobsLists(
    ...     np.array([[5, 1], [6, 2], [7, 3]], dtype=np.int32),
    ...     np.array([[-0.1, -2.0], [-0.2, -3.0], [-0.3, -4.0]], dtype=np.float32),
    ...     np.array([1, 1, 2]),
    ...     [0, 2, 3],
    ... )
    >>> arr = logprobs_to_arrow(lists)
    >>> len(arr), arr[0][1]["token_ids"].as_py(), arr[1][0]["rank"].as_py()
    (2, [6, 2], 2)
    """
    return encode_logprobs(x)[0]


def _head(a: np.ndarray, k: int = 8) -> str:
    """The first values of an array, for messages."""
    return str(a[:k].tolist())[:-1] + (", ...]" if len(a) > k else "]")


def _check_no_nulls(arr: pa.Array, field: str) -> None:
    if arr.null_count:
        raise SchemaMismatchError(field, "no null entries", f"{arr.null_count} nulls")


def _check_logprobs_type(arr: pa.Array, field: str) -> tuple[str, str]:
    t = arr.type
    try:
        if not (pa.types.is_list(t) and pa.types.is_struct(t.value_type)):
            raise TypeError(str(t))
        st = t.value_type
        tok, lp, rank = st.field("token_ids").type, st.field("logprobs").type, st.field("rank").type
        ids_dt = INT_NAMES.get(tok.value_type, "")
        rank_dt = INT_NAMES.get(rank, "")
        ok = (
            pa.types.is_list(t)
            and len(st) == 3
            and pa.types.is_list(tok)
            and lp == pa.list_(pa.float32())
            and ids_dt in INT_TYPES
            and rank_dt in INT_TYPES
        )
    except (AttributeError, KeyError, NotImplementedError, TypeError):
        ok = False
    if not ok:
        raise SchemaMismatchError(field, str(logprobs_type()).replace("int64", "ID|RANK"), str(t))
    return ids_dt, rank_dt


# Explicit: DataType.to_pandas_dtype() imports pandas, which is not a dependency.
_NUMPY_OF_ARROW = {
    t.id: np.dtype(name)
    for t, name in (
        (pa.int8(), "int8"),
        (pa.uint8(), "uint8"),
        (pa.int16(), "int16"),
        (pa.uint16(), "uint16"),
        (pa.int32(), "int32"),
        (pa.int64(), "int64"),
        (pa.float16(), "float16"),
        (pa.float32(), "float32"),
        (pa.float64(), "float64"),
    )
}


def _flat_values(child: pa.Array) -> np.ndarray:
    """numpy view of a primitive array's values, its slice offset applied (zero-copy)."""
    dtype = _NUMPY_OF_ARROW[child.type.id]
    buf = child.buffers()[1]
    end = child.offset + len(child)
    if buf is None or buf.size < end * dtype.itemsize:
        raise OffsetsError("values", f"a buffer of {end} {dtype} values", "a shorter buffer")
    return np.frombuffer(memoryview(buf), dtype=dtype, count=end)[child.offset :]


def _list_parts(arr: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """(offsets as int64 numpy, unsliced child) of a list array."""
    return list_offsets(arr, np.int32), arr.values


_OFFSET_DTYPES: dict[type, np.dtype] = {np.int32: np.dtype(np.int32), np.int64: np.dtype(np.int64)}


def list_offsets(arr: pa.Array, dtype: type) -> np.ndarray:
    """The ``len(arr) + 1`` offsets of a (sliced) list array, zero-copy."""
    dt = _OFFSET_DTYPES.get(dtype)
    if dt is None:
        dt = np.dtype(dtype)
    buf = arr.buffers()[1]
    need = arr.offset + len(arr) + 1
    have = 0 if buf is None else buf.size // dt.itemsize
    if have < need:
        raise OffsetsError("offsets", f"{need} offsets", f"a buffer of {have}")
    # count=: a buffer need not be a whole number of elements long (Arrow allows padding).
    # Through a memoryview: numpy takes a pyarrow Buffer's memory 3x faster that way.
    offs: np.ndarray = np.frombuffer(memoryview(buf), dtype=dt, count=need)
    return offs[arr.offset : need]


def decode_positions(
    struct: pa.StructArray,
    p0: int,
    p1: int,
    field: str,
    width: int | None,
    validated: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Positions ``p0:p1`` of a logprobs struct array as (ids [P, W], logprobs, ranks).

    ``validated``: the batch passed ``validate(full=True)``, which already proved offsets
    monotonic and in bounds; only what Arrow cannot know (rectangular rows) is checked.
    """
    if not 0 <= p0 <= p1 <= len(struct):
        # Checked even after full validation: Arrow does not bound a 0-length list's offset.
        raise OffsetsError(field, f"positions within 0..{len(struct)}", f"positions {p0}..{p1}")
    tok, lp, rank = struct.field(0), struct.field(1), struct.field(2)
    # Each child fetched once: pyarrow's accessors cost more than the checks on them.
    tok_vals, lp_vals = tok.values, lp.values
    _check_no_nulls(struct, f"{field} positions")
    for child, name in (
        (tok, "token_ids"),
        (lp, "logprobs"),
        (rank, "rank"),
        (tok_vals, "token_ids values"),
        (lp_vals, "logprobs values"),
    ):
        _check_no_nulls(child, f"{field}.{name}")
    tok_off = list_offsets(tok, np.int32)[p0 : p1 + 1]
    # Our writer shares one offsets buffer between the two lists: the same buffer, offset
    # and length need no second read (list_offsets proved it long enough for tok, so for lp).
    tok_buf, lp_buf = tok.buffers()[1], lp.buffers()[1]
    same = (
        lp_buf is not None
        and tok_buf.address == lp_buf.address
        and tok.offset == lp.offset
        and len(tok) == len(lp)
    )
    if not same:
        lp_off = list_offsets(lp, np.int32)[p0 : p1 + 1]
        if not np.array_equal(tok_off, lp_off):
            raise OffsetsError(f"{field}.logprobs", "the offsets of token_ids", "different offsets")
    num = p1 - p0
    if num:
        w = int(tok_off[1] - tok_off[0])
        if not is_arange(tok_off, w):
            raise OffsetsError(
                f"{field}.token_ids",
                f"{w} logprobs at every position (a rectangular matrix)",
                "rows of different widths",
            )
        if width is not None and w != width:
            raise ShapeError(f"{field}.token_ids", f"{width} logprobs per position", str(w))
    else:
        w = width or 0
    if not validated:
        check_monotonic(tok_off, f"{field}.token_ids", limit=min(len(tok_vals), len(lp_vals)))
    lo, hi = int(tok_off[0]), int(tok_off[-1])
    ids = _flat_values(tok_vals)[lo:hi].reshape(num, w)
    lps = _flat_values(lp_vals)[lo:hi].reshape(num, w)
    ranks = _flat_values(rank)[p0:p1]
    return ids, lps, ranks


def decode_logprobs(
    arr: pa.Array, layout: dict[str, Any], field: str = "logprobs", validated: bool = False
) -> Any:
    """Inverse of :func:`encode_logprobs` given its layout facts.

    ``validated``: the array's type was checked against the run schema and its buffers by
    ``validate(full=True)`` (the record-batch path); the standalone path checks here.
    """
    from .outputs import LogprobsLists, LogprobsTensors

    if not validated:
        _check_logprobs_type(arr, field)
    _check_no_nulls(arr, field)
    outer, struct = _list_parts(arr)
    if not validated:
        check_monotonic(outer, field, limit=len(struct))
    p0, p1 = int(outer[0]), int(outer[-1])
    ids, lps, ranks = decode_positions(struct, p0, p1, field, layout.get("width"), validated)
    cu_mode = layout.get("cu", "list")
    if cu_mode == "none":
        if not is_arange(outer):
            raise OffsetsError(
                field,
                "one position per request (cu_num_generated_tokens is None)",
                f"offsets {_head(outer)}",
            )
        cu_list: list[int] = []
    else:
        cu_list = (outer - p0).tolist()
    if layout.get("kind", "lists") == "lists":
        return LogprobsLists(ids, lps, ranks, None if cu_mode == "none" else cu_list)
    t_ids, t_lps, t_ranks = (numpy_to_tensor(a, dtype_name(a.dtype)) for a in (ids, lps, ranks))
    if cu_mode == "tensor":
        cu_tensor = as_tensor(cu_list, layout.get("cu_dtype", "int64"))
        return LogprobsTensors(t_ids, t_lps, t_ranks, None, cu_tensor)
    return LogprobsTensors(t_ids, t_lps, t_ranks, None if cu_mode == "none" else cu_list)


def logprobs_from_arrow(
    arr: pa.Array,
    *,
    as_tensors: bool = False,
    cu_num_generated_tokens: bool = True,
    width: int | None = None,
) -> Any:
    """Arrow list array -> ``LogprobsLists`` (numpy) or ``LogprobsTensors`` (torch).

    The returned arrays are read-only views of the Arrow buffers (zero-copy).

    Parameters
    ----------
    arr
        An array made by :func:`logprobs_to_arrow` (or of the same type).
    as_tensors
        Return ``LogprobsTensors`` (needs torch) instead of ``LogprobsLists``.
    cu_num_generated_tokens
        Give the request offsets as ``cu_num_generated_tokens``; False returns None there,
        which needs exactly one position per request.
    width
        ``max_num_logprobs + 1`` to give a step with no positions (the array cannot hold it).

    Examples
    --------
    >>> import numpy as np
    >>> from arrow_outputs.outputs import LogprobsLists
    >>> src = LogprobsLists(np.zeros((3, 2), np.int64), np.zeros((3, 2), np.float32),
    ...                     np.ones(3, np.int64), [0, 1, 3])
    >>> back = logprobs_from_arrow(logprobs_to_arrow(src))
    >>> back.cu_num_generated_tokens, back.logprob_token_ids.shape
    ([0, 1, 3], (3, 2))
    """
    layout = {
        "kind": "tensors" if as_tensors else "lists",
        "cu": "list" if cu_num_generated_tokens else "none",
        "width": width,
    }
    return decode_logprobs(arr, layout)


def encode_prompt_logprobs(
    entries: list[Any],
    field: str,
    *,
    id_type: str | None = None,
    rank_type: str | None = None,
    keys: list[Any] | None = None,
) -> tuple[pa.ListArray, dict[str, Any]]:
    """One list element per request from per-request ``LogprobsTensors`` (None -> null).

    Requests' widths may differ; their values are concatenated once.
    """
    ids_parts, lps_parts, rank_parts, widths, counts = [], [], [], [], []
    valid = np.zeros(len(entries), dtype=bool)
    empty_widths: dict[str, int] = {}
    for i, entry in enumerate(entries):
        if entry is None:
            counts.append(0)
            continue
        f = row_label(field, i, keys)
        kind, ids, lps, ranks = _matrices(entry, f, id_type, rank_type)
        if kind != "tensors":
            raise FieldTypeError(f, "a LogprobsTensors (torch)", "a LogprobsLists")
        for name in ("cu_num_generated_tokens", "cu_num_generated_tokens_tensor"):
            if getattr(entry, name, None) is not None:
                raise FieldTypeError(
                    f"{f}.{name}",
                    "None (prompt logprobs have one position per prompt token)",
                    describe(getattr(entry, name)),
                )
        id_type, rank_type = dtype_name(ids.dtype), dtype_name(ranks.dtype)
        valid[i] = True
        p, w = ids.shape
        if p == 0:
            empty_widths[str(i)] = int(w)
        ids_parts.append(contiguous(ids).reshape(-1))
        lps_parts.append(contiguous(lps).reshape(-1))
        rank_parts.append(ranks)
        widths.append(np.full(p, w, dtype=np.int64))
        counts.append(p)
    id_type, rank_type = id_type or "int64", rank_type or "int64"
    if ids_parts:
        ids_flat = np.concatenate(ids_parts)
        lps_flat = np.concatenate(lps_parts)
        ranks_flat = np.concatenate(rank_parts)
        inner64 = np.concatenate([[0], np.cumsum(np.concatenate(widths))])
    else:
        ids_flat = np.empty(0, dtype=id_type)
        lps_flat = np.empty(0, dtype=np.float32)
        ranks_flat = np.empty(0, dtype=rank_type)
        inner64 = np.zeros(1, dtype=np.int64)
    if inner64[-1] > 2**31 - 1 or len(inner64) > 2**31 - 1:
        raise OffsetsError(
            field, "at most 2**31 - 1 prompt logprob values per step", str(int(inner64[-1]))
        )
    num_pos = len(inner64) - 1
    struct = _positions(ids_flat, lps_flat, ranks_flat, inner64.astype(np.int32), num_pos)
    outer = np.zeros(len(entries) + 1, dtype=np.int32)
    np.cumsum(counts, out=outer[1:])
    validity = None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))
    arr = pa.Array.from_buffers(
        pa.list_(struct.type),
        len(entries),
        [validity, _buffer(outer)],
        children=[struct],
    )
    return arr, {"empty_widths": empty_widths} if empty_widths else {}


def decode_prompt_logprobs(arr: pa.Array, widths: dict[int, int], field: str) -> list[Any]:
    """Per-row ``LogprobsTensors`` (None for null rows): zero-copy torch views.

    ``widths`` gives the width of rows with no positions (the array cannot hold it); it may
    name only such rows.
    """
    from .outputs import LogprobsTensors

    _check_logprobs_type(arr, field)
    outer, struct = _list_parts(arr)
    check_monotonic(outer, field, limit=len(struct))
    valid = arr.is_valid().to_numpy(zero_copy_only=False) if arr.null_count else None
    for i in widths:
        if (valid is not None and not valid[i]) or outer[i + 1] != outer[i]:
            raise ShapeError(
                f"{field}[{i}]",
                "a present row with no positions (the step metadata gives its width)",
                "a null row" if valid is not None and not valid[i] else "a row with positions",
            )
    out: list[Any] = []
    for i in range(len(arr)):
        if valid is not None and not valid[i]:
            out.append(None)
            continue
        ids, lps, ranks = decode_positions(
            struct, int(outer[i]), int(outer[i + 1]), f"{field}[{i}]", widths.get(i)
        )
        t_ids, t_lps, t_ranks = (numpy_to_tensor(a, dtype_name(a.dtype)) for a in (ids, lps, ranks))
        out.append(LogprobsTensors(t_ids, t_lps, t_ranks))
    return out
