"""The record-batch codec's walks over Python objects, in pure Python: the specification.

``arrow_outputs._speedups`` is the compiled twin of this module; the two must give the same
answer for every input (``tests/test_speedups.py`` runs both through the same tests), and
``arrow_outputs._accel`` picks one. Read this module to learn what the C code does.

Every function either does the whole job or returns ``None`` (``False`` for
``index_in_order``): it never raises about the *data*. The caller then runs its own slow path,
which finds the offending item and raises the precise error, so error text never depends on
which path ran. Only misuse of the integer arguments raises (``TypeError`` for a non-integer,
``OverflowError`` past ``Py_ssize_t``), and exceptions from user code (a buffer exporter, a
key's ``__eq__``) propagate, exactly as in C.

Conventions shared by all functions:

- "exact" means ``type(x) is T``: subclasses are refused (a ``bool`` is not an ``int``, a list
  subclass may redefine iteration).
- Buffers are taken through the buffer protocol (``bytes``, numpy arrays, ``pyarrow.Buffer``)
  as their raw bytes, C-contiguous only; an object without the protocol gives ``None``.
  Integers in buffers are little-endian.
- Arrow's offset width is int32: totals above ``2**31 - 1`` give ``None``.
"""

from __future__ import annotations

import ctypes
import itertools
import operator
import struct
import sys
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = [
    "array_of",
    "copy_from_address",
    "flatten_int_lists",
    "index_in_order",
    "int32_head",
    "int_offsets",
    "mask_rows",
    "mask_supports",
    "message_custom_metadata",
    "node_of",
    "offsets_ok",
    "record_batch",
    "same_items",
    "sampled_rows",
    "split_int_lists",
    "str_list",
    "utf8_array",
]

_INT32_MAX = 2**31 - 1
_SSIZE_MIN, _SSIZE_MAX = -sys.maxsize - 1, sys.maxsize  # the range of C Py_ssize_t
# itemsize -> (little-endian numpy dtype, smallest value, largest value)
_INT_TYPES: dict[int, tuple[str, int, int]] = {
    4: ("<i4", -(2**31), 2**31 - 1),
    8: ("<i8", -(2**63), 2**63 - 1),
}


def _ssize(x: Any) -> int:
    """An integer argument, as the C module reads a ``Py_ssize_t`` (same exception types)."""
    v = operator.index(x)
    if not _SSIZE_MIN <= v <= _SSIZE_MAX:
        raise OverflowError("Python int too large to convert to C ssize_t")
    return v


def _raw_bytes(obj: Any) -> np.ndarray | None:
    """The bytes behind a buffer-protocol object as a uint8 array, or None.

    ``memoryview`` asks for the same buffer (``PyBUF_FULL_RO``) as the C module does, so an
    exporter's own error propagates the same way on both paths; only "no buffer protocol"
    (``TypeError``) means None.
    """
    try:
        m = memoryview(obj)
    except TypeError:
        return None
    if not m.c_contiguous:
        return None
    return np.frombuffer(m, dtype=np.uint8)


def _int32_offsets(lengths: Any, count: int) -> bytes:
    offsets = np.zeros(count + 1, dtype="<i4")
    np.cumsum(np.fromiter(lengths, dtype=np.int64, count=count), out=offsets[1:])
    return offsets.tobytes()


def flatten_int_lists(lists: Any, n: Any, itemsize: Any, /) -> tuple[bytes, bytes] | None:
    """The values and int32 offsets of an Arrow list array built from a list of lists of int.

    Parameters
    ----------
    lists
        An exact ``list`` of ``n`` exact ``list`` of exact ``int``.
    n
        The number of lists expected.
    itemsize
        4 (int32 values) or 8 (int64 values).

    Returns
    -------
    tuple of bytes or None
        ``(values, offsets)``: little-endian signed ints of ``itemsize`` bytes, and ``n + 1``
        little-endian int32 offsets from 0. None for anything else: another ``itemsize``, a
        count other than ``n``, a non-list, a non-int (``bool`` included), a value outside the
        range of ``itemsize`` bytes, or more than ``2**31 - 1`` values in all.

    Examples
    --------
    >>> values, offsets = flatten_int_lists([[1, 2], [], [-1]], 3, 4)
    >>> np.frombuffer(values, "<i4").tolist(), np.frombuffer(offsets, "<i4").tolist()
    ([1, 2, -1], [0, 2, 2, 3])
    >>> flatten_int_lists([[True]], 1, 8) is None
    True
    """
    n, itemsize = _ssize(n), _ssize(itemsize)
    if itemsize not in _INT_TYPES or type(lists) is not list or len(lists) != n:
        return None
    if list(map(type, lists)).count(list) != n:  # the C-level form of all(type(x) is list)
        return None
    if sum(map(len, lists)) > _INT32_MAX:  # before flattening: the total bounds the memory
        return None
    flat = list(itertools.chain.from_iterable(lists))
    if list(map(type, flat)).count(int) != len(flat):
        return None
    try:
        values = np.array(flat, dtype="<i8")  # exact ints only: OverflowError past int64
    except OverflowError:
        return None
    dtype, lo, hi = _INT_TYPES[itemsize]
    if itemsize == 4 and values.size and (values.min() < lo or values.max() > hi):
        return None
    return values.astype(dtype, copy=False).tobytes(), _int32_offsets(map(len, lists), n)


def utf8_array(strs: Any, /) -> tuple[bytes, bytes] | None:
    """The int32 offsets and UTF-8 data of an Arrow string array built from a list of str.

    Returns
    -------
    tuple of bytes or None
        ``(offsets, data)``: ``len(strs) + 1`` little-endian int32 offsets from 0, and the
        strings' UTF-8 bytes end to end. None when ``strs`` is not an exact ``list``, an item
        is not an exact ``str``, an item has no UTF-8 form (a lone surrogate), or the data
        exceeds ``2**31 - 1`` bytes.

    Examples
    --------
    >>> offsets, data = utf8_array(["ab", "", "é"])
    >>> np.frombuffer(offsets, "<i4").tolist(), data
    ([0, 2, 2, 4], b'ab\\xc3\\xa9')
    >>> utf8_array(["\\ud800"]) is None
    True
    """
    if type(strs) is not list or list(map(type, strs)).count(str) != len(strs):
        return None
    chars = list(map(len, strs))
    total_chars = sum(chars)
    if total_chars > _INT32_MAX:  # UTF-8 has at least a byte a character: too long already
        return None
    try:
        # One encode of the whole: the UTF-8 encoder refuses every surrogate code point,
        # paired or not, so joining first cannot make a valid string out of two invalid ones.
        data = "".join(strs).encode("utf-8")
    except UnicodeEncodeError:
        return None
    if len(data) > _INT32_MAX:
        return None
    # As many bytes as characters: all ASCII, so each string's byte length is its length.
    ascii_only = len(data) == total_chars
    lengths = chars if ascii_only else [len(s.encode("utf-8")) for s in strs]
    return _int32_offsets(lengths, len(strs)), data


def copy_from_address(dst: Any, offset: Any, address: Any, nbytes: Any, /) -> bool:
    """Copy ``nbytes`` bytes from the raw host ``address`` into ``dst`` at ``offset``.

    The staging pool's copy of a contiguous CPU tensor (``address`` its ``data_ptr()``) into
    its slab. The source is the caller's to vouch for, as with ``ctypes.memmove``; the
    destination is checked.

    Returns
    -------
    bool
        True once copied; False, with nothing written, when ``dst`` is not a writable
        C-contiguous buffer, the range ``offset .. offset + nbytes`` does not lie inside it,
        or ``nbytes`` is positive and ``address`` is 0. ``address`` must be an integer within
        ``0 .. 2**64 - 1`` (``OverflowError`` otherwise, as in C).

    Examples
    --------
    >>> src, dst = np.arange(4, dtype=np.uint8), bytearray(6)
    >>> copy_from_address(dst, 1, src.ctypes.data, 4), dst
    (True, bytearray(b'\\x00\\x00\\x01\\x02\\x03\\x00'))
    >>> copy_from_address(bytes(6), 0, src.ctypes.data, 4)
    False
    """
    offset = _ssize(offset)
    address = operator.index(address)
    if not 0 <= address < 2**64:
        raise OverflowError("address out of range")
    nbytes = _ssize(nbytes)
    if address >= 1 << (8 * ctypes.sizeof(ctypes.c_void_p)):
        return False
    try:
        view = memoryview(dst)
    except TypeError:
        return False
    try:
        if (
            view.readonly
            or not view.c_contiguous
            or offset < 0
            or nbytes < 0
            or offset > view.nbytes - nbytes
            or (nbytes > 0 and address == 0)
        ):
            return False
        if nbytes > 0:
            target = np.frombuffer(view.cast("B"), np.uint8)
            ctypes.memmove(target.ctypes.data + offset, address, nbytes)
            del target  # its export of the view ends before the view is released
        return True
    finally:
        view.release()


def index_in_order(req_ids: Any, index: Any, /) -> bool:
    """Whether ``index`` maps ``req_ids[i]`` to ``i``, in ``req_ids``' order.

    For an exact ``list`` and an exact ``dict`` this is the Python expression below, with its
    answer, its order of ``__eq__`` calls and its exceptions; for anything else it is False
    (a subclass may redefine iteration or equality: the caller's slow path judges it).

    Examples
    --------
    >>> index_in_order(["a", "b"], {"a": 0, "b": 1})
    True
    >>> index_in_order(["a", "b"], {"b": 1, "a": 0})
    False
    """
    if type(req_ids) is not list or type(index) is not dict:
        return False
    return bool(list(index) == req_ids and list(index.values()) == list(range(len(req_ids))))


def str_list(offsets: Any, data: Any, offset: Any, n: Any, /) -> list[str] | None:
    """The Python strs of an Arrow string array, from its offsets and data buffers.

    Parameters
    ----------
    offsets
        The array's int32 offsets buffer (of the unsliced array).
    data
        The array's data buffer.
    offset, n
        The array's slice offset and length: offsets ``offset`` to ``offset + n`` are read.

    Returns
    -------
    list of str or None
        None when ``offset`` or ``n`` is negative, a buffer lacks the buffer protocol or is not
        C-contiguous, the offsets buffer is too short, an offset is negative, smaller than the
        one before it or past the end of ``data``, or a string is not valid UTF-8. ``n == 0``
        reads no offsets and gives ``[]``.

    Examples
    --------
    >>> import pyarrow as pa
    >>> arr = pa.array(["x", "yz", None, "w"])[1:]
    >>> _, offs, data = arr.buffers()
    >>> str_list(offs, data, arr.offset, 2)
    ['yz', '']
    """
    offset, n = _ssize(offset), _ssize(n)
    offs_bytes, data_bytes = _raw_bytes(offsets), _raw_bytes(data)
    if offs_bytes is None or data_bytes is None or offset < 0 or n < 0:
        return None
    if n == 0:
        return []
    if len(offs_bytes) // 4 - offset < n + 1:
        return None
    offs = offs_bytes[offset * 4 : (offset + n + 1) * 4].view("<i4").astype(np.int64)
    lo, hi = int(offs[0]), int(offs[-1])
    if lo < 0 or hi > len(data_bytes) or (offs[1:] < offs[:-1]).any():
        return None
    if not _slices_are_utf8(data_bytes[lo:hi], offs[1:-1] - lo):
        return None
    # Checked: offsets in bounds and every string valid UTF-8, so Arrow's own conversion
    # (the codec's former path) gives exactly the strs a decode of each slice would.
    arr = pa.Array.from_buffers(
        pa.string(), n, [None, pa.py_buffer(offs_bytes), pa.py_buffer(data_bytes)], offset=offset
    )
    strs: list[str] = arr.to_numpy(zero_copy_only=False).tolist()
    return strs


def _slices_are_utf8(window: np.ndarray, cuts: np.ndarray) -> bool:
    """Whether every slice of ``window`` between consecutive ``cuts`` is valid UTF-8.

    The slices tile the window, so they are all valid exactly when the window is and no cut
    falls inside a character, that is on a continuation byte (``0b10xxxxxx``).
    """
    raw = window.tobytes()
    if raw.isascii():
        return True  # every slice of ASCII is valid UTF-8
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    inner = cuts[cuts < len(raw)]
    return not ((window[inner] & 0xC0) == 0x80).any()


def split_int_lists(values: Any, offsets: Any, itemsize: Any, n: Any, /) -> list[list[int]] | None:
    """The lists of Python ints of an Arrow list array, from its values and offsets buffers.

    Parameters
    ----------
    values
        The values buffer: signed little-endian ints of ``itemsize`` (4 or 8) bytes.
    offsets
        ``n + 1`` int32 offsets, already sliced (entry 0 starts the first list); they index
        ``values`` from its start.
    itemsize
        4 or 8.
    n
        The number of lists.

    Returns
    -------
    list of list of int or None
        None when ``itemsize`` is not 4 or 8, ``n`` is negative, a buffer lacks the buffer
        protocol or is not C-contiguous, the offsets buffer holds fewer than ``n + 1``
        entries, or an offset is negative, smaller than the one before it, or past the
        ``len(values) // itemsize`` values. ``n == 0`` reads no offsets and gives ``[]``.

    Examples
    --------
    >>> import numpy as np
    >>> split_int_lists(np.arange(6, dtype=np.int64), np.array([1, 3, 3, 6], np.int32), 8, 3)
    [[1, 2], [], [3, 4, 5]]
    """
    itemsize, n = _ssize(itemsize), _ssize(n)
    vals_bytes, offs_bytes = _raw_bytes(values), _raw_bytes(offsets)
    if vals_bytes is None or offs_bytes is None or itemsize not in _INT_TYPES or n < 0:
        return None
    if n == 0:
        return []
    if len(offs_bytes) // 4 < n + 1:
        return None
    offs = offs_bytes[: (n + 1) * 4].view("<i4").astype(np.int64)
    lengths = np.diff(offs)
    lo, hi = int(offs[0]), int(offs[-1])
    if lo < 0 or hi > len(vals_bytes) // itemsize or (lengths < 0).any():
        return None
    flat = vals_bytes[lo * itemsize : hi * itemsize].view(_INT_TYPES[itemsize][0])
    if (lengths == lengths[0]).all():  # equal lengths (a decode step): one C-level tolist
        return flat.reshape(n, int(lengths[0])).tolist()
    values = flat.tolist()
    return [values[a:b] for a, b in itertools.pairwise((offs - lo).tolist())]


def mask_rows(
    token_ids: Any, width: Any, packed: Any, row_bytes: Any, lens: Any, vocab_size: Any, out: Any, /
) -> bool:
    """Fill ``out`` (int32) with the supports of sampling-mask rows, rows concatenated.

    Row ``r`` (of ``len(lens) // 4`` rows) keeps its first ``lens[r]`` compact ids from
    ``token_ids`` (int32, ``width`` a row) when ``lens[r] <= width``; otherwise the ids of the
    set bits of its ``packed`` row (``row_bytes`` a row, little bit order, ids below
    ``vocab_size``), which must number exactly ``lens[r]``.

    Returns
    -------
    bool
        False (``out`` unspecified) when a buffer is too short, ``out`` is not writable or
        not exactly ``sum(lens)`` ids, a length is negative, ``row_bytes`` is below
        ``ceil(vocab_size / 8)``, or a bitmask row's set bits disagree with its count.

    Examples
    --------
    >>> tok = np.array([[3, 9], [0, 0]], np.int32)
    >>> packed = np.array([[0, 0], [0b101, 0b1]], np.uint8)  # row 1: ids 0, 2, 8
    >>> out = np.empty(4, np.int32)
    >>> mask_rows(tok, 2, packed, 2, np.array([1, 3], np.int32), 10, out), out.tolist()
    (True, [3, 0, 2, 8])
    """
    width, row_bytes, vocab = _ssize(width), _ssize(row_bytes), _ssize(vocab_size)
    tok_b, bits_b, lens_b = _raw_bytes(token_ids), _raw_bytes(packed), _raw_bytes(lens)
    try:
        view = memoryview(out)
    except TypeError:
        return False
    if tok_b is None or bits_b is None or lens_b is None or view.readonly:
        return False
    if not view.c_contiguous or width < 0 or row_bytes < 0 or vocab < 0:
        return False
    if row_bytes < (vocab + 7) // 8 or len(lens_b) % 4 or view.nbytes % 4:
        return False
    lens_a = lens_b.view("<i4")
    rows = len(lens_a)
    if len(tok_b) // 4 < rows * width or len(bits_b) < rows * row_bytes:
        return False
    if rows and int(lens_a.min()) < 0:
        return False
    if int(lens_a.sum(dtype=np.int64)) != view.nbytes // 4:
        return False
    tok = tok_b[: rows * width * 4].view("<i4").reshape(rows, width)
    dest = np.frombuffer(view.cast("B"), dtype="<i4")
    pos = 0
    for r in range(rows):
        n = int(lens_a[r])
        if n <= width:
            dest[pos : pos + n] = tok[r, :n]
        else:
            row = bits_b[r * row_bytes : r * row_bytes + row_bytes]
            ids = np.flatnonzero(np.unpackbits(row, count=vocab, bitorder="little"))
            if len(ids) != n:
                return False
            dest[pos : pos + n] = ids
        pos += n
    return True


def int32_head(values: Any, n: Any, /) -> bytearray | None:
    """A copy of the first ``n`` items of a 1-D C-contiguous int32 buffer (a step's staged
    NaN counts, one per request).

    Returns
    -------
    bytearray or None
        ``n`` little-endian int32 values. None when ``values`` is no such buffer, ``n`` is not
        an exact int ``>= 0``, or the buffer holds fewer than ``n`` items.

    Examples
    --------
    >>> np.frombuffer(int32_head(np.array([4, 0, 7], np.int32), 2), "<i4").tolist()
    [4, 0]
    >>> int32_head(np.array([4], np.int32), 2) is None
    True
    """
    count = _exact_int(n, 0, _SSIZE_MAX // 4)
    view = _int_view(values, "i", 4, 1)
    if count is None or view is None or len(view) < count:
        return None
    return bytearray(view[:count].tobytes())


_U16 = struct.Struct("<H").unpack_from
_U32 = struct.Struct("<I").unpack_from
_I32 = struct.Struct("<i").unpack_from
# Message.fbs: version (0), header_type (1), header (2), bodyLength (3), custom_metadata (4).
_MESSAGE_CUSTOM_METADATA = 4


def custom_metadata_pairs(meta: Any) -> list[tuple[bytes, bytes]]:
    """The ``custom_metadata`` entries of an Arrow IPC ``Message`` flatbuffer (``meta``: its
    bytes, ``pyarrow.ipc.Message.metadata``), every offset checked against the bytes.

    Raises ``struct.error`` naming the first thing out of bounds: read past the end
    (``unpack_from`` raises), a vtable before the start, a count or a string longer than
    the bytes left, an entry without its key or value. Every position is a sum of unsigned
    fields but the vtables', which are checked to be >= 0 (a negative position would count
    from the end). :func:`message_custom_metadata` is the walk's form of it (None instead of
    an exception); a caller raises its own error with this one's message."""
    size = len(meta)
    (table,) = _U32(meta, 0)
    vtable = table - _I32(meta, table)[0]
    if vtable < 0:
        raise struct.error("vtable before the buffer")
    (vsize,) = _U16(meta, vtable)
    slot = 4 + 2 * _MESSAGE_CUSTOM_METADATA
    off = _U16(meta, vtable + slot)[0] if slot + 2 <= vsize else 0
    if not off:
        return []
    at = table + off
    vec = at + _U32(meta, at)[0]
    (count,) = _U32(meta, vec)
    if count > (size - vec - 4) // 4:
        raise struct.error(f"{count} entries")
    out = []
    for item in range(vec + 4, vec + 4 + 4 * count, 4):
        kv = item + _U32(meta, item)[0]
        vtable = kv - _I32(meta, kv)[0]
        if vtable < 0:
            raise struct.error("vtable before the buffer")
        (vsize,) = _U16(meta, vtable)
        pair = []
        for slot in (4, 6):  # key (field 0), value (field 1): both required by Arrow
            off = _U16(meta, vtable + slot)[0] if slot + 2 <= vsize else 0
            if not off:
                raise struct.error("a custom_metadata entry without its key or value")
            at = kv + off
            start = at + _U32(meta, at)[0] + 4
            (n,) = _U32(meta, start - 4)
            if n > size - start:
                raise struct.error(f"a string of {n} bytes")
            pair.append(bytes(meta[start : start + n]))
        out.append((pair[0], pair[1]))
    return out


def message_custom_metadata(meta: Any, /) -> list[tuple[bytes, bytes]] | None:
    """The ``custom_metadata`` (key, value) pairs of an IPC ``Message`` flatbuffer: the bytes
    of a C-contiguous buffer, read as :func:`custom_metadata_pairs` reads them.

    Returns
    -------
    list of (bytes, bytes) or None
        The entries in order (``[]`` when the message has none). None when ``meta`` is no
        buffer, or anything in it is out of bounds: the caller asks
        :func:`custom_metadata_pairs` what.

    Examples
    --------
    >>> import pyarrow as pa
    >>> sink = pa.BufferOutputStream()
    >>> batch = pa.record_batch([pa.array([1])], names=["x"])
    >>> with pa.ipc.new_stream(sink, batch.schema) as w:
    ...     w.write_batch(batch, custom_metadata={b"k": b"v"})
    >>> reader = pa.BufferReader(sink.getvalue())
    >>> _ = pa.ipc.read_message(reader)  # the schema message
    >>> message_custom_metadata(pa.ipc.read_message(reader).metadata)
    [(b'k', b'v')]
    >>> message_custom_metadata(b"1") is None  # too short for a flatbuffer
    True
    """
    raw = _raw_bytes(meta)
    if raw is None:
        return None
    try:
        return custom_metadata_pairs(raw.data)
    except struct.error:
        return None


def sampled_rows(padded: Any, counts: Any, /) -> tuple[bytearray, bytearray | None, int] | None:
    """The sampled-ids column's buffers from a step's staged host copies, each row trimmed
    as vLLM's ``del row[count:]`` trims it.

    ``padded``: int64 ``[rows, width]`` (slots past a row's count are never read);
    ``counts``: int32 ``[rows]``; both C-contiguous, native byte order. Row ``r`` keeps its
    first ``min(counts[r], width)`` slots.

    Returns
    -------
    tuple, or None
        ``(values, offsets, k)``: int64 ``values`` of every kept slot in row order; when
        every row keeps the same ``k`` slots (a decode step) ``offsets`` is None (the
        caller's offsets ``[0, k, 2k, ...]`` apply), else int32 ``offsets`` (``rows + 1``)
        and ``k == -1``. None for any other input: another type, rank or layout, no rows, a
        count below 0, more than ``2**31 - 1`` kept slots.

    Examples
    --------
    >>> padded = np.array([[5, 0], [7, 8]], np.int64)
    >>> values, offsets, k = sampled_rows(padded, np.array([1, 2], np.int32))
    >>> np.frombuffer(values, "<i8").tolist(), np.frombuffer(offsets, "<i4").tolist(), k
    ([5, 7, 8], [0, 1, 3], -1)
    >>> sampled_rows(padded, np.array([1, 1], np.int32))[1:]
    (None, 1)
    """
    pad = _int_view(padded, "i", 8, 2)
    cnt = _int_view(counts, "i", 4, 1)
    if pad is None or cnt is None:
        return None
    rows, width = pad.shape or (0, 0)  # never None: ndim is 2
    if rows < 1 or len(cnt) != rows:
        return None
    lens = np.frombuffer(cnt, "<i4").astype(np.int64)
    if int(lens.min()) < 0:
        return None
    kept = np.minimum(lens, width)
    total = int(kept.sum())
    if total > _INT32_MAX:
        return None
    matrix = np.frombuffer(pad, "<i8").reshape(rows, width)
    if int(kept.min()) == int(kept.max()):
        k = int(kept[0])
        return bytearray(matrix[:, :k].tobytes()), None, k
    offsets = np.zeros(rows + 1, "<i4")
    np.cumsum(kept, out=offsets[1:])
    values = matrix[np.arange(width) < kept[:, None]]
    return bytearray(values.tobytes()), bytearray(offsets.tobytes()), -1


def same_items(a: Any, b: Any, /) -> bool:
    """Whether ``a`` and ``b`` are exact lists of the same length holding the very same
    objects in order (``is``, never ``==``: no user code runs).

    Examples
    --------
    >>> x, y = "req-0", "req-1"
    >>> same_items([x, y], [x, y]), same_items([x, y], [y, x]), same_items([x], (x,))
    (True, False, False)
    """
    if type(a) is not list or type(b) is not list or len(a) != len(b):
        return False
    return all(map(operator.is_, a, b))


def offsets_ok(values: Any, last: Any, /) -> bool:
    """Whether ``values`` are valid Arrow offsets of ``last`` items, as a producer hands them
    over (the int64 CSR offsets of ``SamplingMaskLists``).

    True when ``values`` is a 1-D C-contiguous buffer of native signed 64- or 32-bit integers
    holding at least one item, starting at 0, never decreasing and ending at ``last`` (an
    exact ``int``); False for anything else, and the caller's checks then name what is wrong.

    Examples
    --------
    >>> offsets_ok(np.array([0, 2, 2, 5]), 5), offsets_ok(np.array([0, 3, 2, 5]), 5)
    (True, False)
    >>> offsets_ok(np.array([0, 2]), 3), offsets_ok([0, 2], 2)
    (False, False)
    """
    if type(last) is not int or not _INT_TYPES[8][1] <= last <= _INT_TYPES[8][2]:
        return False  # before values are read, as the C function
    view = _int_view(values, "i", 8, 1)
    if view is None:
        view = _int_view(values, "i", 4, 1)
    if view is None or len(view) == 0:
        return False
    items = view.tolist()
    return items[0] == 0 and items[-1] == last and all(map(operator.le, items, items[1:]))


def int_offsets(values: Any, last: Any, /) -> bytes | None:
    """int32 Arrow offsets from a list of ints: ``cu_num_generated_tokens`` as vLLM gives it.

    Parameters
    ----------
    values
        An exact ``list`` or ``tuple`` of exact ``int``.
    last
        The value the offsets must end at (the number of positions they index).

    Returns
    -------
    bytes or None
        ``len(values)`` little-endian int32 offsets. None unless ``values`` is non-empty,
        starts at 0, never decreases and ends at ``last``, with ``0 <= last <= 2**31 - 1``.

    Examples
    --------
    >>> np.frombuffer(int_offsets([0, 1, 3], 3), "<i4").tolist()
    [0, 1, 3]
    >>> int_offsets([0, 2, 1], 1) is None, int_offsets([0, True], 1) is None
    (True, True)
    """
    last = _ssize(last)
    if type(values) not in (list, tuple) or not values or not 0 <= last <= _INT32_MAX:
        return None
    if list(map(type, values)).count(int) != len(values):
        return None
    try:
        arr = np.array(values, dtype="<i8")
    except OverflowError:
        return None
    if arr[0] != 0 or arr[-1] != last or (len(arr) > 1 and bool((np.diff(arr) < 0).any())):
        return None
    return arr.astype("<i4").tobytes()


# ------------------------------------------------------------------ whole-batch assembly
#
# A node describes one Arrow array without a type: ``(length, null_count, buffers,
# children)``, ``buffers`` a tuple of None or buffer-protocol objects (offset 0 throughout),
# ``children`` a tuple of nodes. The codec's hot columns are built as nodes; the C module's
# ``build_array`` turns a batch of them into one ArrowArray tree that pyarrow imports against
# the run's schema. :func:`record_batch` below is that assembly's specification: the same
# batch through ``pyarrow.Array.from_buffers`` and ``RecordBatch.from_arrays``.

Node = tuple[int, int, tuple[Any, ...], tuple[Any, ...]]


def array_of(node: Node, t: pa.DataType) -> pa.Array:
    """The array of type ``t`` that ``node`` describes (``pyarrow.Array.from_buffers``)."""
    if isinstance(t, pa.BaseExtensionType):
        return pa.ExtensionArray.from_storage(t, array_of(node, t.storage_type))
    length, null_count, buffers, children = node
    kids = [array_of(k, t.field(i).type) for i, k in enumerate(children)]
    bufs = [b if b is None or isinstance(b, pa.Buffer) else pa.py_buffer(b) for b in buffers]
    return pa.Array.from_buffers(t, length, bufs, null_count=null_count, children=kids)


# Types whose layout a node states completely (no dictionary, no type-specific buffers).
_NODE_LAYOUTS = (
    pa.types.is_integer,
    pa.types.is_floating,
    pa.types.is_boolean,
    pa.types.is_string,
    pa.types.is_binary,
    pa.types.is_list,
    pa.types.is_large_list,
    pa.types.is_fixed_size_list,
    pa.types.is_struct,
)


def node_of(arr: pa.Array) -> Node | None:
    """The node of an existing array (its own buffers, no copy), or None when a node cannot
    say it: a slice, a device buffer, or a type outside :data:`_NODE_LAYOUTS`.

    The codec builds its nodes directly and hands finished arrays to the assembly as they
    are; this is for the benchmarks' floors (``benchmarks/pyarrow_floor.py``) and the tests
    that prove a node describes its array exactly."""
    if isinstance(arr, pa.ExtensionArray):
        arr = arr.storage
    t = arr.type
    if arr.offset or not any(test(t) for test in _NODE_LAYOUTS):
        return None
    buffers = tuple(arr.buffers()[: t.num_buffers])
    if any(b is not None and not b.is_cpu for b in buffers):
        return None
    if pa.types.is_struct(t):
        parts = [arr.field(i) for i in range(t.num_fields)]
    elif t.num_fields:
        parts = [arr.values]
    else:
        parts = []
    kids = []
    for part in parts:
        kid = node_of(part)
        if kid is None:
            return None
        kids.append(kid)
    return (len(arr), arr.null_count, buffers, tuple(kids))


def record_batch(
    columns: list[Any], schema: pa.Schema, n: int, metadata: dict[bytes, bytes] | None = None
) -> pa.RecordBatch:
    """The batch of ``n`` rows whose columns are ``columns`` (nodes or arrays), in ``schema``
    (with ``metadata`` as its schema metadata when given).

    Arrays must be of their field's type (``from_arrays`` refuses others); nodes are read as
    their field's type, which their builder guarantees.
    """
    if metadata is not None:
        schema = schema.with_metadata(metadata)
    arrays = [
        c if isinstance(c, pa.Array) else array_of(c, schema.field(i).type)
        for i, c in enumerate(columns)
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _format_kind(view: memoryview) -> str:
    """A typed buffer's element kind: "i" signed integer, "u" unsigned, "" anything else
    (several items, non-native byte order, floats, bool)."""
    f = view.format
    if f[:1] in ("@", "=", "<"):
        f = f[1:]
    if len(f) != 1:
        return ""
    if f in "bhilqn":
        return "i"
    if f in "BHILQN":
        return "u"
    return ""


def _int_view(obj: Any, kind: str, itemsize: int, ndim: int) -> memoryview | None:
    """``memoryview(obj)`` when it is a C-contiguous ``ndim``-D buffer of ``itemsize``-byte
    integers of ``kind``; None otherwise (exporters' own errors propagate)."""
    try:
        view = memoryview(obj)
    except TypeError:
        return None
    if view.ndim != ndim or view.itemsize != itemsize or _format_kind(view) != kind:
        return None
    return view if view.c_contiguous else None


def _exact_int(x: Any, lo: int, hi: int) -> int | None:
    return x if type(x) is int and lo <= x <= hi else None


_MASK_SLACK = 8  # the C module's spare ids past the end (bounds its total the same way)


def mask_supports(
    token_ids: Any,
    packed_mask: Any,
    counts: Any,
    vocab_size: Any,
    rows_per_request: Any,
    num_sampled: Any,
    /,
) -> tuple[bytearray, bytearray, bytearray | None] | None:
    """The supports of a ``SamplingMaskTensors``' kept rows, from its fields as host buffers.

    ``token_ids``: int32 ``[rows, width]``; ``packed_mask``: uint8
    ``[rows, ceil(vocab_size / 8)]``; ``counts``: int32 ``[rows]``; ``rows`` a multiple of
    ``rows_per_request``; ``num_sampled``: None (only with one row per request) or int32 /
    int64 ``[rows // rows_per_request]``, each within ``0..rows_per_request`` when that is
    above 1 (with 1 its values are not read). Every buffer C-contiguous, native byte order;
    ``vocab_size`` an exact int within ``0..2**31``, ``rows_per_request`` one >= 1.

    Slot ``s`` of request ``q`` (row ``q * rows_per_request + s``) is kept when
    ``rows_per_request`` is 1 or ``s < num_sampled[q]``. A kept row with
    ``counts[r] <= width`` gives its first ``counts[r]`` compact ids as they are; a wider one
    the ids of the set bits of its bitmask row (little bit order, below ``vocab_size``),
    which must number exactly ``counts[r]``.

    Returns
    -------
    tuple of bytearray, or None
        ``(ids, offsets, cu)``: int32 ids of every kept row in order, int64 offsets (one per
        kept row after a leading 0), and with several rows per request int32 ``cu`` (the
        running sum of ``num_sampled`` from 0), else None. None for any other input: a
        buffer of another type, rank, shape or layout, a non-int or out-of-range argument,
        a negative count or one past ``max(width, vocab_size)``, a bitmask row that
        disagrees with its count.

    Examples
    --------
    >>> tok = np.array([[3, 9], [0, 0]], np.int32)
    >>> packed = np.array([[0, 0], [0b101, 0b1]], np.uint8)  # row 1: ids 0, 2, 8
    >>> ids, offsets, cu = mask_supports(tok, packed, np.array([1, 3], np.int32), 10, 1, None)
    >>> np.frombuffer(ids, "<i4").tolist(), np.frombuffer(offsets, "<i8").tolist(), cu
    ([3, 0, 2, 8], [0, 1, 4], None)
    """
    vocab = _exact_int(vocab_size, 0, 2**31)
    rpr = _exact_int(rows_per_request, 1, _SSIZE_MAX)
    if vocab is None or rpr is None:
        return None
    tok = _int_view(token_ids, "i", 4, 2)
    bits = _int_view(packed_mask, "u", 1, 2)
    cnt = _int_view(counts, "i", 4, 1)
    if tok is None or bits is None or cnt is None:
        return None
    ns: memoryview | None = None
    if num_sampled is None:
        if rpr != 1:
            return None
    else:
        ns = _int_view(num_sampled, "i", 8, 1)
        if ns is None:
            ns = _int_view(num_sampled, "i", 4, 1)
        if ns is None:
            return None
    tok_shape, bits_shape = tok.shape or (), bits.shape or ()  # never None: ndim >= 1
    rows, width, row_bytes = len(cnt), tok_shape[1], (vocab + 7) // 8
    if tok_shape[0] != rows or bits_shape != (rows, row_bytes) or rows % rpr:
        return None
    num_reqs = rows // rpr
    if ns is not None and len(ns) != num_reqs:
        return None
    # Only rows_per_request > 1 reads num_sampled (with 1, vLLM keeps every row).
    kept = ns.tolist() if ns is not None and rpr > 1 else [1] * num_reqs
    lens = cnt.tolist()
    most = max(width, vocab)  # a kept row holds at most this many ids
    if any(not 0 <= k <= rpr for k in kept):
        return None
    rows_kept = [q * rpr + s for q, k in enumerate(kept) for s in range(k)]
    if any(not 0 <= lens[r] <= most for r in rows_kept):
        return None
    total = sum(lens[r] for r in rows_kept)
    if len(rows_kept) > _INT32_MAX or total > _SSIZE_MAX // 4 - _MASK_SLACK:
        return None
    tok_a = np.frombuffer(tok, dtype="<i4").reshape(rows, width)
    bits_a = np.frombuffer(bits, dtype=np.uint8).reshape(rows, row_bytes)
    supports = [np.zeros(0, "<i4")]
    for r in rows_kept:
        n = lens[r]
        if n <= width:
            supports.append(tok_a[r, :n])
        else:
            row = np.flatnonzero(np.unpackbits(bits_a[r], count=vocab, bitorder="little"))
            if len(row) != n:
                return None
            supports.append(row.astype("<i4"))
    offsets = np.zeros(len(rows_kept) + 1, "<i8")
    np.cumsum([lens[r] for r in rows_kept], out=offsets[1:])
    cu = None
    if ns is not None and rpr > 1:
        cu = bytearray(np.concatenate(([0], np.cumsum(kept))).astype("<i4").tobytes())
    return bytearray(np.concatenate(supports).tobytes()), bytearray(offsets.tobytes()), cu
