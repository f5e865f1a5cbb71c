"""The sampling-mask walk in C (``_speedups.mask_supports``) against its specification.

``_pyspeedups.mask_supports`` is the specification: every test that takes ``impl`` runs on
both implementations (C skipped where it was not built), the ``agree`` tests require the same
answer from both on the same input, and the references for valid answers are vLLM's per-row
loop and numpy. The last part checks that the package's mask functions take the walk when it
is built, and that errors do not depend on which path ran.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import BUILT_IMPLS as BOTH
from conftest import SPEEDUP_IMPLS as IMPLS
from conftest import impls_agree, needs_c
from hypothesis import given, settings
from hypothesis import strategies as st

import arrow_outputs as ao
from arrow_outputs import _accel
from arrow_outputs import mask_tensors as mt
from arrow_outputs.mask_tensors import SamplingMaskTensors, mask_array_supports

torch = pytest.importorskip("torch")


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> Any:
    return request.param


def agree(*args: Any) -> Any:
    """``mask_supports(*args)`` on every implementation: the same answer, or the same
    exception type."""
    return impls_agree("mask_supports", *args)


def loop_reference(tok, packed, counts, vocab, rpr, ns):
    """vLLM 0.33's per-row ``SamplingMaskTensors.tolists`` loop over numpy fields: the ids,
    the offsets and the request offsets (None with one row per request)."""
    width = tok.shape[1]
    if rpr == 1:
        rows = np.arange(len(counts))
        cu = None
    else:
        rows = np.flatnonzero(np.arange(rpr)[None, :] < np.asarray(ns)[:, None])
        cu = np.cumsum(np.concatenate(([0], ns))).tolist()
    supports = []
    for r in rows:
        if counts[r] <= width:
            supports.append(tok[r, : counts[r]])
        else:
            bits = np.unpackbits(packed[r], count=vocab, bitorder="little")
            supports.append(np.flatnonzero(bits).astype(np.int32))
    offsets = np.zeros(len(supports) + 1, np.int64)
    np.cumsum([len(s) for s in supports], out=offsets[1:])
    return np.concatenate([np.zeros(0, np.int32), *supports]), offsets, cu


def unpack(got):
    ids, offsets, cu = got
    assert type(ids) is bytearray
    assert type(offsets) is bytearray
    assert cu is None or type(cu) is bytearray
    return (
        np.frombuffer(ids, "<i4"),
        np.frombuffer(offsets, "<i8"),
        None if cu is None else np.frombuffer(cu, "<i4").tolist(),
    )


def make_case(seed: int, *, rows_per_request: int = 1, vocab: int = 200, width: int = 5):
    """Kernel-like fields: ascending compact ids, the whole support in the bitmask (and junk
    in the ignored bits past the vocabulary), garbage in unsampled slots and past counts."""
    rng = np.random.default_rng(seed)
    num_reqs = int(rng.integers(0, 7))
    rows = num_reqs * rows_per_request
    ns = rng.integers(0, rows_per_request + 1, num_reqs)
    nbytes = (vocab + 7) // 8
    tok = rng.integers(-(2**31), 2**31 - 1, (rows, width), dtype=np.int32)
    packed = rng.integers(0, 256, (rows, nbytes), dtype=np.uint8)
    counts = rng.integers(-5, 9, rows).astype(np.int32)
    for r in range(rows):
        if rows_per_request > 1 and r % rows_per_request >= ns[r // rows_per_request]:
            continue  # an unsampled slot: its count is never read
        density = rng.choice([0.0, 0.02, 0.3, 0.95, 1.0])
        member = np.zeros(nbytes * 8, np.uint8)
        member[:vocab] = rng.random(vocab) < density
        member[vocab:] = rng.integers(0, 2, nbytes * 8 - vocab)
        ids = np.flatnonzero(member[:vocab]).astype(np.int32)
        packed[r] = np.packbits(member, bitorder="little")
        counts[r] = len(ids)
        tok[r, : min(len(ids), width)] = ids[:width]
    return tok, packed, counts, vocab, rows_per_request, ns


# ----------------------------------------------------------------------------- valid input


@pytest.mark.parametrize("rpr", [1, 2, 4])
@pytest.mark.parametrize("vocab", [1, 7, 63, 64, 65, 128, 200, 1000])
@pytest.mark.parametrize("seed", range(4))
def test_mask_supports_equals_vllm_loop(impl, seed, vocab, rpr):
    tok, packed, counts, vocab, rpr, ns = make_case(seed, rows_per_request=rpr, vocab=vocab)
    want = loop_reference(tok, packed, counts, vocab, rpr, ns)
    for ns_arg in [ns.astype(np.int32), ns.astype(np.int64)] if rpr > 1 else [None, ns]:
        ids, offsets, cu = unpack(impl.mask_supports(tok, packed, counts, vocab, rpr, ns_arg))
        assert ids.tolist() == want[0].tolist()
        assert offsets.tolist() == want[1].tolist()
        assert cu == want[2]


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    rpr=st.sampled_from([1, 1, 2, 3]),
    vocab=st.integers(0, 300),
    width=st.integers(0, 12),
)
def test_mask_supports_implementations_agree(seed, rpr, vocab, width):
    case = make_case(seed, rows_per_request=rpr, vocab=vocab, width=width)
    tok, packed, counts, vocab, rpr, ns = case
    got = agree(tok, packed, counts, vocab, rpr, ns if rpr > 1 else None)
    want = loop_reference(tok, packed, counts, vocab, rpr, ns)
    ids, offsets, cu = unpack(got)
    assert (ids.tolist(), offsets.tolist(), cu) == (want[0].tolist(), want[1].tolist(), want[2])


def test_mask_supports_word_boundaries_and_dense_words(impl):
    # Ids on both sides of every 64-bit word edge, a word with every bit set (more than the
    # 8 ids written ahead), and a last word cut by the vocabulary (bits past it ignored).
    vocab = 197
    member = np.zeros(200, np.uint8)  # 25 bytes: 3 bits past the vocabulary
    member[[0, 62, 63, 64, 65, 127]] = 1
    member[128:192] = 1
    member[196] = 1
    member[197:] = 1  # past the vocabulary
    want = np.flatnonzero(member[:vocab]).astype(np.int32)
    packed = np.packbits(member, bitorder="little").reshape(1, -1)
    tok = np.zeros((1, 2), np.int32)
    counts = np.array([len(want)], np.int32)
    ids, offsets, cu = unpack(impl.mask_supports(tok, packed, counts, vocab, 1, None))
    assert ids.tolist() == want.tolist()
    assert offsets.tolist() == [0, len(want)]
    assert cu is None


def test_mask_supports_compact_ids_taken_as_they_are(impl):
    # vLLM copies a compact row without looking at it: order and range are not checked.
    tok = np.array([[9, -3, 7], [2**31 - 1, 0, 0]], np.int32)
    packed = np.zeros((2, 1), np.uint8)
    got = unpack(impl.mask_supports(tok, packed, np.array([3, 1], np.int32), 8, 1, None))
    assert got[0].tolist() == [9, -3, 7, 2**31 - 1]


def test_mask_supports_empty_and_zero_width(impl):
    for rows, width, vocab in [(0, 0, 0), (0, 4, 10), (3, 0, 10), (2, 3, 0)]:
        tok = np.zeros((rows, width), np.int32)
        packed = np.zeros((rows, (vocab + 7) // 8), np.uint8)
        counts = np.zeros(rows, np.int32)
        ids, offsets, cu = unpack(impl.mask_supports(tok, packed, counts, vocab, 1, None))
        assert ids.tolist() == []
        assert offsets.tolist() == [0] * (rows + 1)
        assert cu is None


def test_mask_supports_one_row_per_request_ignores_num_sampled_values(impl):
    tok, packed, counts, vocab, _, _ = make_case(5)
    want = impl.mask_supports(tok, packed, counts, vocab, 1, None)
    junk = np.full(len(counts), -7, np.int64)
    assert impl.mask_supports(tok, packed, counts, vocab, 1, junk) == want


def test_mask_supports_unsampled_slots_never_read(impl):
    # Slot 1 of each request was not sampled: a negative count and a huge one are ignored.
    tok = np.array([[1, 2], [0, 0], [3, 4], [0, 0]], np.int32)
    packed = np.zeros((4, 1), np.uint8)
    counts = np.array([2, -1, 1, 2**31 - 1], np.int32)
    got = unpack(impl.mask_supports(tok, packed, counts, 8, 2, np.array([1, 1])))
    assert got[0].tolist() == [1, 2, 3]
    assert got[1].tolist() == [0, 2, 3]
    assert got[2] == [0, 1, 2]


# ----------------------------------------------------------------------------- refusals


def _good():
    member = np.zeros((2, 16), np.uint8)
    member[1, [0, 5, 9, 12]] = 1  # row 1 is wide (4 ids, width 2)
    return [
        np.array([[1, 2], [0, 0]], np.int32),
        np.packbits(member, axis=1, bitorder="little"),
        np.array([2, 4], np.int32),
        16,
        1,
        None,
    ]


TOK, PACKED, COUNTS, VOCAB, RPR, NS = range(6)  # mask_supports' arguments
REFUSALS: dict[str, dict[int, Any]] = {
    "tok_int64": {TOK: np.zeros((2, 2), np.int64)},
    "tok_uint32": {TOK: np.zeros((2, 2), np.uint32)},
    "tok_1d": {TOK: np.zeros(4, np.int32)},
    "tok_rows": {TOK: np.zeros((3, 2), np.int32)},
    "tok_strided": {TOK: np.zeros((2, 4), np.int32)[:, ::2]},
    "tok_big_endian": {TOK: np.zeros((2, 2), ">i4")},
    "tok_list": {TOK: [[1, 2], [0, 0]]},
    "tok_bytes": {TOK: bytes(16)},
    "packed_int8": {PACKED: np.zeros((2, 2), np.int8)},
    "packed_bool": {PACKED: np.zeros((2, 2), np.bool_)},
    "packed_narrow": {PACKED: np.zeros((2, 1), np.uint8)},
    "packed_rows": {PACKED: np.zeros((1, 2), np.uint8)},
    "packed_fortran": {PACKED: np.asfortranarray(np.zeros((2, 2), np.uint8))},
    "counts_int64": {COUNTS: np.array([2, 4], np.int64)},
    "counts_2d": {COUNTS: np.array([[2, 4]], np.int32)},
    "counts_long": {COUNTS: np.array([2, 4, 0], np.int32)},
    "count_negative": {COUNTS: np.array([2, -1], np.int32)},
    "count_more_bits": {COUNTS: np.array([2, 3], np.int32)},
    "count_fewer_bits": {COUNTS: np.array([2, 5], np.int32)},
    "count_past_vocab": {COUNTS: np.array([2, 17], np.int32)},
    "count_huge": {COUNTS: np.array([2**31 - 1, 4], np.int32)},
    "vocab_bool": {VOCAB: True},
    "vocab_float": {VOCAB: 16.0},
    "vocab_numpy_int": {VOCAB: np.int64(16)},
    "vocab_negative": {VOCAB: -1},
    "vocab_past_int32": {VOCAB: 2**31 + 1},
    "vocab_huge": {VOCAB: 2**80},
    "vocab_mismatch": {VOCAB: 24},
    "rpr_zero": {RPR: 0},
    "rpr_bool": {RPR: True},
    "rpr_huge": {RPR: 2**70, NS: np.array([1])},
    "rpr_not_dividing": {RPR: 3, NS: np.array([1])},
    "rpr_without_num_sampled": {RPR: 2},
    "ns_float": {NS: np.array([1.0, 1.0])},
    "ns_uint8": {NS: np.array([1, 1], np.uint8)},
    "ns_long": {NS: np.array([1, 1, 1])},
    "ns_2d": {NS: np.array([[1, 1]])},
    "ns_strided": {NS: np.array([1, 9, 1, 9], np.int64)[::2]},
    "ns_list": {NS: [1, 1]},
    "ns_str": {NS: "11"},
}


@pytest.mark.parametrize("damage", sorted(REFUSALS))
def test_mask_supports_refuses(damage):
    args = _good()
    assert agree(*args) is not None
    for i, value in REFUSALS[damage].items():
        args[i] = value
    assert agree(*args) is None


@pytest.mark.parametrize(
    ("ns", "rpr_ok"),
    [(np.array([3, 0]), False), (np.array([-1, 1]), False), (np.array([2, 2]), True)],
)
def test_mask_supports_num_sampled_within_rows_per_request(ns, rpr_ok):
    tok = np.zeros((4, 2), np.int32)
    packed = np.zeros((4, 1), np.uint8)
    counts = np.zeros(4, np.int32)
    got = agree(tok, packed, counts, 8, 2, ns)
    assert (got is not None) is rpr_ok


def test_mask_supports_wrong_argument_count_is_type_error(impl):
    with pytest.raises(TypeError):
        impl.mask_supports(*_good()[:5])


@pytest.mark.parametrize("seed", range(300))
def test_mask_supports_random_buffers_never_crash(seed):
    # Arbitrary shapes, dtypes, counts and bits: both give the same answer, and a valid one
    # is the loop's.
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(0, 6))
    width = int(rng.integers(0, 5))
    vocab = int(rng.choice([0, 1, 8, 63, 64, 65, 130]))
    rpr = int(rng.choice([1, 1, 2, 3]))
    tok_rows = rows if rng.random() < 0.8 else int(rng.integers(0, 6))
    tok_type = (np.int32, np.int32, np.int64)[int(rng.integers(0, 3))]
    tok = rng.integers(-5, 50, (tok_rows, width)).astype(tok_type)
    nbytes = (vocab + 7) // 8 if rng.random() < 0.8 else int(rng.integers(0, 20))
    packed = rng.integers(0, 256, (rows, nbytes)).astype(np.uint8)
    counts = rng.integers(-2, vocab + 3, rows).astype(np.int32)
    ns_len = rows // rpr if rng.random() < 0.8 else int(rng.integers(0, 4))
    ns = rng.integers(-1, rpr + 2, ns_len).astype((np.int32, np.int64)[int(rng.integers(0, 2))])
    got = agree(tok, packed, counts, vocab, rpr, ns if rpr > 1 or rng.random() < 0.5 else None)
    if got is not None:
        assert rows % rpr == 0
        want = loop_reference(tok, packed, counts, vocab, rpr, ns)
        ids, offsets, cu = unpack(got)
        assert ids.tolist() == want[0].tolist()
        assert offsets.tolist() == want[1].tolist()
        assert cu == want[2]


@needs_c
def test_mask_rows_exact_buffer_ends_on_a_wide_row():
    # mask_rows fills the caller's buffer of exactly sum(lens) ids: a wide row at its very
    # end takes the careful per-bit path (no room for the ids written ahead).
    member = np.zeros((2, 64), np.uint8)
    member[1, :40] = 1
    packed = np.packbits(member, axis=1, bitorder="little")
    tok = np.array([[5, 6], [0, 0]], np.int32)
    lens = np.array([1, 40], np.int32)
    for m in BOTH:
        out = np.full(41, -1, np.int32)
        assert m.mask_rows(tok, 2, packed, 8, lens, 64, out) is True
        assert out.tolist() == [5, *range(40)]


# ----------------------------------------------------------------------------- the package


def _torch_masks(seed: int, rpr: int = 1) -> tuple[SamplingMaskTensors, np.ndarray]:
    tok, packed, counts, vocab, rpr, ns = make_case(seed, rows_per_request=rpr)
    fields = (torch.from_numpy(tok), torch.from_numpy(packed), torch.from_numpy(counts))
    return SamplingMaskTensors(*fields, vocab, rpr), ns


@pytest.fixture
def c_path():
    if not _accel.AVAILABLE:
        pytest.skip("the C accelerator is not built")
    was = _accel.accelerated()
    _accel.set_pure_python(False)
    yield
    _accel.set_pure_python(not was)


@pytest.mark.parametrize("rpr", [1, 3])
@pytest.mark.parametrize(
    "ns_kind", ["numpy32", "numpy64", "tensor", "list", "none"], ids=lambda k: f"ns_{k}"
)
def test_package_takes_the_c_walk(c_path, monkeypatch, rpr, ns_kind):
    # Host tensors, numpy fields and every common num_sampled_tokens kind reach the C walk:
    # the numpy path (which would also give the right answer) is never entered.
    masks, ns = _torch_masks(2, rpr)
    assert len(ns) > 1
    if ns_kind == "none" and rpr > 1:
        pytest.skip("several rows per request need num_sampled_tokens")
    arg: Any = {
        "numpy32": ns.astype(np.int32),
        "numpy64": ns.astype(np.int64),
        "tensor": torch.from_numpy(ns.astype(np.int32)),
        "list": ns.tolist(),
        "none": None,
    }[ns_kind]
    with _accel_path(True):
        want_arr = ao.mask_tensors_to_arrow(masks, arg)
        want_lists = masks.tolists(arg)
    monkeypatch.setattr(mt, "_supports_of", _numpy_path_entered)
    assert ao.mask_tensors_to_arrow(masks, arg).equals(want_arr)
    got = masks.tolists(arg)
    assert got.token_ids.tolist() == want_lists.token_ids.tolist()
    assert got.offsets.tolist() == want_lists.offsets.tolist()
    assert got.cu_num_generated_tokens == want_lists.cu_num_generated_tokens
    parts = (masks.token_ids.numpy(), masks.packed_mask.numpy(), masks.counts.numpy())
    ids, inner, outer = mask_array_supports(*parts, masks.vocab_size, rpr, arg)
    assert ids.tolist() == want_arr.values.values.to_pylist()
    assert inner.tolist() == want_arr.values.offsets.to_pylist()
    assert outer.tolist() == want_arr.offsets.to_pylist()


def _numpy_path_entered(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the numpy path ran where the C walk applies")


class _accel_path:
    """Within the block, the pure-Python path (True) or the compiled one (False)."""

    def __init__(self, pure: bool) -> None:
        self.pure = pure

    def __enter__(self) -> None:
        self.was = _accel.accelerated()
        _accel.set_pure_python(self.pure)

    def __exit__(self, *exc: object) -> None:
        _accel.set_pure_python(not self.was)


def test_package_c_results_are_writable_and_zero_copy(c_path):
    masks, ns = _torch_masks(3)
    lists = masks.tolists(ns)
    # Writable like vLLM's arrays (np.frombuffer over a bytearray, not bytes).
    assert lists.token_ids.flags.writeable
    assert lists.offsets.flags.writeable
    arr = ao.mask_tensors_to_arrow(masks, ns)
    back = ao.sampling_masks_from_arrow(arr, cu_num_generated_tokens=False)
    # The walk's buffers are the array's: the decoder's views sit on them.
    assert back.token_ids.ctypes.data == arr.values.values.buffers()[1].address
    assert back.offsets.ctypes.data == arr.values.buffers()[1].address


def test_package_c_array_outlives_its_inputs(c_path):
    masks, ns = _torch_masks(4)
    arr = ao.mask_tensors_to_arrow(masks, ns)
    want = arr.to_pylist()
    del masks
    import gc

    gc.collect()
    arr.validate(full=True)
    assert arr.to_pylist() == want


HOSTILE = [
    {"counts": np.array([2**31 - 1, 0, 0], np.int32)},  # wide past the bits: no huge buffer
    {"counts": np.array([-(2**31), 0, 0], np.int32)},
    {"counts": np.array([9, 0, 0], np.int32)},  # wide, fewer bits than the count
    {"packed_mask": np.full((3, 2), 255, np.uint8), "counts": np.array([3, 16, 1], np.int32)},
    {"token_ids": np.zeros((3, 2), np.int64)},
    {"token_ids": np.zeros((3, 4), np.int32)[:, ::2]},  # strided: fine, by the numpy path
    {"vocab_size": np.int64(16)},
    {"vocab_size": 2**40},
    {"rows_per_request": 3},
]


@pytest.mark.parametrize("change", HOSTILE)
@pytest.mark.parametrize("ns", [None, np.array([1, 1, 1])])
def test_package_errors_do_not_depend_on_the_path(change, ns):
    fields: dict[str, Any] = {
        "token_ids": np.array([[1, 2], [3, 0], [0, 0]], np.int32),
        "packed_mask": np.zeros((3, 2), np.uint8),
        "counts": np.array([2, 1, 0], np.int32),
        "vocab_size": 16,
        "rows_per_request": 1,
    }
    fields.update(change)
    masks = SamplingMaskTensors(**fields)
    outcomes = []
    for pure in [True, False] if _accel.AVAILABLE else [True]:
        with _accel_path(pure):
            for convert in (masks.tolists, lambda: ao.mask_tensors_to_arrow(masks, ns)):
                try:
                    got = convert()
                    outcomes.append(("ok", str(got)))
                except ao.ArrowOutputsError as e:
                    outcomes.append((type(e).__name__, str(e)))
    # [tolists, arrow] per path: each the same on every path.
    assert outcomes[::2] == [outcomes[0]] * len(outcomes[::2])
    assert outcomes[1::2] == [outcomes[1]] * len(outcomes[1::2])


@pytest.mark.parametrize("pure", [True, False])
def test_package_non_numpy_buffers_refused_on_both_paths(pure):
    # The C walk reads any buffer; the package hands it only what the numpy path accepts.
    if not pure and not _accel.AVAILABLE:
        pytest.skip("the C accelerator is not built")
    tok = np.zeros((2, 2), np.int32)
    packed = np.zeros((2, 1), np.uint8)
    counts = np.array([1, 2], np.int32)
    masks = SamplingMaskTensors(tok, packed, counts, 8, 2)
    with _accel_path(pure):
        with pytest.raises(ao.FieldTypeError, match=r"^sampling_mask_tensors\.token_ids: "):
            mask_array_supports(memoryview(tok), packed, counts, 8)
        for ns in (memoryview(np.array([2], np.int64)), b"\x02"):
            with pytest.raises(ao.FieldTypeError, match=r"^num_sampled_tokens: expected"):
                masks.tolists(ns)
            with pytest.raises(ao.FieldTypeError, match=r"^num_sampled_tokens: expected"):
                mask_array_supports(tok, packed, counts, 8, 2, ns)
