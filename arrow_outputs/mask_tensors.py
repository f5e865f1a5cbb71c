"""Device-side sampling masks (Model Runner V2's ``SamplingMaskTensors``) to CSR and Arrow.

vLLM 0.33's V2 runner keeps each sampled position's support (the token ids the sampler
could have picked) on the device as fixed-size rows; this module re-implements that
structure (``vllm/v1/worker/gpu/sample/output.py``) and converts it to the host without
a Python loop over rows.

Layout of one :class:`SamplingMaskTensors` (``rows = num_reqs * rows_per_request``,
request-major: row ``r`` is slot ``r % rows_per_request`` of request
``r // rows_per_request``)::

    token_ids    int32 [rows, width]              first min(count, width) ids, ascending
    packed_mask  uint8 [rows, ceil(vocab / 8)]    every id of the support, bit order little
    counts       int32 [rows]                     size of the support (0: no position)

``width = min(max_num_kept, vocab_size, MAX_COMPACT_SUPPORT)``. A row with
``count <= width`` is read from ``token_ids``; a wider row (ties at a top-k boundary,
top-p alone, a huge top-k) is read from its ``packed_mask`` row.

Host forms, both built without a Python loop over rows:

* :meth:`SamplingMaskTensors.tolists` -> vLLM's CSR
  :class:`~arrow_outputs.outputs.SamplingMaskLists` (int32 ``token_ids``, int64
  ``offsets``), value for value what vLLM's per-row loop returns;
* :func:`mask_tensors_to_arrow` -> ``list<large_list<int32>>``, the array
  :func:`~arrow_outputs.masks.sampling_masks_to_arrow` makes of those lists.

With the C accelerator built, one call (``_speedups.mask_supports``, specified by
``_pyspeedups.mask_supports``) checks the three host arrays and writes the ids and offsets;
it declines anything irregular, and the vectorised numpy routine (:func:`_supports`, also
the whole implementation without the accelerator) then runs and raises the precise error.

Only this module's torch-facing methods import torch, and only when called.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pyarrow as pa

from . import _accel
from ._checks import arange_offsets, check_dtype, check_ndim, describe, dtype_name, host_array
from ._torch import is_tensor, tensor_dtype_name
from .errors import (
    ConsistencyError,
    DTypeError,
    FieldTypeError,
    ShapeError,
    UnsupportedValueError,
)
from .masks import SAMPLING_MASK_TYPE
from .outputs import SamplingMaskLists

_build_array: Callable[[Any], tuple[Any, int]] | None
try:  # the compiled assembly, where built (the fast path runs only on the compiled path)
    from ._speedups import build_array as _build_array
except ImportError:
    _build_array = None

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_COMPACT_SUPPORT", "SamplingMaskTensors", "mask_tensors_to_arrow"]

MAX_COMPACT_SUPPORT = 2048
"""The widest compact row: bounds the ``[rows, width]`` int32 buffer (vLLM 0.33)."""

_FIELD = "sampling_mask_tensors"
_INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
_LOGIT_DTYPES = ("float16", "bfloat16", "float32", "float64")
_INDEX_DTYPES = ("int32", "int64")
# from_logits works on at most this many logits at a time (a few bytes of scratch each).
_CHUNK_ELEMENTS = 1 << 24
# Compact rows are gathered by a boolean mask over [rows, width] while that mask is at most
# this many times the number of ids it keeps, else by an index array of exactly those ids:
# the mask costs per slot, the index several times more per kept id (measured: the two meet
# at about 1 kept slot in 6-10; width 1024 or 2048 with 50 ids a row takes the index).
_MASK_GATHER_MAX_RATIO = 6


class SamplingMaskTensors(NamedTuple):
    """Sampling masks on the device, in fixed request-major rows (vLLM 0.33, V2 runner).

    Attributes
    ----------
    token_ids : torch.Tensor
        int32 ``[rows, width]``: row ``r``'s first ``min(counts[r], width)`` token ids in
        ascending order; slots past that are unspecified.
    packed_mask : torch.Tensor
        uint8 ``[rows, ceil(vocab_size / 8)]``: bit ``i % 8`` of byte ``i // 8`` (bit order
        little) is set when token ``i`` is in row ``r``'s support. Read only for rows with
        ``counts[r] > width``.
    counts : torch.Tensor
        int32 ``[rows]``: the size of each row's support; 0 for a slot that was not sampled.
    vocab_size : int
        Number of logits per row.
    rows_per_request : int
        Slots per request (``num_speculative_steps + 1`` under speculative decoding, else 1);
        ``rows = num_reqs * rows_per_request``.

    Examples
    --------
    >>> import torch
    >>> logits = torch.tensor([[0.5, -float("inf"), 2.0, 1.0]])
    >>> m = SamplingMaskTensors.from_logits(
    ...     logits, torch.tensor([0, 1]), torch.tensor([1]), max_num_kept=2)
    >>> m.counts.tolist(), m.token_ids.tolist(), m.packed_mask.tolist()
    ([3], [[0, 2]], [[13]])
    >>> m.tolists().token_ids.tolist()  # 3 ids > width 2: read from the bitmask
    [0, 2, 3]
    """

    token_ids: torch.Tensor
    packed_mask: torch.Tensor
    counts: torch.Tensor
    vocab_size: int
    rows_per_request: int = 1

    @classmethod
    def from_logits(
        cls,
        logits: torch.Tensor,
        cu_num_logits: torch.Tensor,
        num_sampled_tokens: torch.Tensor,
        max_num_kept: int,
        rows_per_request: int = 1,
        *,
        validate: bool = True,
    ) -> SamplingMaskTensors:
        """Capture each sampled position's support from the processed logits (plain torch).

        The same output as vLLM's Triton kernel ``_compact_sampling_mask_kernel``, in
        plain torch on any device. Output row ``r`` is slot ``s = r % rows_per_request`` of
        request ``q = r // rows_per_request``. When ``s < num_sampled_tokens[q]`` it is read
        from logits row ``cu_num_logits[q] + s``: its support is the ascending set of ids
        whose logit is finite (``-inf`` from top-k / top-p / min-p filtering, ``+inf`` and
        NaN are all excluded); otherwise the row is empty (``counts[r] == 0``).

        Parameters
        ----------
        logits : torch.Tensor
            ``[num_logits, vocab_size]`` processed logits (float16, bfloat16, float32 or
            float64), after the sampler set the filtered ones to ``-inf``.
        cu_num_logits : torch.Tensor
            ``[num_reqs + 1]`` (or ``[num_reqs]``) int32/int64 first logits row of each
            request, on ``logits``' device; only the first ``num_reqs`` are read.
        num_sampled_tokens : torch.Tensor
            ``[num_reqs]`` int32/int64 positions sampled per request, on ``logits``' device.
        max_num_kept : int
            The batch's largest top-k (vLLM passes ``vocab_size`` for "no top-k"); the
            compact width is ``min(max_num_kept, vocab_size, MAX_COMPACT_SUPPORT)``.
        rows_per_request : int, default 1
            Fixed slots per request.
        validate : bool, default True
            Check that every sampled slot's logits row exists. On a GPU this waits for the
            device once; with False nothing waits, and a slot whose row is out of range reads
            an unspecified row instead (the Triton kernel reads out of bounds).

        Returns
        -------
        SamplingMaskTensors
            On ``logits``' device. Slots of ``token_ids`` past a row's count hold
            ``vocab_size`` here (unspecified in vLLM, whose buffer is uninitialised), and
            empty rows have an all-zero ``packed_mask`` row.

        Raises
        ------
        DTypeError, ShapeError, FieldTypeError
            Inputs of the wrong dtype, rank, length or kind (the message names which).
        ConsistencyError
            An index tensor on another device than ``logits``, or (``validate``) a sampled
            slot whose logits row ``cu_num_logits[q] + s`` is outside ``logits``.

        Examples
        --------
        Two speculative slots per request; request 1 sampled one position, so its second
        slot is empty:

        >>> import torch
        >>> inf = float("inf")
        >>> logits = torch.tensor([[0.0, -inf, 1.0], [-inf, 2.0, -inf], [3.0, 3.0, -inf]])
        >>> m = SamplingMaskTensors.from_logits(
        ...     logits, torch.tensor([0, 2, 3]), torch.tensor([2, 1]), 3, rows_per_request=2)
        >>> m.counts.tolist()
        [2, 1, 2, 0]
        >>> m.tolists([2, 1]).cu_num_generated_tokens
        [0, 2, 3]
        """
        import torch

        if not is_tensor(logits):
            raise FieldTypeError("logits", "a torch tensor", describe(logits))
        if logits.ndim != 2:
            raise ShapeError("logits", "a 2-D [num_logits, vocab_size] tensor", _shape(logits))
        check_dtype(tensor_dtype_name(logits), _LOGIT_DTYPES, "logits")
        device = logits.device
        ns = _index_tensor(num_sampled_tokens, "num_sampled_tokens", device)
        cu = _index_tensor(cu_num_logits, "cu_num_logits", device)
        num_reqs = ns.shape[0]
        if cu.shape[0] not in (num_reqs, num_reqs + 1):
            raise ShapeError(
                "cu_num_logits",
                f"{num_reqs + 1} offsets (num_sampled_tokens has {num_reqs} requests)",
                f"{cu.shape[0]}",
            )
        rpr = _positive_int(rows_per_request, "rows_per_request")
        kept = _index_int(max_num_kept, "max_num_kept")
        num_logits, vocab_size = logits.shape
        width = min(kept, vocab_size, MAX_COMPACT_SUPPORT)
        rows = num_reqs * rpr

        # Row r of the output is slot s of request q; it reads logits row cu[q] + s.
        slot = torch.arange(rpr, device=device).repeat(num_reqs)
        req = torch.arange(num_reqs, device=device).repeat_interleave(rpr)
        active = slot < ns.to(torch.int64)[req]
        source = cu[:num_reqs].to(torch.int64)[req] + slot
        if validate:
            bad = active & ((source < 0) | (source >= num_logits))
            if bool(bad.any()):
                r = int(bad.nonzero()[0, 0])
                raise ConsistencyError(
                    "cu_num_logits",
                    f"rows within the {num_logits} rows of logits for every sampled slot",
                    f"row {int(source[r])} for slot {r % rpr} of request {r // rpr}",
                )
        # Unsampled slots read row 0 and are masked out; never index past logits.
        source = torch.where(active, source, 0).clamp_(0, max(num_logits - 1, 0))

        token_ids = torch.empty((rows, width), dtype=torch.int32, device=device)
        num_bytes = (vocab_size + 7) // 8
        packed_mask = torch.zeros((rows, num_bytes), dtype=torch.uint8, device=device)
        counts = torch.zeros(rows, dtype=torch.int32, device=device)
        if num_logits == 0 or vocab_size == 0:
            token_ids.fill_(vocab_size)
            return cls(token_ids, packed_mask, counts, vocab_size, rpr)

        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)
        step = max(1, _CHUNK_ELEMENTS // vocab_size)
        for lo in range(0, rows, step):
            hi = min(lo + step, rows)
            keep = torch.isfinite(logits.index_select(0, source[lo:hi]))
            keep &= active[lo:hi, None]
            # Running count per row: the j-th kept id is where it first reaches j + 1.
            running = keep.cumsum(1, dtype=torch.int32)
            counts[lo:hi] = running[:, -1]
            if width:
                targets = torch.arange(1, width + 1, dtype=torch.int32, device=device)
                token_ids[lo:hi] = torch.searchsorted(
                    running, targets.expand(hi - lo, width).contiguous(), out_int32=True
                )
            bits = torch.zeros((hi - lo, num_bytes * 8), dtype=torch.uint8, device=device)
            bits[:, :vocab_size] = keep
            packed_mask[lo:hi] = (bits.view(hi - lo, num_bytes, 8) * weights).sum(
                -1, dtype=torch.uint8
            )
        return cls(token_ids, packed_mask, counts, vocab_size, rpr)

    @classmethod
    def cat(cls, chunks: Sequence[SamplingMaskTensors]) -> SamplingMaskTensors:
        """Join request-contiguous chunks that share one layout (``torch.cat`` of each field).

        Parameters
        ----------
        chunks : sequence of SamplingMaskTensors
            In request order; same ``vocab_size``, ``rows_per_request`` and width.

        Returns
        -------
        SamplingMaskTensors
            The rows of every chunk, in order (a new tensor per field, even for one chunk).

        Raises
        ------
        ShapeError
            No chunks, or chunks of different compact widths.
        ConsistencyError
            Chunks with different ``vocab_size`` or ``rows_per_request``.

        Examples
        --------
        >>> import torch
        >>> a = SamplingMaskTensors.from_logits(torch.zeros(1, 3), torch.tensor([0, 1]),
        ...                                     torch.tensor([1]), 3)
        >>> SamplingMaskTensors.cat([a, a]).counts.tolist()
        [3, 3]
        """
        import torch

        if len(chunks) == 0:
            raise ShapeError("chunks", "at least one SamplingMaskTensors", "an empty sequence")
        first = chunks[0]
        for i, chunk in enumerate(chunks):
            for name in ("vocab_size", "rows_per_request"):
                if getattr(chunk, name) != getattr(first, name):
                    raise ConsistencyError(
                        f"chunks[{i}].{name}",
                        f"{getattr(first, name)} like chunks[0]",
                        f"{getattr(chunk, name)}",
                    )
            if tuple(chunk.token_ids.shape[1:]) != tuple(first.token_ids.shape[1:]):
                raise ShapeError(
                    f"chunks[{i}].token_ids",
                    f"the compact width of chunks[0], {tuple(first.token_ids.shape[1:])}",
                    _shape(chunk.token_ids),
                )
        return cls(
            torch.cat([chunk.token_ids for chunk in chunks]),
            torch.cat([chunk.packed_mask for chunk in chunks]),
            torch.cat([chunk.counts for chunk in chunks]),
            first.vocab_size,
            first.rows_per_request,
        )

    def to_cpu_nonblocking(self) -> SamplingMaskTensors:
        """Start the device-to-host copy on the current stream (vLLM's semantics).

        Returns
        -------
        SamplingMaskTensors
            ``self`` when ``token_ids`` is already on the CPU; otherwise host tensors that
            are valid once the copying stream has been synchronised.

        Examples
        --------
        >>> import torch
        >>> m = SamplingMaskTensors.from_logits(torch.zeros(1, 3), torch.tensor([0, 1]),
        ...                                     torch.tensor([1]), 3)
        >>> m.to_cpu_nonblocking() is m
        True
        """
        if self.token_ids.device.type == "cpu":
            return self
        return SamplingMaskTensors(
            self.token_ids.to("cpu", non_blocking=True),
            self.packed_mask.to("cpu", non_blocking=True),
            self.counts.to("cpu", non_blocking=True),
            self.vocab_size,
            self.rows_per_request,
        )

    def tolists(self, num_sampled_tokens: Any = None) -> SamplingMaskLists:
        """The scheduler's CSR form: exactly what vLLM's ``tolists`` returns, without its loop.

        Device tensors are copied to the host first (``.cpu()``, as vLLM does; it waits).

        Parameters
        ----------
        num_sampled_tokens : numpy.ndarray, torch.Tensor or list of int, optional
            ``[num_reqs]`` positions sampled per request. Required when
            ``rows_per_request > 1``; with one row per request only its length is checked.

        Returns
        -------
        SamplingMaskLists
            int32 ``token_ids`` and int64 ``offsets`` with one CSR position per kept row.
            One row per request: every row is kept (a request that sampled nothing has an
            empty position) and ``cu_num_generated_tokens`` is None. Several: the first
            ``num_sampled_tokens[q]`` rows of request ``q`` are kept and
            ``cu_num_generated_tokens`` is the running sum of ``num_sampled_tokens`` from 0,
            as a Python list.

        Raises
        ------
        DTypeError, ShapeError, FieldTypeError, ConsistencyError
            See :func:`mask_tensors_to_arrow`.

        Examples
        --------
        >>> import torch
        >>> m = SamplingMaskTensors(
        ...     token_ids=torch.tensor([[3, 5], [0, 0], [1, 2]], dtype=torch.int32),
        ...     packed_mask=torch.zeros((3, 1), dtype=torch.uint8),
        ...     counts=torch.tensor([2, 0, 1], dtype=torch.int32), vocab_size=8)
        >>> lists = m.tolists()
        >>> lists.token_ids.tolist(), lists.offsets.tolist(), lists.cu_num_generated_tokens
        ([3, 5, 1], [0, 2, 2, 3], None)
        """
        got = _c_supports(self, num_sampled_tokens) if _accel.accelerated() else None
        if got is not None:
            ids, offs, cu_bytes = got
            return SamplingMaskLists(
                np.frombuffer(ids, np.int32),
                np.frombuffer(offs, np.int64),
                None if cu_bytes is None else np.frombuffer(cu_bytes, np.int32).tolist(),
            )
        flat, offsets, cu = _supports(self, num_sampled_tokens, host_copy=True)
        return SamplingMaskLists(flat, offsets, None if cu is None else cu.tolist())


def mask_tensors_to_arrow(masks: Any, num_sampled_tokens: Any = None) -> pa.ListArray:
    """Sampling-mask tensors on the host -> ``list<large_list<int32>>``, vectorised.

    The same array as
    ``sampling_masks_to_arrow(masks.tolists(num_sampled_tokens))`` (type, values and
    offsets), without the per-row loop or the intermediate lists: one list per request,
    one inner list per kept row, the token ids ascending. The ids and offsets are built
    once and the Arrow array is made over them without a further copy. Compact ids are
    taken as they are, as vLLM takes them (their order and range are not checked).

    Parameters
    ----------
    masks : SamplingMaskTensors
        Ours or vLLM's (read by attribute name). Host tensors or numpy arrays: call
        ``to_cpu_nonblocking()`` and synchronise first (a device tensor is refused rather
        than copied here, which would stall the caller).
    num_sampled_tokens : numpy.ndarray, torch.Tensor or list of int, optional
        As for :meth:`SamplingMaskTensors.tolists`.

    Returns
    -------
    pyarrow.ListArray
        ``num_reqs`` entries of type :data:`arrow_outputs.masks.SAMPLING_MASK_TYPE`.

    Raises
    ------
    FieldTypeError
        ``masks`` lacks the fields, a field is not an array, or a count is not an int.
    DTypeError
        ``token_ids`` / ``counts`` not int32, ``packed_mask`` not uint8,
        ``num_sampled_tokens`` not integers.
    ShapeError
        Ranks or lengths that disagree (``rows`` vs ``rows_per_request``,
        ``packed_mask``'s width vs ``vocab_size``, ``num_sampled_tokens``' length).
    ConsistencyError
        ``num_sampled_tokens`` outside ``0..rows_per_request`` (several rows per request),
        a negative count, or a count past the compact width whose ``packed_mask`` row does
        not hold exactly that many ids (bits past ``vocab_size`` are ignored, as in vLLM).
    UnsupportedValueError
        A tensor on a device.

    Examples
    --------
    >>> import numpy as np
    >>> m = SamplingMaskTensors(
    ...     token_ids=np.array([[3, 5], [7, 0], [0, 0], [0, 0]], np.int32),
    ...     packed_mask=np.array([[0], [0], [0b111], [0]], np.uint8),
    ...     counts=np.array([2, 1, 3, 0], np.int32), vocab_size=8, rows_per_request=2)
    >>> mask_tensors_to_arrow(m, np.array([2, 1])).to_pylist()
    [[[3, 5], [7]], [[0, 1, 2]]]
    """
    got = _c_supports(masks, num_sampled_tokens) if _accel.accelerated() else None
    if got is not None:
        return _arrow_of_c(*got)
    flat, offsets, cu = _supports(masks, num_sampled_tokens, host_copy=False)
    return _arrow_of(flat, offsets, cu)


def mask_array_supports(
    token_ids: np.ndarray,
    packed_mask: np.ndarray,
    counts: np.ndarray,
    vocab_size: int,
    rows_per_request: int = 1,
    num_sampled_tokens: Any = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The buffers of :func:`mask_tensors_to_arrow`'s array, from the three fields as host
    numpy arrays (as ``AsyncArrowOutput`` holds them once staged), with the same checks.

    Returns
    -------
    tuple of numpy.ndarray
        int32 ids, int64 inner (CSR) offsets, int32 outer offsets (read-only when cached).
    """
    # Only numpy arrays go to the C walk: it reads any buffer, the checks below refuse others.
    if (
        _accel.accelerated()
        and type(token_ids) is np.ndarray
        and type(packed_mask) is np.ndarray
        and type(counts) is np.ndarray
    ):
        got = _accel.mask_supports(
            token_ids,
            packed_mask,
            counts,
            vocab_size,
            rows_per_request,
            _host_ints(num_sampled_tokens),
        )
        if got is not None:
            ids, offs, cu_bytes = got
            num_pos = len(offs) // 8 - 1
            return (
                np.frombuffer(ids, np.int32),
                np.frombuffer(offs, np.int64),
                _arange_offsets(num_pos) if cu_bytes is None else np.frombuffer(cu_bytes, np.int32),
            )
    arrays = (token_ids, packed_mask, counts)
    for name, a, dtype, ndim in zip(_PARTS, arrays, ("int32", "uint8", "int32"), (2, 2, 1)):
        if type(a) is not np.ndarray:
            raise FieldTypeError(f"{_FIELD}.{name}", "a numpy array", describe(a))
        check_dtype(dtype_name(a.dtype), (dtype,), f"{_FIELD}.{name}")
        check_ndim(a, ndim, f"{_FIELD}.{name}")
    vocab = _index_int(vocab_size, f"{_FIELD}.vocab_size")
    rpr = _positive_int(rows_per_request, f"{_FIELD}.rows_per_request")
    flat, offsets, cu = _supports_of(
        token_ids, packed_mask, counts, vocab, rpr, num_sampled_tokens, host_copy=False
    )
    return flat, offsets, _outer_offsets(len(offsets) - 1, cu)


_PARTS = ("token_ids", "packed_mask", "counts")
_INNER_TYPE = SAMPLING_MASK_TYPE.value_type
_ID_TYPE = _INNER_TYPE.value_type


@lru_cache(maxsize=64)
def _arange_offsets(n: int) -> np.ndarray:
    """One position per request: ``[0, 1, ..., n]`` int32 (steps repeat sizes: cached)."""
    return arange_offsets(n)


def _outer_offsets(num_pos: int, cu: np.ndarray | None) -> np.ndarray:
    return _arange_offsets(num_pos) if cu is None else cu.astype(np.int32)


def _arrow_of_c(ids: bytearray, offsets: bytearray, cu: bytearray | None) -> pa.ListArray:
    """:func:`_arrow_of` over the C walk's buffers (taken as they are, no copy).

    One Arrow C Data Interface import of the three nodes (``_speedups.build_array``, the
    record-batch codec's assembly) costs about half of three ``Array.from_buffers`` calls;
    ``validate`` then makes the checks ``from_buffers`` makes.
    """
    num_pos = len(offsets) // 8 - 1
    num_reqs = num_pos if cu is None else len(cu) // 4 - 1
    outer: Any = _arange_offsets(num_pos) if cu is None else cu
    if _build_array is not None:
        node = (
            num_reqs,
            0,
            (None, outer),
            ((num_pos, 0, (None, offsets), ((len(ids) // 4, 0, (None, ids), ()),)),),
        )
        capsule, address = _build_array(node)
        arr = pa.Array._import_from_c(address, SAMPLING_MASK_TYPE)
        del capsule  # moved into the array by the import
        arr.validate()
        return arr
    values = pa.Array.from_buffers(_ID_TYPE, len(ids) // 4, [None, pa.py_buffer(ids)])
    inner = pa.Array.from_buffers(
        _INNER_TYPE, num_pos, [None, pa.py_buffer(offsets)], children=[values]
    )
    return pa.Array.from_buffers(
        SAMPLING_MASK_TYPE, num_reqs, [None, pa.py_buffer(outer)], children=[inner]
    )


def _arrow_of(flat: np.ndarray, offsets: np.ndarray, cu: np.ndarray | None) -> pa.ListArray:
    """``list<large_list<int32>>`` over the supports' buffers (no copy of ids or offsets)."""
    num_pos = len(offsets) - 1
    outer = _outer_offsets(num_pos, cu)
    inner = pa.Array.from_buffers(
        _INNER_TYPE,
        num_pos,
        [None, pa.py_buffer(offsets)],
        children=[pa.Array.from_buffers(_ID_TYPE, len(flat), [None, pa.py_buffer(flat)])],
    )
    return pa.Array.from_buffers(
        SAMPLING_MASK_TYPE, len(outer) - 1, [None, pa.py_buffer(outer)], children=[inner]
    )


# ----------------------------------------------------------------------------- host side


def _c_supports(masks: Any, num_sampled_tokens: Any) -> tuple[Any, Any, Any] | None:
    """The C walk over a mask's host fields (``_speedups.mask_supports``): its bytearrays, or
    None where it does not apply. The walk checks every type, shape and count itself and
    declines anything irregular; the numpy path then runs, and raises the precise error, so
    errors never depend on which path ran. Here only the cheap conversions: host tensors
    viewed as numpy (no copy); anything else (device tensors, lists) goes the numpy way."""
    try:
        tok, bits, counts = masks.token_ids, masks.packed_mask, masks.counts
        vocab_size = masks.vocab_size
    except AttributeError:
        return None
    tok, bits, counts = _host_view(tok), _host_view(bits), _host_view(counts)
    if tok is None or bits is None or counts is None:
        return None
    rpr = getattr(masks, "rows_per_request", 1)
    return _accel.mask_supports(tok, bits, counts, vocab_size, rpr, _host_ints(num_sampled_tokens))


_NO_COUNTS = np.zeros(0, np.int64)  # an empty list of counts, as numpy
_NO_COUNTS.flags.writeable = False


def _host_view(x: Any) -> np.ndarray | None:
    """A numpy array as it is, a host tensor's numpy view; None for anything else."""
    if type(x) is np.ndarray:
        return x
    if is_tensor(x) and x.is_cpu:
        try:
            return x.numpy()  # shares the memory (integer tensors: no bits to reinterpret)
        except (TypeError, RuntimeError):  # a dtype numpy lacks, a tensor needing grad
            return None
    return None


def _host_ints(x: Any) -> Any:
    """``num_sampled_tokens`` for the C walk: None, a numpy array, a host tensor's view, a
    list as numpy. Anything else becomes an object the walk declines, so that the numpy path
    accepts or refuses it (it takes numpy arrays and tensors only)."""
    if x is None or isinstance(x, np.ndarray):
        return x
    if isinstance(x, (list, tuple)):
        return np.asarray(x) if len(x) else _NO_COUNTS
    view = _host_view(x)
    return _DECLINED if view is None else view


_DECLINED = object()  # no buffer protocol: the C walk declines it


def _supports(
    masks: Any, num_sampled_tokens: Any, *, host_copy: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The kept rows' supports: int32 ids, int64 CSR offsets, int64 request offsets or None.

    Every step is a whole-array numpy operation; the number of numpy calls does not depend
    on the number of rows.
    """
    for name in ("token_ids", "packed_mask", "counts", "vocab_size"):
        if not hasattr(masks, name):
            raise FieldTypeError(_FIELD, "a SamplingMaskTensors", describe(masks))
    token_ids = _host(masks.token_ids, f"{_FIELD}.token_ids", "int32", 2, host_copy)
    packed = _host(masks.packed_mask, f"{_FIELD}.packed_mask", "uint8", 2, host_copy)
    counts = _host(masks.counts, f"{_FIELD}.counts", "int32", 1, host_copy)
    vocab_size = _index_int(masks.vocab_size, f"{_FIELD}.vocab_size")
    rpr = _positive_int(getattr(masks, "rows_per_request", 1), f"{_FIELD}.rows_per_request")
    return _supports_of(
        token_ids, packed, counts, vocab_size, rpr, num_sampled_tokens, host_copy=host_copy
    )


def _supports_of(
    token_ids: np.ndarray,
    packed: np.ndarray,
    counts: np.ndarray,
    vocab_size: int,
    rpr: int,
    num_sampled_tokens: Any,
    *,
    host_copy: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """:func:`_supports` over host arrays whose dtypes and ranks are checked."""
    rows, width = token_ids.shape
    if len(counts) != rows or packed.shape != (rows, (vocab_size + 7) // 8):
        raise ShapeError(
            _FIELD,
            f"counts [{rows}] and packed_mask [{rows}, {(vocab_size + 7) // 8}] for "
            f"token_ids [{rows}, {width}] and vocab_size {vocab_size}",
            f"counts {_shape(counts)}, packed_mask {_shape(packed)}",
        )
    if rows % rpr:
        raise ShapeError(
            f"{_FIELD}.counts",
            f"a multiple of rows_per_request {rpr} rows",
            f"{rows} rows",
        )
    num_reqs = rows // rpr
    ns = _num_sampled(num_sampled_tokens, num_reqs, rpr, host_copy)

    # lens: the support size of each row that becomes a CSR position, 0 for dropped slots.
    active: np.ndarray | None = None
    cu: np.ndarray | None = None
    if ns is None:
        lens = np.ascontiguousarray(counts)
    else:
        active = (_ramp(rpr, np.int64) < ns[:, None]).ravel()
        lens = np.where(active, counts, 0).astype(np.int32, copy=False)
        cu = np.zeros(num_reqs + 1, dtype=np.int64)
        np.add.accumulate(ns, dtype=np.int64, out=cu[1:])
    all_offsets = np.empty(rows + 1, dtype=np.int64)
    all_offsets[0] = 0
    np.add.accumulate(lens, dtype=np.int64, out=all_offsets[1:])
    if active is None:
        offsets = all_offsets
    else:
        # Positions are the active rows; dropped rows have length 0, so the offsets at the
        # active rows' ends are the CSR offsets.
        offsets = np.concatenate((all_offsets[:1], all_offsets[1:][active]))

    # Seen as unsigned, a negative count is huge: one reduction finds the rows that need a
    # second look (wider than the compact row, or negative).
    if not rows or int(np.maximum.reduce(lens.view(np.uint32))) <= width:
        return _gather_prefixes(token_ids, lens, all_offsets), offsets, cu

    wide = lens.view(np.uint32) > width
    wide_rows = np.flatnonzero(wide)
    if lens.min() < 0:
        r = int(np.argmax(lens < 0))
        raise ConsistencyError(f"{_FIELD}.counts[{r}]", "a count >= 0", str(int(lens[r])))
    compact_lens = lens.copy()
    compact_lens[wide_rows] = 0
    compact_offsets = np.empty(rows + 1, dtype=np.int64)
    compact_offsets[0] = 0
    np.add.accumulate(compact_lens, dtype=np.int64, out=compact_offsets[1:])
    compact_ids = _gather_prefixes(token_ids, compact_lens, compact_offsets)
    wide_ids = _unpack_rows(packed, wide_rows, lens[wide_rows], vocab_size)
    # Merge in row order: mark which output slots belong to wide rows.
    flat = np.empty(int(all_offsets[-1]), dtype=np.int32)
    from_wide = np.repeat(wide, lens)
    flat[from_wide] = wide_ids
    flat[~from_wide] = compact_ids
    return flat, offsets, cu


def _gather_prefixes(token_ids: np.ndarray, lens: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Row r's first ``lens[r]`` entries of ``token_ids``, all rows concatenated (int32).

    Every ``lens[r]`` is within ``0..width``.
    """
    rows, width = token_ids.shape
    total = int(offsets[-1])
    if rows * width <= _MASK_GATHER_MAX_RATIO * total:
        # Dense rows: a boolean mask over the counts (row r: lens[r] Trues, then Falses),
        # one masked gather.
        if width <= MAX_COMPACT_SUPPORT:
            mask = _prefix_masks(width).take(lens, axis=0)
        else:
            mask = _ramp(width, np.int32) < lens[:, None]
        return token_ids[mask]
    # Sparse rows: the flat index of every kept slot (row start + rank), one take.
    tok = np.ascontiguousarray(token_ids).reshape(-1)
    delta = _ramp(rows, np.int64) * width - offsets[:-1]
    index = np.repeat(delta, lens)
    index += _ramp(total, np.int64)
    return tok.take(index)


@lru_cache(maxsize=4)
def _prefix_masks(width: int) -> np.ndarray:
    """``[width + 1, width]`` bool: row k is k Trues, then Falses. Taking rows of this table
    by count is several times faster than comparing a ramp with every count."""
    table = _ramp(width, np.int32)[None, :] < _ramp(width + 1, np.int32)[:, None]
    table.flags.writeable = False
    return table


def _unpack_rows(
    packed: np.ndarray, rows: np.ndarray, expected: np.ndarray, vocab_size: int
) -> np.ndarray:
    """The set bits of ``packed[rows]`` (the first ``vocab_size`` of each), rows concatenated.

    Raises ConsistencyError for a row whose number of set bits is not ``expected``.
    """
    bits = np.unpackbits(packed[rows], axis=1, count=vocab_size, bitorder="little")
    # numpy's nonzero is about twice as fast on bool as on uint8: same bytes, 0 or 1.
    hits = np.flatnonzero(bits.view(np.bool_))
    starts = _ramp(len(rows) + 1, np.int64) * vocab_size
    found = np.diff(np.searchsorted(hits, starts))
    if not np.array_equal(found, expected):
        i = int(np.argmax(found != expected))
        r = int(rows[i])
        raise ConsistencyError(
            f"{_FIELD}.packed_mask[{r}]",
            f"{int(expected[i])} set bits (counts[{r}] is past the compact width, so the "
            "bitmask holds the support)",
            f"{int(found[i])}",
        )
    hits -= np.repeat(starts[:-1], found)
    return hits.astype(np.int32)


# ----------------------------------------------------------------------------- helpers

_RAMPS: dict[type, np.ndarray] = {}
_RAMPS_LOCK = threading.Lock()


def _ramp(n: int, dtype: type) -> np.ndarray:
    """``np.arange(n, dtype=dtype)`` as a read-only view of a cached, growing ramp."""
    ramp = _RAMPS.get(dtype)
    if ramp is None or len(ramp) < n:
        with _RAMPS_LOCK:
            ramp = np.arange(max(n, 1024, 2 * len(ramp) if ramp is not None else 0), dtype=dtype)
            ramp.flags.writeable = False
            _RAMPS[dtype] = ramp
    return ramp[:n]


def _shape(x: Any) -> str:
    return f"shape {tuple(x.shape)}"


def _host(x: Any, field: str, dtype: str, ndim: int, host_copy: bool) -> np.ndarray:
    """A numpy view of a host array/tensor; device tensors copied (``.cpu()``) or refused."""
    if is_tensor(x):
        check_dtype(tensor_dtype_name(x), (dtype,), field)
        if not x.is_cpu:  # is_cpu: a fifth of the cost of device.type
            if not host_copy:
                raise UnsupportedValueError(
                    field,
                    "a host (CPU) tensor: call to_cpu_nonblocking() and synchronise first",
                    f"a tensor on {x.device}",
                )
            x = x.cpu()
        # Integer tensors: .numpy() shares the memory like DLPack at a fifth of the cost
        # (no bfloat16 to reinterpret, no autograd to detach from).
        a = x.numpy()
    elif type(x) is np.ndarray:
        a = x
        check_dtype(dtype_name(a.dtype), (dtype,), field)
    else:
        a, dt = host_array(x, field)  # other kinds refused
        check_dtype(dt, (dtype,), field)
    if a.ndim != ndim:
        check_ndim(a, ndim, field)  # raises the precise error
    return a


def _num_sampled(x: Any, num_reqs: int, rpr: int, host_copy: bool) -> np.ndarray | None:
    """``num_sampled_tokens`` as int64 numpy, checked against the rows; None stays None."""
    field = "num_sampled_tokens"
    if x is None:
        if rpr > 1:
            raise ConsistencyError(
                field,
                f"{num_reqs} counts (rows_per_request is {rpr}, so each request's "
                "sampled slots must be known)",
                "None",
            )
        return None
    if isinstance(x, (list, tuple)):
        a = np.asarray(x) if len(x) else np.zeros(0, np.int64)
        if a.dtype.kind not in "iu":
            raise DTypeError(field, "a list of ints", describe(x))
    else:
        if host_copy and is_tensor(x) and x.device.type != "cpu":
            x = x.cpu()
        a, dt = host_array(x, field)
        if dt not in _INT_DTYPES:
            raise DTypeError(field, "an integer array", dt)
    check_ndim(a, 1, field)
    if len(a) != num_reqs:
        raise ShapeError(field, f"{num_reqs} counts, one per request", f"{len(a)}")
    if rpr == 1:
        return None  # vLLM keeps every row then; only the length has to agree
    a = np.ascontiguousarray(a, dtype=np.int64)
    # Seen as unsigned, a negative count is huge: one reduction checks both bounds.
    if len(a) and int(np.maximum.reduce(a.view(np.uint64))) > rpr:
        i = int(np.argmax((a < 0) | (a > rpr)))
        raise ConsistencyError(
            f"{field}[{i}]", f"a count within 0..{rpr} (rows_per_request)", str(int(a[i]))
        )
    return a


def _index_int(x: Any, field: str) -> int:
    if isinstance(x, bool):
        raise FieldTypeError(field, "an int", describe(x))
    try:
        value = operator.index(x)
    except TypeError as e:
        raise FieldTypeError(field, "an int", describe(x)) from e
    if value < 0:
        raise ShapeError(field, "an int >= 0", str(value))
    return value


def _positive_int(x: Any, field: str) -> int:
    value = _index_int(x, field)
    if value < 1:
        raise ShapeError(field, "an int >= 1", str(value))
    return value


def _index_tensor(x: Any, field: str, device: Any) -> torch.Tensor:
    """A 1-D int32/int64 tensor on ``device``; numpy arrays and lists are copied there."""
    import torch

    if not is_tensor(x):
        if isinstance(x, (list, tuple)):
            x = np.asarray(x, dtype=np.int64) if len(x) else np.zeros(0, np.int64)
        if not isinstance(x, np.ndarray):
            raise FieldTypeError(field, "a torch tensor, numpy array or list", describe(x))
        if x.dtype.kind not in "iu":
            raise DTypeError(field, "int32 or int64", str(x.dtype))
        # A copy: the array may be read-only, which torch.from_numpy warns about.
        x = torch.tensor(np.asarray(x, dtype=np.int64), device=device)
    elif x.device != device:
        raise ConsistencyError(field, f"a tensor on {device} like logits", f"one on {x.device}")
    check_dtype(tensor_dtype_name(x), _INDEX_DTYPES, field)
    if x.ndim != 1:
        raise ShapeError(field, "a 1-D tensor", _shape(x))
    return x
