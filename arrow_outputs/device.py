"""Device tensors to Arrow and back: DLPack crossing and a pool of pinned host slabs.

pyarrow has no device memory of its own (its PyPI wheel has no CUDA), so device tensors reach
Arrow through host memory: a device-to-host copy into a *slab* of pinned memory, made on a side
stream and marked by an event, and Arrow buffers that point into the slab. The
:class:`StagingPool` owns the slabs and hands a slab out again only once nothing views it any
more: every Arrow buffer, array, record batch, numpy array and tensor made over a staged region
keeps its lease alive, and the lease's end returns the slab.

Without CUDA the same code runs over plain host memory with synchronous copies, so the
recycling logic is tested on any machine.

torch is imported only when a tensor is made or read (``import arrow_outputs`` stays free of it).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import pyarrow as pa

from . import _accel
from ._checks import describe
from ._torch import is_tensor, tensor_dtype_name
from .errors import FieldTypeError, UnsupportedValueError

__all__ = ["PoolStats", "Staged", "StagingPool", "buffer_to_tensor", "tensor_to_buffer"]

# Element types whose bits cross DLPack as another type: pyarrow and older numpy reject them.
_BIT_VIEWS = {"bfloat16": "uint16", "bool": "uint8"}
_ALIGN = 64  # every staged region starts on a cache line (and a 64-byte Arrow alignment)


@cache  # an import statement per call costs as much as a tensor attribute read
def _torch() -> Any:
    import torch

    return torch


def tensor_to_buffer(t: Any, field: str = "tensor") -> tuple[pa.Buffer, str]:
    """A host tensor's memory as one Arrow buffer, and the tensor's dtype name.

    Contiguous host tensors cross with no copy (the buffer's address is ``t.data_ptr()``, and
    the buffer keeps the tensor alive). A non-contiguous tensor (a transposed or strided view)
    is copied once into contiguous memory: an Arrow buffer is one span of bytes, so a strided
    view cannot be wrapped without changing what it means. bfloat16 and bool cross as their bit
    patterns (uint16, uint8); the returned dtype name says what they are.

    Examples
    --------
    >>> import torch
    >>> t = torch.arange(4, dtype=torch.bfloat16)
    >>> buf, dtype = tensor_to_buffer(t)
    >>> buf.address == t.data_ptr(), buf.size, dtype
    (True, 8, 'bfloat16')
    """
    if not is_tensor(t):
        raise FieldTypeError(field, "a torch tensor", describe(t))
    if t.device.type != "cpu":
        raise UnsupportedValueError(
            field,
            "a host tensor (stage device tensors with StagingPool)",
            f"a tensor on {t.device}",
        )
    dtype = tensor_dtype_name(t)
    torch = _torch()
    if not t.is_contiguous():
        t = t.contiguous()  # documented copy: Arrow buffers are one contiguous span
    if t.requires_grad:
        t = t.detach()
    if dtype in _BIT_VIEWS:
        t = t.view(getattr(torch, _BIT_VIEWS[dtype]))
    arr = np.from_dlpack(t) if t.numel() else np.empty(0, dtype=np.uint8)
    return pa.py_buffer(arr.reshape(-1).view(np.uint8)), dtype


def buffer_to_tensor(
    buf: pa.Buffer,
    dtype: str,
    shape: Sequence[int],
    *,
    device: Any = None,
    non_blocking: bool = True,
    offset: int = 0,
) -> Any:
    """A torch tensor over an Arrow buffer (no copy on the host), optionally moved to a device.

    The host tensor shares the buffer's memory and keeps it alive; treat it as read-only when
    the buffer came from a file or another process. With ``device`` the tensor is copied there,
    asynchronously when the buffer is pinned memory (a :class:`StagingPool` slab).
    """
    torch = _torch()
    if not isinstance(buf, pa.Buffer):
        raise FieldTypeError("buf", "a pyarrow.Buffer", describe(buf))
    base = _BIT_VIEWS.get(dtype, dtype)
    try:
        np_dtype = np.dtype(base)
    except TypeError as e:
        raise FieldTypeError("dtype", "a numpy or torch dtype name", repr(dtype)) from e
    count = math.prod(shape)
    if offset < 0 or offset + count * np_dtype.itemsize > buf.size:
        raise UnsupportedValueError(
            "buf", f"{count} {dtype} values from byte {offset}", f"a buffer of {buf.size} bytes"
        )
    arr = np.frombuffer(buf, dtype=np_dtype, count=count, offset=offset).reshape(tuple(shape))
    from ._torch import numpy_to_tensor

    t = numpy_to_tensor(arr, base)
    if dtype in _BIT_VIEWS:
        t = t.view(getattr(torch, dtype))
    if device is not None:
        t = t.to(device, non_blocking=non_blocking)
    return t


@dataclass(frozen=True)
class PoolStats:
    """Counters of a :class:`StagingPool` since it was made."""

    slabs: int  # slabs the pool holds now
    allocations: int  # slabs allocated (pinned allocations, with CUDA)
    reuses: int  # stagings that took an existing slab
    bytes_staged: int  # bytes of the tensors stage() took (counted as it takes their slab)
    waits: int  # stagings that waited for a slab to come back


class _Slab:
    """One pinned (or plain) host allocation, with its numpy view made once."""

    __slots__ = ("address", "array", "nbytes", "tensor", "view")

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor  # uint8, 1-D
        self.array: np.ndarray = tensor.numpy()  # a view: host memory, pinned or not
        # The copies' destination: a memoryview gives its buffer faster than numpy does.
        self.view = memoryview(self.array)
        self.address: int = tensor.data_ptr()
        self.nbytes: int = self.array.size


class _Lease:
    """Holds a slab out of the pool. Arrow buffers over the slab keep it alive as their base;
    when the last one goes, the slab goes back to the pool (a lease never outlives its views).

    ``__del__`` rather than ``weakref.finalize``: a fifth of the cost per step, and a lease is
    never part of a reference cycle (it refers only to its pool and its slab)."""

    __slots__ = ("_pool", "_slab")

    def __init__(self, pool: StagingPool, slab: _Slab) -> None:
        self._pool = pool
        self._slab = slab

    @property
    def slab(self) -> Any:
        """The slab as a uint8 host tensor."""
        return self._slab.tensor

    def __del__(self) -> None:
        self._pool._release(self._slab)


class StagingPool:
    """A bounded pool of reusable (pinned, with CUDA) host slabs for device-to-host copies.

    Parameters
    ----------
    max_slabs
        The most slabs held at once. A staging that finds every slab leased waits up to
        ``timeout`` seconds for one to come back, then raises.
    min_slab_bytes
        Smallest slab allocated; a larger request gets a slab of its size rounded up to a power
        of two, so a run's steps settle on reusable slabs after warm-up.
    pin
        Allocate pinned (page-locked) memory; the default is whether CUDA is available.
    timeout
        Seconds :meth:`stage` waits for a leased slab to come back.

    Examples
    --------
    >>> import torch
    >>> pool = StagingPool(max_slabs=2)
    >>> staged = pool.stage([torch.arange(3), torch.ones(2, dtype=torch.bfloat16)])
    >>> staged.wait()
    >>> staged.tensor(0).tolist(), staged.tensor(1).dtype
    ([0, 1, 2], torch.bfloat16)
    >>> del staged
    >>> pool.stats().slabs, pool.free_slabs()
    (1, 1)
    """

    def __init__(
        self,
        *,
        max_slabs: int = 8,
        min_slab_bytes: int = 1 << 20,
        pin: bool | None = None,
        timeout: float = 30.0,
    ) -> None:
        if type(max_slabs) is not int or max_slabs < 1:
            raise FieldTypeError("max_slabs", "an int >= 1", repr(max_slabs))
        if type(min_slab_bytes) is not int or min_slab_bytes < _ALIGN:
            raise FieldTypeError("min_slab_bytes", f"an int >= {_ALIGN}", repr(min_slab_bytes))
        self.max_slabs = max_slabs
        self.min_slab_bytes = min_slab_bytes
        self.timeout = timeout
        self._pin = pin
        self._free: list[_Slab] = []  # slabs not leased
        self._count = 0  # slabs held, leased or free
        # A lock under the condition: `with self._lock` costs less than the condition's
        # Python-level __enter__, and notify() runs only while someone waits. Re-entrant: a
        # lease can end on this thread while the lock is held (the cycle collector runs at
        # any allocation, and a batch it frees returns its slab from _Lease.__del__), and
        # _release then only appends to _free, which _acquire indexes from the front.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._waiting = 0  # stagings blocked in _acquire now
        self._allocations = self._reuses = self._bytes = self._waits = 0

    def _pinned(self) -> bool:
        if self._pin is None:
            torch = _torch()
            self._pin = bool(torch.cuda.is_available())
        return self._pin

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(self._count, self._allocations, self._reuses, self._bytes, self._waits)

    def free_slabs(self) -> int:
        """Slabs ready to be handed out now."""
        with self._lock:
            return len(self._free)

    def _release(self, slab: _Slab) -> None:
        with self._lock:
            self._free.append(slab)
            if self._waiting:
                self._cond.notify()

    def _acquire(self, nbytes: int, staged: int) -> _Slab:
        """A slab of at least ``nbytes``; ``staged`` bytes are counted as staged."""
        with self._lock:
            self._bytes += staged
            free = self._free
            if len(free) == 1 and free[0].nbytes >= nbytes:  # the one free slab fits: best
                self._reuses += 1
                return free.pop()
            waited = False
            while True:
                # By position, never list.remove (it compares with ==).
                sizes = [s.nbytes for s in self._free]
                fitting = [i for i, size in enumerate(sizes) if size >= nbytes]
                if fitting:
                    slab = self._free.pop(min(fitting, key=sizes.__getitem__))
                    self._reuses += 1
                    return slab
                if self._count < self.max_slabs or self._free:
                    if self._count >= self.max_slabs:
                        # Every held slab is too small: replace the smallest free one.
                        self._free.pop(sizes.index(min(sizes)))
                        self._count -= 1
                    size = max(self.min_slab_bytes, 1 << max(0, (nbytes - 1).bit_length()))
                    self._count += 1
                    self._allocations += 1
                    break
                if not waited:
                    self._waits += 1
                    waited = True
                self._waiting += 1
                try:
                    got = self._cond.wait(self.timeout)
                finally:
                    self._waiting -= 1
                if not got:
                    raise UnsupportedValueError(
                        "StagingPool",
                        f"a slab back within {self.timeout} s (max_slabs={self.max_slabs})",
                        "every slab still viewed by a batch, buffer or tensor; release them, "
                        "or make the pool larger",
                    )
        torch = _torch()
        return _Slab(torch.empty(size, dtype=torch.uint8, pin_memory=self._pinned()))

    def stage(
        self, tensors: Sequence[Any], *, stream: Any = None, main_stream: Any = None
    ) -> Staged:
        """Copy ``tensors`` (any device) into one slab, asynchronously where CUDA allows.

        With CUDA the copies run on ``stream`` (a side stream; ``main_stream``, by default the
        current stream, waits for nothing) after it waits for ``main_stream``'s work, and an
        event records their end: :meth:`Staged.wait` blocks on it. Views of the staged data
        are valid after ``wait()``.
        """
        torch = _torch()
        tensor_type = torch.Tensor
        items = list(tensors)
        specs: list[tuple[int, str, tuple[int, ...]]] = []
        sizes: list[int] = []
        total = staged_bytes = 0
        on_cuda = False
        for i, t in enumerate(items):
            if not isinstance(t, tensor_type):
                raise FieldTypeError(f"tensors[{i}]", "a torch tensor", describe(t))
            nbytes = t.nbytes
            sizes.append(nbytes)
            specs.append((total, _dtype_name(t.dtype), tuple(t.shape)))
            staged_bytes += nbytes
            total += -(-nbytes // _ALIGN) * _ALIGN
            on_cuda = on_cuda or t.is_cuda
        slab = self._acquire(max(total, 1), staged_bytes)
        lease = _Lease(self, slab)
        event = None
        if on_cuda:
            side = stream if stream is not None else torch.cuda.Stream()
            main = main_stream if main_stream is not None else torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for t, (off, _, _) in zip(items, specs):
                    _region(slab.tensor, off, t).copy_(t, non_blocking=True)
                    # The source must outlive the copy: the caching allocator is told so.
                    t.record_stream(side)
                event = torch.cuda.Event()
                event.record(side)
        else:
            dst = slab.view
            copy = _accel.copy_from_address
            for t, (off, _, _), nbytes in zip(items, specs, sizes):
                # The bytes as they lie (any dtype, bfloat16 and bool too): one memmove into
                # the region sized for them above, a few times cheaper than numpy's or torch's
                # copy for a step's small tensors. Strided, lazily conjugated or negated
                # tensors are not their bytes: torch reads them as they mean.
                if not (
                    t.is_cpu
                    and t.is_contiguous()
                    and not (t.is_conj() or t.is_neg())
                    and copy(dst, off, t.data_ptr(), nbytes)
                ):
                    _region(slab.tensor, off, t).copy_(t)
        return Staged(lease, specs, event, total)


_DTYPE_NAMES: dict[Any, str] = {}


def _dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, remembered per dtype (a step stages the same few)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _region(slab: Any, offset: int, like: Any) -> Any:
    """The slab's bytes at ``offset`` viewed as a tensor shaped and typed like ``like``."""
    nbytes = like.numel() * like.element_size()
    return slab[offset : offset + nbytes].view(like.dtype).view(like.shape)


class Staged:
    """Tensors copied into one leased slab; Arrow buffers and tensors over their regions.

    Every buffer, array and tensor made here keeps the slab's lease alive, so a later staging
    never overwrites data that is still viewed.
    """

    def __init__(
        self,
        lease: _Lease,
        specs: list[tuple[int, str, tuple[int, ...]]],
        event: Any,
        nbytes: int,
    ):
        self._lease = lease
        self._specs = specs
        self._event = event
        self._nbytes = nbytes

    def __len__(self) -> int:
        return len(self._specs)

    def wait(self) -> None:
        """Block until the copies have landed (no-op for host-to-host staging)."""
        if self._event is not None:
            self._event.synchronize()

    def buffer(self, i: int) -> pa.Buffer:
        """An Arrow buffer over tensor ``i``'s bytes in the slab (bit patterns for bf16/bool)."""
        off, dtype, shape = self._specs[i]
        nbytes = math.prod(shape) * _itemsize(dtype)
        # foreign_buffer's base keeps the lease (and so the slab) alive while Arrow uses it.
        return pa.foreign_buffer(self._lease._slab.address + off, nbytes, base=self._lease)

    def numpy(self, i: int) -> np.ndarray:
        """Tensor ``i`` as a numpy array over the slab (bfloat16 as its uint16 bits)."""
        _, dtype, shape = self._specs[i]
        return np.frombuffer(self.buffer(i), dtype=_BIT_VIEWS.get(dtype, dtype)).reshape(shape)

    def arrays(self) -> list[np.ndarray]:
        """Every staged tensor as a numpy array over the slab (bfloat16 as its uint16 bits).

        One Arrow buffer spans them all, so this costs one buffer however many tensors there
        are. Read them after :meth:`wait`.

        Returns
        -------
        list of numpy.ndarray
            One array per staged tensor, in staging order, shaped like it; each array (and
            anything made over it) keeps the slab leased.

        Examples
        --------
        >>> import torch
        >>> staged = StagingPool(max_slabs=1).stage([torch.arange(3), torch.ones(2, 2)])
        >>> ids, ones = staged.arrays()
        >>> ids.tolist(), ones.shape
        ([0, 1, 2], (2, 2))
        """
        # Each array made straight over its region of one memoryview (the ndarray constructor
        # checks that the region lies inside it): half the cost of slicing, viewing and
        # reshaping one uint8 array.
        whole = memoryview(
            pa.foreign_buffer(self._lease._slab.address, self._nbytes, base=self._lease)
        )
        return [
            np.ndarray(shape, _view_dtype(dtype), whole, off) for off, dtype, shape in self._specs
        ]

    def tensor(self, i: int) -> Any:
        """Tensor ``i`` as a host tensor over the slab, its dtype restored."""
        _, dtype, shape = self._specs[i]
        return buffer_to_tensor(self.buffer(i), dtype, shape)

    def dtype(self, i: int) -> str:
        return self._specs[i][1]

    def shape(self, i: int) -> tuple[int, ...]:
        return self._specs[i][2]


_VIEW_DTYPES: dict[str, np.dtype[Any]] = {}


def _view_dtype(dtype: str) -> np.dtype[Any]:
    """The numpy dtype a staged tensor is viewed as (bfloat16 and bool as their bits), made
    once per name: parsing a dtype name costs more than the view itself."""
    got = _VIEW_DTYPES.get(dtype)
    if got is None:
        got = _VIEW_DTYPES[dtype] = np.dtype(_BIT_VIEWS.get(dtype, dtype))
    return got


def _itemsize(dtype: str) -> int:
    return _view_dtype(dtype).itemsize
