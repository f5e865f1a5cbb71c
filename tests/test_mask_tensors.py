"""SamplingMaskTensors (V2 runner masks on the device) -> CSR lists and Arrow, vectorised.

The reference is vLLM's own per-row loop, re-implemented below from
``vllm/v1/worker/gpu/sample/output.py`` (vLLM 0.33, ``SamplingMaskTensors.tolists``):
``tolists`` must equal it field by field, dtypes included, and ``mask_tensors_to_arrow``
must equal ``sampling_masks_to_arrow`` of its result.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from unittest import mock

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arrow_outputs as ao
from arrow_outputs import mask_tensors as mt
from arrow_outputs.mask_tensors import (
    MAX_COMPACT_SUPPORT,
    SamplingMaskTensors,
    mask_array_supports,
    mask_tensors_to_arrow,
)
from arrow_outputs.masks import SAMPLING_MASK_TYPE, sampling_masks_from_arrow
from arrow_outputs.outputs import SamplingMaskLists

# vLLM 0.33's per-row SamplingMaskTensors.tolists, as the benchmark copies it (one copy).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_masks import vllm_tolists as vllm_tolists_reference

# Every test here runs on the C accelerator and on the pure-Python path.
pytestmark = pytest.mark.usefixtures("codec_path")

torch = pytest.importorskip("torch")

INF = float("inf")
# Both ways of gathering the compact rows: the boolean mask (dense rows) and the index.
GATHER_RATIOS = (10**9, 0)


# ----------------------------------------------------------------------------- reference


def brute_force_supports(logits, cu_num_logits, num_sampled, rows_per_request):
    """Per output row, ``torch.nonzero(torch.isfinite(row))`` of its logits row, or None."""
    out = []
    for q in range(len(num_sampled)):
        for s in range(rows_per_request):
            if s < int(num_sampled[q]):
                row = logits[int(cu_num_logits[q]) + s]
                out.append(torch.nonzero(torch.isfinite(row)).flatten().to(torch.int32))
            else:
                out.append(None)
    return out


def assert_lists_equal(got: SamplingMaskLists, want: SamplingMaskLists) -> None:
    assert type(got) is SamplingMaskLists
    assert got.token_ids.dtype == want.token_ids.dtype == np.int32
    assert got.offsets.dtype == want.offsets.dtype == np.int64
    np.testing.assert_array_equal(got.token_ids, want.token_ids)
    np.testing.assert_array_equal(got.offsets, want.offsets)
    assert got.cu_num_generated_tokens == want.cu_num_generated_tokens
    if want.cu_num_generated_tokens is not None:
        assert all(type(v) is int for v in got.cu_num_generated_tokens)


# ----------------------------------------------------------------------------- strategies


@st.composite
def kernel_masks(draw, *, max_vocab: int = 300):
    """A SamplingMaskTensors as the kernel leaves it, and the matching num_sampled.

    Unsampled slots have count 0 and garbage ids and bits (torch.empty in vLLM); compact
    slots past a row's count hold garbage; the last byte's bits past the vocabulary are set
    at random (vLLM's unpack ignores them)."""
    vocab = draw(st.integers(1, max_vocab))
    width = draw(st.integers(0, min(vocab, 70)))
    rpr = draw(st.sampled_from([1, 1, 2, 3, 5]))
    num_reqs = draw(st.integers(0, 6))
    num_sampled = np.array(
        draw(st.lists(st.integers(0, rpr), min_size=num_reqs, max_size=num_reqs)), dtype=np.int32
    )
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = num_reqs * rpr
    nbytes = (vocab + 7) // 8
    token_ids = rng.integers(-(2**31), 2**31 - 1, (rows, width), dtype=np.int32)
    packed = rng.integers(0, 256, (rows, nbytes), dtype=np.uint8)
    counts = np.zeros(rows, dtype=np.int32)
    for r in range(rows):
        if r % rpr >= num_sampled[r // rpr]:
            continue  # not sampled: count 0, the rest left as garbage
        kind = draw(st.sampled_from(["empty", "compact", "full", "wide", "all"]))
        size = {
            "empty": 0,
            "compact": int(rng.integers(0, width + 1)),
            "full": width,
            "wide": int(rng.integers(min(width + 1, vocab), vocab + 1)),
            "all": vocab,
        }[kind]
        ids = np.sort(rng.choice(vocab, size=size, replace=False)).astype(np.int32)
        member = np.zeros(nbytes * 8, dtype=np.uint8)
        member[ids] = 1
        member[vocab:] = rng.integers(0, 2, nbytes * 8 - vocab)  # ignored padding bits
        packed[r] = np.packbits(member, bitorder="little")
        counts[r] = size
        k = min(size, width)
        token_ids[r, :k] = ids[:k]
    masks = SamplingMaskTensors(
        torch.from_numpy(token_ids),
        torch.from_numpy(packed),
        torch.from_numpy(counts),
        vocab,
        rpr,
    )
    return masks, num_sampled


@st.composite
def logits_batches(draw):
    """Logits with -inf, +inf, NaN and ties, a request layout and the sampled counts."""
    vocab = draw(st.integers(1, 200))
    rpr = draw(st.sampled_from([1, 1, 2, 4]))
    num_reqs = draw(st.integers(0, 5))
    num_sampled = draw(st.lists(st.integers(0, rpr), min_size=num_reqs, max_size=num_reqs))
    # Each request owns at least as many logits rows as it sampled (draft tokens + 1).
    num_logits = [n + draw(st.integers(0, 2)) for n in num_sampled]
    cu = np.concatenate(([0], np.cumsum(num_logits))).astype(np.int32)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = int(cu[-1])
    # Few distinct values, so top-k boundaries tie often.
    values = rng.integers(-3, 4, (n, vocab)).astype(np.float32)
    special = rng.choice(
        np.array([-INF, INF, np.nan, 0.0], dtype=np.float32),
        size=(n, vocab),
        p=[0.5, 0.02, 0.03, 0.45],
    )
    values = np.where(special == 0.0, values, special)
    density = draw(st.sampled_from([0.0, 0.05, 0.5, 1.0]))
    values[rng.random((n, vocab)) > density] = -INF
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    max_num_kept = draw(st.integers(0, vocab + 5))
    return (
        torch.from_numpy(values).to(dtype),
        torch.from_numpy(cu),
        torch.tensor(num_sampled, dtype=torch.int32),
        max_num_kept,
        rpr,
    )


def check_from_logits(masks, logits, cu, ns, max_num_kept, rpr):
    vocab = logits.shape[1]
    width = min(max_num_kept, vocab, MAX_COMPACT_SUPPORT)
    rows = len(ns) * rpr
    assert masks.vocab_size == vocab
    assert masks.rows_per_request == rpr
    assert masks.token_ids.shape == (rows, width)
    assert masks.token_ids.dtype == torch.int32
    assert masks.packed_mask.shape == (rows, (vocab + 7) // 8)
    assert masks.packed_mask.dtype == torch.uint8
    assert masks.counts.shape == (rows,)
    assert masks.counts.dtype == torch.int32
    packed = masks.packed_mask.numpy()
    for r, want in enumerate(brute_force_supports(logits, cu, ns, rpr)):
        if want is None:
            assert int(masks.counts[r]) == 0
            continue
        assert int(masks.counts[r]) == len(want)
        k = min(len(want), width)
        assert masks.token_ids[r, :k].tolist() == want[:k].tolist()
        bits = np.unpackbits(packed[r], bitorder="little")
        assert np.flatnonzero(bits).tolist() == want.tolist()  # padding bits are 0 too
    got = masks.tolists(ns.numpy())
    assert_lists_equal(got, vllm_tolists_reference(masks, ns.numpy()))
    want_rows = [w for w in brute_force_supports(logits, cu, ns, rpr) if w is not None or rpr == 1]
    assert got.to_nested_list() == [[] if w is None else w.tolist() for w in want_rows]


# ----------------------------------------------------------------------------- tolists


@settings(max_examples=300, deadline=None)
@given(kernel_masks())
def test_tolists_matches_vllm_loop(case):
    masks, num_sampled = case
    want = vllm_tolists_reference(masks, num_sampled)
    for ratio in GATHER_RATIOS:
        with mock.patch.object(mt, "_MASK_GATHER_MAX_RATIO", ratio):
            assert_lists_equal(masks.tolists(num_sampled), want)


@settings(max_examples=300, deadline=None)
@given(kernel_masks())
def test_mask_tensors_to_arrow_matches_sampling_masks_to_arrow(case):
    masks, num_sampled = case
    want = ao.sampling_masks_to_arrow(vllm_tolists_reference(masks, num_sampled))
    for ratio in GATHER_RATIOS:
        with mock.patch.object(mt, "_MASK_GATHER_MAX_RATIO", ratio):
            got = mask_tensors_to_arrow(masks, num_sampled)
            got.validate(full=True)
            assert got.type == SAMPLING_MASK_TYPE
            assert got.equals(want)
            assert got.offsets.equals(want.offsets)
            assert got.values.offsets.equals(want.values.offsets)


@settings(max_examples=150, deadline=None)
@given(kernel_masks())
def test_mask_array_supports_are_the_arrays_buffers(case):
    # AsyncArrowOutput's route: the same ids and offsets from the fields as numpy arrays.
    masks, num_sampled = case
    want = mask_tensors_to_arrow(masks, num_sampled)
    ids, inner, outer = mask_array_supports(
        masks.token_ids.numpy(),
        masks.packed_mask.numpy(),
        masks.counts.numpy(),
        masks.vocab_size,
        masks.rows_per_request,
        num_sampled,
    )
    assert (ids.dtype, inner.dtype, outer.dtype) == (np.int32, np.int64, np.int32)
    assert ids.tolist() == want.values.values.to_pylist()
    assert inner.tolist() == want.values.offsets.to_pylist()
    assert outer.tolist() == want.offsets.to_pylist()


@settings(max_examples=50, deadline=None)
@given(kernel_masks(max_vocab=80), st.sampled_from(["numpy", "tensor", "list"]))
def test_tolists_num_sampled_tokens_kinds(case, kind):
    masks, num_sampled = case
    given_ns = {
        "numpy": num_sampled,
        "tensor": torch.from_numpy(num_sampled),
        "list": num_sampled.tolist(),
    }[kind]
    assert_lists_equal(masks.tolists(given_ns), vllm_tolists_reference(masks, num_sampled))


def test_tolists_one_row_per_request_keeps_every_row_and_no_cu():
    masks = SamplingMaskTensors(
        torch.tensor([[4, 6], [0, 0], [1, 0]], dtype=torch.int32),
        torch.zeros((3, 1), dtype=torch.uint8),
        torch.tensor([2, 0, 1], dtype=torch.int32),
        8,
    )
    for ns in (None, np.array([1, 0, 1], dtype=np.int32)):
        got = masks.tolists(ns)
        assert got.cu_num_generated_tokens is None
        assert got.to_nested_list() == [[4, 6], [], [1]]
        assert_lists_equal(got, vllm_tolists_reference(masks, ns))


def test_tolists_several_rows_per_request_keeps_sampled_slots():
    # Request 0 sampled 2 of 3 slots, request 1 none, request 2 all three; slot 2 of
    # request 0 holds a stale count that must be ignored.
    counts = torch.tensor([1, 2, 5, 0, 0, 0, 1, 1, 1], dtype=torch.int32)
    token_ids = torch.arange(27, dtype=torch.int32).reshape(9, 3)
    masks = SamplingMaskTensors(token_ids, torch.zeros((9, 1), dtype=torch.uint8), counts, 8, 3)
    got = masks.tolists(np.array([2, 0, 3]))
    assert got.cu_num_generated_tokens == [0, 2, 2, 5]
    assert got.to_nested_list() == [[0], [3, 4], [18], [21], [24]]


def test_tolists_wide_row_reads_bitmask_ascending():
    vocab = 20
    ids = [1, 3, 4, 9, 17, 19]
    member = np.zeros(24, np.uint8)
    member[ids] = 1
    packed = torch.from_numpy(np.packbits(member, bitorder="little")[None, :])
    masks = SamplingMaskTensors(
        torch.tensor([[1, 3, 4]], dtype=torch.int32),
        packed,
        torch.tensor([6], dtype=torch.int32),
        vocab,
    )
    assert masks.tolists().token_ids.tolist() == ids
    assert mask_tensors_to_arrow(masks).to_pylist() == [[ids]]


def test_tolists_empty_batch():
    masks = SamplingMaskTensors(
        torch.zeros((0, 4), dtype=torch.int32),
        torch.zeros((0, 2), dtype=torch.uint8),
        torch.zeros(0, dtype=torch.int32),
        16,
        2,
    )
    got = masks.tolists(np.zeros(0, np.int32))
    assert_lists_equal(got, vllm_tolists_reference(masks, np.zeros(0, np.int32)))
    assert got.cu_num_generated_tokens == [0]
    assert len(mask_tensors_to_arrow(masks, np.zeros(0, np.int32))) == 0


def test_mask_tensors_to_arrow_round_trips_through_sampling_masks_from_arrow():
    logits = torch.tensor([[0.0, -INF, 1.0, 2.0], [-INF] * 4, [float("nan"), 1, 1, 1]])
    masks = SamplingMaskTensors.from_logits(
        logits, torch.tensor([0, 2, 3]), torch.tensor([2, 1]), 2, rows_per_request=2
    )
    arr = mask_tensors_to_arrow(masks, np.array([2, 1]))
    assert arr.to_pylist() == [[[0, 2, 3], []], [[1, 2, 3]]]
    back = sampling_masks_from_arrow(arr)
    assert_lists_equal(back, masks.tolists(np.array([2, 1])))


def test_mask_tensors_to_arrow_accepts_numpy_fields_and_vllm_like_objects():
    fields = {
        "token_ids": np.array([[2, 5], [0, 0]], np.int32),
        "packed_mask": np.zeros((2, 1), np.uint8),
        "counts": np.array([2, 0], np.int32),
        "vocab_size": 8,
        "rows_per_request": 1,
    }
    like_vllm = types.SimpleNamespace(**fields)  # vLLM's class, by attribute names
    assert mask_tensors_to_arrow(like_vllm).to_pylist() == [[[2, 5]], [[]]]
    assert mask_tensors_to_arrow(SamplingMaskTensors(**fields)).equals(
        mask_tensors_to_arrow(like_vllm)
    )


def test_mask_tensors_to_arrow_ids_buffer_is_not_copied_again():
    masks = SamplingMaskTensors(
        torch.tensor([[2, 5], [1, 0]], dtype=torch.int32),
        torch.zeros((2, 1), dtype=torch.uint8),
        torch.tensor([2, 1], dtype=torch.int32),
        8,
    )
    arr = mask_tensors_to_arrow(masks)
    back = sampling_masks_from_arrow(arr, cu_num_generated_tokens=False)
    # The decoder's views sit on the buffers the encoder made: one copy of the ids in all.
    assert back.token_ids.ctypes.data == arr.values.values.buffers()[1].address
    assert back.offsets.ctypes.data == arr.values.buffers()[1].address


# ----------------------------------------------------------------------------- from_logits


@settings(max_examples=150, deadline=None)
@given(logits_batches())
def test_from_logits_matches_brute_force(case):
    logits, cu, ns, max_num_kept, rpr = case
    masks = SamplingMaskTensors.from_logits(logits, cu, ns, max_num_kept, rpr)
    check_from_logits(masks, logits, cu, ns, max_num_kept, rpr)


def test_from_logits_chunked_equals_whole(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 50, generator=gen)
    logits[torch.rand(7, 50, generator=gen) < 0.6] = -INF
    cu, ns = torch.arange(8, dtype=torch.int32), torch.ones(7, dtype=torch.int32)
    whole = SamplingMaskTensors.from_logits(logits, cu, ns, 10)
    monkeypatch.setattr(mt, "_CHUNK_ELEMENTS", 60)  # one row per chunk
    chunked = SamplingMaskTensors.from_logits(logits, cu, ns, 10)
    for a, b in zip(whole[:3], chunked[:3]):
        assert torch.equal(a, b)


def test_from_logits_keeps_ties_at_top_k_boundary():
    # A top-k=2 sampler that keeps ties leaves four finite logits: the support is all four,
    # wider than the compact row, so it comes from the bitmask.
    logits = torch.tensor([[5.0, 3.0, -INF, 3.0, 3.0, -INF]])
    masks = SamplingMaskTensors.from_logits(logits, torch.tensor([0, 1]), torch.tensor([1]), 2)
    assert masks.counts.tolist() == [4]
    assert masks.token_ids.tolist() == [[0, 1]]
    assert masks.tolists().token_ids.tolist() == [0, 1, 3, 4]


def test_from_logits_all_neg_inf_row_is_empty():
    logits = torch.full((2, 9), -INF)
    logits[1, 4] = 0.0
    masks = SamplingMaskTensors.from_logits(
        logits, torch.tensor([0, 1, 2]), torch.tensor([1, 1]), 9
    )
    assert masks.counts.tolist() == [0, 1]
    assert masks.packed_mask[0].tolist() == [0, 0]
    assert masks.tolists().to_nested_list() == [[], [4]]


def test_from_logits_nan_and_pos_inf_are_not_kept():
    logits = torch.tensor([[float("nan"), INF, 1.0, -INF, 0.0]])
    masks = SamplingMaskTensors.from_logits(logits, torch.tensor([0, 1]), torch.tensor([1]), 5)
    assert masks.tolists().token_ids.tolist() == [2, 4]


def test_from_logits_vocab_one():
    logits = torch.tensor([[1.0], [-INF]])
    masks = SamplingMaskTensors.from_logits(
        logits, torch.tensor([0, 1, 2]), torch.tensor([1, 1]), 50
    )
    assert masks.token_ids.shape == (2, 1)
    assert masks.packed_mask.shape == (2, 1)
    assert masks.packed_mask.tolist() == [[1], [0]]
    assert masks.tolists().to_nested_list() == [[0], []]


@pytest.mark.parametrize(("max_num_kept", "width"), [(10**6, MAX_COMPACT_SUPPORT), (5, 5)])
def test_from_logits_width_clamped(max_num_kept, width):
    vocab = MAX_COMPACT_SUPPORT + 1000
    logits = torch.zeros(1, vocab)
    masks = SamplingMaskTensors.from_logits(
        logits, torch.tensor([0, 1]), torch.tensor([1]), max_num_kept
    )
    assert masks.token_ids.shape == (1, width)
    assert masks.counts.tolist() == [vocab]
    assert masks.token_ids[0].tolist() == list(range(width))
    got = masks.tolists()
    assert got.token_ids.tolist() == list(range(vocab))
    assert_lists_equal(got, vllm_tolists_reference(masks))


def test_from_logits_width_clamped_by_vocab():
    masks = SamplingMaskTensors.from_logits(
        torch.zeros(1, 3), torch.tensor([0, 1]), torch.tensor([1]), 100
    )
    assert masks.token_ids.shape == (1, 3)


def test_from_logits_reads_cu_num_logits_rows():
    # Request 0 owns logits rows 0..2 and sampled 2 (rows 0 and 1), request 1 owns row 3.
    logits = torch.full((4, 4), -INF)
    for i in range(4):
        logits[i, i] = 0.0
    masks = SamplingMaskTensors.from_logits(
        logits, torch.tensor([0, 3, 4]), torch.tensor([2, 1]), 4, rows_per_request=3
    )
    assert masks.counts.tolist() == [1, 1, 0, 1, 0, 0]
    got = masks.tolists(np.array([2, 1]))
    assert got.to_nested_list() == [[0], [1], [3]]
    assert got.cu_num_generated_tokens == [0, 2, 3]


def test_from_logits_accepts_cu_without_last_entry_and_strided_logits():
    base = torch.tensor([[0.0, -INF, 1.0, -INF], [-INF, 2.0, -INF, 0.0]])
    logits = base.t().contiguous().t()  # column-major: the kernel reads by stride too
    masks = SamplingMaskTensors.from_logits(logits, torch.tensor([0, 1]), torch.tensor([1, 1]), 4)
    assert masks.tolists().to_nested_list() == [[0, 2], [1, 3]]


# ----------------------------------------------------------------------------- cat, copy


def test_cat_joins_chunks_in_order():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 30, generator=gen)
    logits[torch.rand(6, 30, generator=gen) < 0.5] = -INF
    cu = torch.tensor([0, 2, 4, 6])
    ns = torch.tensor([2, 1, 2])
    whole = SamplingMaskTensors.from_logits(logits, cu, ns, 8, 2)
    a = SamplingMaskTensors.from_logits(logits[:2], cu[:2], ns[:1], 8, 2)
    b = SamplingMaskTensors.from_logits(logits[2:], cu[1:] - 2, ns[1:], 8, 2)
    joined = SamplingMaskTensors.cat([a, b])
    assert type(joined) is SamplingMaskTensors
    assert torch.equal(joined.counts, whole.counts)
    assert torch.equal(joined.packed_mask, whole.packed_mask)
    assert (joined.vocab_size, joined.rows_per_request) == (30, 2)
    assert_lists_equal(joined.tolists(ns.numpy()), whole.tolists(ns.numpy()))


def test_cat_refuses_mixed_layouts():
    a = SamplingMaskTensors.from_logits(
        torch.zeros(1, 8), torch.tensor([0, 1]), torch.tensor([1]), 4
    )
    b = SamplingMaskTensors.from_logits(
        torch.zeros(1, 9), torch.tensor([0, 1]), torch.tensor([1]), 4
    )
    with pytest.raises(ao.ConsistencyError, match=r"^chunks\[1\]\.vocab_size: "):
        SamplingMaskTensors.cat([a, b])
    with pytest.raises(ao.ConsistencyError, match=r"^chunks\[1\]\.rows_per_request: "):
        SamplingMaskTensors.cat([a, a._replace(rows_per_request=2)])
    c = SamplingMaskTensors.from_logits(
        torch.zeros(1, 8), torch.tensor([0, 1]), torch.tensor([1]), 3
    )
    with pytest.raises(ao.ShapeError, match=r"^chunks\[1\]\.token_ids: "):
        SamplingMaskTensors.cat([a, c])
    with pytest.raises(ao.ShapeError, match=r"^chunks: "):
        SamplingMaskTensors.cat([])


def test_to_cpu_nonblocking_on_cpu_returns_usable_tensors():
    logits = torch.tensor([[0.0, -INF, 1.0]])
    masks = SamplingMaskTensors.from_logits(logits, torch.tensor([0, 1]), torch.tensor([1]), 3)
    host = masks.to_cpu_nonblocking()
    assert host is masks
    assert host.tolists().token_ids.tolist() == [0, 2]
    assert mask_tensors_to_arrow(host).to_pylist() == [[[0, 2]]]


def test_from_logits_on_cuda_matches_cpu(cuda_device):
    gen = torch.Generator().manual_seed(2)
    vocab = 40_003  # several of the kernel's 8192-wide blocks, not a multiple of 8
    logits = torch.randn(12, vocab, generator=gen)
    logits[torch.rand(12, vocab, generator=gen) < 0.9] = -INF
    logits[0, :] = -INF
    logits[1, 5] = float("nan")
    cu = torch.tensor([0, 3, 6, 9, 12], dtype=torch.int32)
    ns = torch.tensor([3, 0, 2, 1], dtype=torch.int32)
    cpu = SamplingMaskTensors.from_logits(logits, cu, ns, 1000, 3)
    dev = SamplingMaskTensors.from_logits(
        logits.to(cuda_device), cu.to(cuda_device), ns.to(cuda_device), 1000, 3
    )
    assert dev.token_ids.device.type == "cuda"
    host = dev.to_cpu_nonblocking()
    torch.cuda.synchronize()
    assert torch.equal(host.counts, cpu.counts)
    assert torch.equal(host.packed_mask, cpu.packed_mask)
    active = [r for r in range(12) if r % 3 < int(ns[r // 3])]
    for r in active:
        k = min(int(cpu.counts[r]), 1000)
        assert torch.equal(host.token_ids[r, :k], cpu.token_ids[r, :k])
    assert mask_tensors_to_arrow(host, ns.numpy()).equals(mask_tensors_to_arrow(cpu, ns.numpy()))
    assert_lists_equal(dev.tolists(ns.numpy()), cpu.tolists(ns.numpy()))
    with pytest.raises(ao.UnsupportedValueError, match=r"sampling_mask_tensors\.token_ids"):
        mask_tensors_to_arrow(dev, ns.numpy())
    with pytest.raises(ao.ConsistencyError, match=r"^num_sampled_tokens: "):
        SamplingMaskTensors.from_logits(logits.to(cuda_device), cu.to(cuda_device), ns, 10, 3)


# ----------------------------------------------------------------------------- bad inputs


def _masks(**change):
    fields = {
        "token_ids": torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
        "packed_mask": torch.zeros((2, 1), dtype=torch.uint8),
        "counts": torch.tensor([2, 1], dtype=torch.int32),
        "vocab_size": 8,
        "rows_per_request": 1,
    }
    fields.update(change)
    return SamplingMaskTensors(**fields)


BAD_FIELDS = [
    ({"token_ids": torch.zeros((2, 2), dtype=torch.int64)}, ao.DTypeError, "token_ids"),
    ({"packed_mask": torch.zeros((2, 1), dtype=torch.int8)}, ao.DTypeError, "packed_mask"),
    ({"counts": torch.zeros(2, dtype=torch.int64)}, ao.DTypeError, "counts"),
    ({"token_ids": torch.zeros(2, dtype=torch.int32)}, ao.ShapeError, "token_ids"),
    ({"counts": torch.zeros((2, 1), dtype=torch.int32)}, ao.ShapeError, "counts"),
    ({"counts": torch.zeros(3, dtype=torch.int32)}, ao.ShapeError, "sampling_mask_tensors"),
    (
        {"packed_mask": torch.zeros((2, 2), dtype=torch.uint8)},
        ao.ShapeError,
        "sampling_mask_tensors",
    ),
    ({"vocab_size": 9}, ao.ShapeError, "sampling_mask_tensors"),
    ({"vocab_size": 8.0}, ao.FieldTypeError, "vocab_size"),
    ({"rows_per_request": 0}, ao.ShapeError, "rows_per_request"),
    ({"rows_per_request": 4}, ao.ShapeError, "counts"),
    (
        {"counts": torch.tensor([3, 1], dtype=torch.int32)},
        ao.ConsistencyError,
        r"packed_mask\[0\]",
    ),
    ({"counts": torch.tensor([2, -1], dtype=torch.int32)}, ao.ConsistencyError, r"counts\[1\]"),
    ({"token_ids": [[1, 2], [3, 0]]}, ao.FieldTypeError, "token_ids"),
]


@pytest.mark.parametrize(("change", "error", "field"), BAD_FIELDS)
def test_tolists_and_to_arrow_refuse_bad_fields(change, error, field):
    masks = _masks(**change)
    for convert in (masks.tolists, lambda: mask_tensors_to_arrow(masks)):
        with pytest.raises(error, match=rf"^[^:]*{field}[^:]*: expected "):
            convert()


@pytest.mark.parametrize(("change", "error", "field"), BAD_FIELDS)
def test_mask_array_supports_refuses_the_same_bad_fields(change, error, field):
    masks = _masks(**change)
    parts = [
        x.numpy() if isinstance(x, torch.Tensor) else x
        for x in (masks.token_ids, masks.packed_mask, masks.counts)
    ]
    with pytest.raises(error, match=rf"^[^:]*{field}[^:]*: expected "):
        mask_array_supports(*parts, masks.vocab_size, masks.rows_per_request)


def test_wide_count_with_too_few_bits_raises_consistency_error():
    member = np.zeros(16, np.uint8)
    member[[2, 7, 11]] = 1
    packed = torch.from_numpy(np.packbits(member, bitorder="little")).reshape(1, 2)
    masks = SamplingMaskTensors(
        torch.tensor([[2, 7]], dtype=torch.int32), packed, torch.tensor([4], dtype=torch.int32), 16
    )
    with pytest.raises(ao.ConsistencyError, match=r"packed_mask\[0\]: expected 4 set bits.*got 3"):
        mask_tensors_to_arrow(masks)


@pytest.mark.parametrize(
    ("ns", "error", "match"),
    [
        (None, ao.ConsistencyError, r"^num_sampled_tokens: expected 2 counts"),
        (np.array([1, 1, 1]), ao.ShapeError, r"^num_sampled_tokens: expected 2 counts"),
        (np.array([[1, 1]]), ao.ShapeError, r"^num_sampled_tokens: "),
        (np.array([1.0, 1.0]), ao.DTypeError, r"^num_sampled_tokens: "),
        ([1.5, 1], ao.DTypeError, r"^num_sampled_tokens: "),
        ([True, False], ao.DTypeError, r"^num_sampled_tokens: "),
        (
            np.array([3, 1]),
            ao.ConsistencyError,
            r"^num_sampled_tokens\[0\]: expected a count within 0..2",
        ),
        (np.array([1, -1]), ao.ConsistencyError, r"^num_sampled_tokens\[1\]: "),
        ("12", ao.FieldTypeError, r"^num_sampled_tokens: "),
    ],
)
def test_num_sampled_tokens_checked(ns, error, match):
    masks = SamplingMaskTensors(
        torch.zeros((4, 2), dtype=torch.int32),
        torch.zeros((4, 1), dtype=torch.uint8),
        torch.zeros(4, dtype=torch.int32),
        8,
        2,
    )
    with pytest.raises(error, match=match):
        masks.tolists(ns)
    with pytest.raises(error, match=match):
        mask_tensors_to_arrow(masks, ns)


def test_num_sampled_tokens_length_checked_with_one_row_per_request():
    with pytest.raises(ao.ShapeError, match=r"^num_sampled_tokens: expected 2 counts"):
        _masks().tolists(np.array([1, 1, 1]))


def test_mask_tensors_to_arrow_refuses_non_masks_and_device_tensors():
    with pytest.raises(ao.FieldTypeError, match=r"^sampling_mask_tensors: expected a Sampling"):
        mask_tensors_to_arrow(object())
    meta = _masks(counts=torch.zeros(2, dtype=torch.int32, device="meta"))
    with pytest.raises(ao.UnsupportedValueError, match=r"^sampling_mask_tensors\.counts: "):
        mask_tensors_to_arrow(meta)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((torch.zeros(2, 4, dtype=torch.int32), [0, 1, 2], [1, 1], 4), ao.DTypeError, r"^logits: "),
        ((torch.zeros(4), [0, 1, 2], [1, 1], 4), ao.ShapeError, r"^logits: "),
        ((np.zeros((2, 4)), [0, 1, 2], [1, 1], 4), ao.FieldTypeError, r"^logits: "),
        ((torch.zeros(2, 4), [0, 1, 2, 3, 4], [1, 1], 4), ao.ShapeError, r"^cu_num_logits: "),
        (
            (torch.zeros(2, 4), torch.tensor([0.0, 1.0, 2.0]), [1, 1], 4),
            ao.DTypeError,
            r"^cu_num_logits: ",
        ),
        (
            (torch.zeros(2, 4), [0, 1, 2], torch.tensor([1, 1], dtype=torch.int16), 4),
            ao.DTypeError,
            r"^num_sampled_tokens: ",
        ),
        (
            (torch.zeros(2, 4), [0, 1, 2], torch.ones(2, 1, dtype=torch.int32), 4),
            ao.ShapeError,
            r"^num_sampled_tokens: ",
        ),
        ((torch.zeros(2, 4), [0, 1, 2], [1, 1], -1), ao.ShapeError, r"^max_num_kept: "),
        ((torch.zeros(2, 4), [0, 1, 2], [1, 1], 2.5), ao.FieldTypeError, r"^max_num_kept: "),
        (
            (torch.zeros(2, 4), [0, 2, 4], [1, 1], 4),
            ao.ConsistencyError,
            r"^cu_num_logits: .*row 2 for slot 0 of request 1",
        ),
        ((torch.zeros(2, 4), [0, -1, 2], [1, 1], 4), ao.ConsistencyError, r"^cu_num_logits: "),
        ((torch.zeros(2, 4), "01", [1, 1], 4), ao.FieldTypeError, r"^cu_num_logits: "),
    ],
)
def test_from_logits_refuses_bad_inputs(args, error, match):
    with pytest.raises(error, match=match):
        SamplingMaskTensors.from_logits(*args)


def test_from_logits_rows_per_request_checked():
    with pytest.raises(ao.ShapeError, match=r"^rows_per_request: "):
        SamplingMaskTensors.from_logits(torch.zeros(1, 4), [0, 1], [1], 4, rows_per_request=0)


def test_from_logits_without_validation_never_indexes_out_of_logits():
    masks = SamplingMaskTensors.from_logits(
        torch.zeros(2, 4), torch.tensor([0, 5, 9]), torch.tensor([1, 1]), 4, validate=False
    )
    assert masks.counts.shape == (2,)  # values unspecified, but no out-of-bounds read


def test_unsampled_slots_past_the_logits_need_no_rows():
    # The last request sampled 1 of 4 slots: its slots 1..3 would read rows 2..4, which do
    # not exist, and must not be checked.
    logits = torch.zeros(2, 3)
    masks = SamplingMaskTensors.from_logits(
        logits, torch.tensor([0, 1, 2]), torch.tensor([1, 1]), 3, rows_per_request=4
    )
    assert masks.counts.tolist() == [3, 0, 0, 0, 3, 0, 0, 0]


def test_public_exports():
    assert ao.SamplingMaskTensors is SamplingMaskTensors
    assert ao.mask_tensors_to_arrow is mask_tensors_to_arrow
    assert ao.MAX_COMPACT_SUPPORT == 2048
    assert isinstance(mask_tensors_to_arrow(_masks()), pa.ListArray)
