"""DLPack crossing and the staging pool: zero-copy by address, lifetimes, recycling, bounds.

Everything but the last tests runs without CUDA: the pool's recycling logic is the same over
plain host memory. The ``cuda_device`` tests rerun the crossing on a GPU when one is present.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from conftest import codec_on, needs_c

import arrow_outputs as ao
from arrow_outputs.device import StagingPool, buffer_to_tensor, tensor_to_buffer

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8]


@pytest.mark.parametrize("dtype", [*DTYPES, torch.bool], ids=str)
def test_tensor_to_buffer_zero_copy_and_back(dtype: torch.dtype) -> None:
    t = (torch.arange(12) % 3).to(dtype).reshape(3, 4)
    buf, name = tensor_to_buffer(t)
    assert buf.address == t.data_ptr()
    assert buf.size == t.numel() * t.element_size()
    assert name == str(dtype).removeprefix("torch.")
    back = buffer_to_tensor(buf, name, (3, 4))
    assert back.dtype == dtype
    assert back.data_ptr() == t.data_ptr()
    assert torch.equal(back, t)


def test_tensor_to_buffer_non_contiguous_is_copied_right() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).T
    buf, _ = tensor_to_buffer(t)
    assert buf.address != t.data_ptr()
    assert np.frombuffer(buf, np.float32).tolist() == t.contiguous().reshape(-1).tolist()


def test_tensor_to_buffer_refuses_device_tensors_and_non_tensors() -> None:
    with pytest.raises(ao.UnsupportedValueError, match="StagingPool"):
        tensor_to_buffer(torch.zeros(2, device="meta"))
    with pytest.raises(ao.FieldTypeError):
        tensor_to_buffer(np.zeros(2))


def test_buffer_to_tensor_checks_bounds() -> None:
    buf = pa.py_buffer(np.zeros(4, np.float32))
    with pytest.raises(ao.UnsupportedValueError):
        buffer_to_tensor(buf, "float32", (5,))
    with pytest.raises(ao.UnsupportedValueError):
        buffer_to_tensor(buf, "float32", (4,), offset=4)


def _step(i: int) -> list[torch.Tensor]:
    return [torch.full((64,), i, dtype=torch.int64), torch.full((8, 3), float(i)).bfloat16()]


def test_staging_pool_values_and_no_allocation_after_warm_up() -> None:
    pool = StagingPool(max_slabs=2, min_slab_bytes=4096)
    for i in range(50):
        staged = pool.stage(_step(i))
        staged.wait()
        assert staged.tensor(0).tolist() == [i] * 64
        assert staged.tensor(1).dtype == torch.bfloat16
        assert staged.tensor(1).float().eq(i).all()
        del staged
    stats = pool.stats()
    assert stats.allocations == 1
    assert stats.reuses == 49
    assert stats.bytes_staged == 50 * (64 * 8 + 24 * 2)
    assert stats.waits == 0


def _views(staged: Any) -> dict[str, Callable[[], Any]]:
    return {
        "buffer": lambda: staged.buffer(0),
        "array": lambda: pa.Array.from_buffers(pa.int64(), 64, [None, staged.buffer(0)]),
        "batch": lambda: pa.record_batch(
            [pa.Array.from_buffers(pa.int64(), 64, [None, staged.buffer(0)])], names=["x"]
        ),
        "numpy": lambda: staged.numpy(0),
        "tensor": lambda: staged.tensor(0),
    }


@pytest.mark.parametrize("kind", ["buffer", "array", "batch", "numpy", "tensor"])
def test_staging_pool_never_overwrites_a_live_view(kind: str) -> None:
    pool = StagingPool(max_slabs=3, min_slab_bytes=4096)
    staged = pool.stage(_step(7))
    view = _views(staged)[kind]()
    address = staged.buffer(0).address
    del staged
    gc.collect()
    assert pool.free_slabs() == 0  # the view holds the slab
    later = pool.stage(_step(8))
    assert later.buffer(0).address != address
    values = {
        "buffer": lambda v: np.frombuffer(v, np.int64),
        "array": lambda v: v.to_numpy(),
        "batch": lambda v: v.column(0).to_numpy(),
        "numpy": lambda v: v,
        "tensor": lambda v: v.numpy(),
    }[kind](view)
    assert (np.asarray(values) == 7).all()
    del view, values, later
    gc.collect()
    assert pool.free_slabs() == 2
    assert pool.stats().allocations == 2


def test_staging_pool_bounded_waits_then_refuses() -> None:
    pool = StagingPool(max_slabs=1, min_slab_bytes=4096, timeout=0.2)
    held = pool.stage(_step(1))
    with pytest.raises(ao.UnsupportedValueError, match="max_slabs=1"):
        pool.stage(_step(2))
    assert pool.stats().waits == 1
    # A slab released by another thread unblocks a waiting staging.
    pool.timeout = 10.0

    def release() -> None:
        time.sleep(0.2)
        nonlocal held
        del held

    threading.Thread(target=release).start()
    start = time.monotonic()
    staged = pool.stage(_step(3))
    assert time.monotonic() - start < 5
    assert staged.tensor(0).tolist() == [3] * 64
    assert pool.stats().allocations == 1


def test_staging_pool_grows_a_slab_for_a_larger_step() -> None:
    pool = StagingPool(max_slabs=1, min_slab_bytes=256)
    small = pool.stage([torch.zeros(8)])
    del small
    big = pool.stage([torch.arange(10_000)])
    assert big.tensor(0)[-1].item() == 9_999
    stats = pool.stats()
    assert stats.slabs == 1
    assert stats.allocations == 2


def test_staging_pool_arguments_are_checked() -> None:
    with pytest.raises(ao.FieldTypeError):
        StagingPool(max_slabs=0)
    with pytest.raises(ao.FieldTypeError):
        StagingPool().stage([np.zeros(2)])


@pytest.mark.gpu
def test_staging_pool_on_cuda(cuda_device: Any) -> None:
    pool = StagingPool(max_slabs=2)
    src = [torch.arange(1000, device=cuda_device), torch.ones(5, device=cuda_device).bfloat16()]
    staged = pool.stage(src)
    staged.wait()
    assert staged.tensor(0).tolist() == list(range(1000))
    assert staged._lease.slab.is_pinned()
    assert staged.tensor(1).dtype == torch.bfloat16
    back = buffer_to_tensor(staged.buffer(0), "int64", (1000,), device=cuda_device)
    assert torch.equal(back, src[0])
    del staged, back
    gc.collect()
    for _ in range(5):
        pool.stage(src).wait()
    assert pool.stats().allocations == 1


def test_staging_pool_picks_among_free_slabs_of_different_sizes() -> None:
    # Regression: list.remove compared slabs (tensors) with == and raised on other sizes.
    pool = StagingPool(max_slabs=3, min_slab_bytes=256)
    small, big = pool.stage([torch.zeros(8)]), pool.stage([torch.zeros(100_000)])
    del small, big
    gc.collect()
    assert pool.free_slabs() == 2
    again = pool.stage([torch.arange(50_000)])  # fits only the big one, listed second
    assert again.tensor(0)[-1].item() == 49_999
    tiny = pool.stage([torch.ones(4)])  # the small one
    assert tiny.tensor(0).tolist() == [1.0] * 4
    assert pool.stats().allocations == 2


@pytest.mark.parametrize("path", [pytest.param("c", marks=needs_c), "python"])
def test_staging_pool_copies_every_host_layout_exactly(path: str) -> None:
    # Contiguous host tensors are copied byte for byte (bool, bfloat16 and autograd ones too;
    # copy_from_address in C, its ctypes twin on the pure path); the rest (strided views, lazy
    # conjugates and negations, whose bytes are not their values) through torch. Every one
    # lands row-major, as its values.
    tensors = [
        torch.arange(12).reshape(3, 4).T,
        torch.tensor([True, False, True]),
        torch.randn(4, 3).bfloat16().T,
        torch.randn(3, requires_grad=True),
        torch.randn(9)[::2],
        torch.tensor([1 + 2j, 3 - 1j]).conj(),
        torch._neg_view(torch.arange(3.0)),  # contiguous, but its bytes are the negation's input
        torch.tensor(5, dtype=torch.int16),
        torch.zeros(0, 3),
    ]
    with codec_on(path):
        staged = StagingPool().stage(tensors)
    arrays = staged.arrays()
    for i, t in enumerate(tensors):
        want = t.detach().resolve_conj().resolve_neg()
        got = staged.tensor(i)
        assert got.dtype == t.dtype
        assert torch.equal(got, want)
        bits = want.view(torch.uint16) if t.dtype == torch.bfloat16 else want
        assert np.array_equal(arrays[i], bits.numpy())


def test_staged_arrays_keep_the_slab_leased() -> None:
    pool = StagingPool(max_slabs=2, min_slab_bytes=4096)
    staged = pool.stage(_step(4))
    ids, bf16_bits = staged.arrays()
    assert ids.ctypes.data == staged.buffer(0).address
    assert bf16_bits.dtype == np.uint16
    assert bf16_bits.shape == (8, 3)
    del staged
    gc.collect()
    assert pool.free_slabs() == 0  # the arrays hold the lease
    assert (ids == 4).all()
    del bf16_bits
    gc.collect()
    assert pool.free_slabs() == 0
    del ids
    gc.collect()
    assert pool.free_slabs() == 1


def test_staging_pool_lease_ending_inside_acquire_does_not_deadlock() -> None:
    # The cycle collector can free a batch (and so end its slab's lease) at any allocation,
    # including the ones _acquire makes while it holds the pool's lock.
    from arrow_outputs import device

    pool = StagingPool(max_slabs=4, min_slab_bytes=64, pin=False)
    leased = pool._acquire(64, 0)
    holder = [device._Lease(pool, leased)]

    class Trap(device._Slab):
        """A free slab whose size, read under the lock, drops the last lease."""

        __slots__ = ()

        def __getattribute__(self, name: str) -> Any:
            if name == "nbytes":
                holder.clear()
            return object.__getattribute__(self, name)

    with pool._lock:  # two free slabs: _acquire reads every free slab's size
        for _ in range(2):
            pool._free.append(Trap(torch.empty(32, dtype=torch.uint8)))
            pool._count += 1
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(pool._acquire(64, 0)), daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "deadlocked"
    assert got[0] is leased  # the slab its lease gave back while _acquire held the lock
    assert holder == []
