"""The decode side's one-walk C path (``_speedups.decode_batch``, used by ``from_record_batch``).

The column decoders of ``arrow_outputs.batch`` are its specification: for every batch the C
walk either gives what they give (equal outputs, zero-copy views of the batch's buffers) or
declines, and they then decode it or raise their own error. These tests check that the walk
is taken for vLLM's everyday steps, that its arrays are read-only views that keep the
batch's memory alive, that it declines what it should (so errors are the pure path's), and
that no hostile batch crashes it.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import arrow_outputs as ao
from arrow_outputs import LogprobsLists, ModelRunnerOutput, SamplingMaskLists, _accel
from arrow_outputs import batch as batch_module

pytestmark = pytest.mark.skipif(not _accel.AVAILABLE, reason="the C accelerator is not built")


@pytest.fixture(autouse=True, params=["view", "export"])
def _c_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test on both ways the walk gets the batch's buffers: ``_arrowbridge``'s view of
    them, and pyarrow's export (where the view is not built or not loadable)."""
    if request.param == "view" and _accel._bridge is None:
        pytest.skip(f"arrow_outputs._arrowbridge not loaded: {_accel.BRIDGE_UNAVAILABLE}")
    if request.param == "export":
        monkeypatch.setattr(_accel, "_bridge", None)
    was = _accel.accelerated()
    _accel.set_pure_python(False)
    yield
    _accel.set_pure_python(not was)


def _ids(n: int, seed: int) -> list[str]:
    return [f"cmpl-{seed}-{i}-é" if i % 3 == 0 else f"r{seed}-{i}" for i in range(n)]


def _lp(p: int, width: int, id_dtype: Any, rank_dtype: Any, rng: Any) -> tuple[Any, Any, Any]:
    ids = rng.integers(0, 128_000, (p, width)).astype(id_dtype)
    lps = -rng.random((p, width)).astype(np.float32)
    ranks = rng.integers(1, 9, p).astype(rank_dtype)
    return ids, lps, ranks


def decode_lp(n: int, seed: int = 0, id_dtype: Any = np.int64, cu: bool = False) -> Any:
    """One token per request, 5 logprobs each; cu None (vLLM's plain decode) or a list."""
    rng = np.random.default_rng(seed)
    req = _ids(n, seed)
    sampled = rng.integers(0, 128_000, (n, 1)).tolist()
    ids, lps, ranks = _lp(n, 5, id_dtype, np.int64, rng)
    return ModelRunnerOutput(
        req,
        {r: i for i, r in enumerate(req)},
        sampled,
        LogprobsLists(ids, lps, ranks, list(range(n + 1)) if cu else None),
    )


def spec_lp(n: int, seed: int = 0, rank_dtype: Any = np.int64) -> Any:
    """1-4 accepted tokens per request (lists of different lengths), one logprob row each."""
    rng = np.random.default_rng(seed)
    req = _ids(n, seed)
    k = rng.integers(1, 5, n)
    cu = [0, *np.cumsum(k).tolist()]
    flat = rng.integers(0, 128_000, cu[-1])
    ids, lps, ranks = _lp(cu[-1], 3, np.int64, rank_dtype, rng)
    return ModelRunnerOutput(
        req,
        {r: i for i, r in enumerate(req)},
        [flat[a:b].tolist() for a, b in itertools.pairwise(cu)],
        LogprobsLists(ids, lps, ranks, cu),
    )


def masked(n: int, seed: int = 0, cu: bool = False) -> Any:
    """A CSR sampling mask per request (some rows empty), no logprobs."""
    rng = np.random.default_rng(seed)
    req = _ids(n, seed)
    lens = rng.integers(0, 6, n)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    return ModelRunnerOutput(
        req,
        {r: i for i, r in enumerate(req)},
        rng.integers(0, 100, (n, 1)).tolist(),
        sampling_masks=SamplingMaskLists(
            rng.integers(0, 128_000, int(offsets[-1])).astype(np.int32),
            offsets,
            list(range(n + 1)) if cu else None,
        ),
    )


def pooling(n: int, seed: int = 0) -> Any:
    """A pooling step's shape without its tensors: requests, and no sampled ids at all."""
    req = _ids(n, seed)
    return ModelRunnerOutput(req, {r: i for i, r in enumerate(req)}, [])


STEPS: list[Callable[[], Any]] = [
    lambda: decode_lp(1),
    lambda: decode_lp(64, 1),
    lambda: decode_lp(7, 2, id_dtype=np.int32),
    lambda: decode_lp(9, 3, cu=True),
    lambda: spec_lp(1),
    lambda: spec_lp(50, 4, rank_dtype=np.int32),
    lambda: masked(1),
    lambda: masked(33, 5),
    lambda: masked(5, 6, cu=True),
    lambda: pooling(3),
]
STEP_IDS = [
    "decode-1",
    "decode-64",
    "decode-int32-ids",
    "decode-cu-list",
    "spec-1",
    "spec-50-int32-ranks",
    "mask-1",
    "mask-33",
    "mask-cu-list",
    "pooling",
]


def _on_pure(call: Callable[[], Any]) -> Any:
    _accel.set_pure_python(True)
    try:
        return call()
    finally:
        _accel.set_pure_python(False)


def _outcome(call: Callable[[], Any]) -> Any:
    # Any exception: with validate=False the pure path trusts the batch, and may let
    # pyarrow's own error out (bad UTF-8); the C path must then give that very error too.
    try:
        return "ok", call()
    except Exception as e:
        return "error", (type(e), str(e))


def _both_paths(batch: pa.RecordBatch, meta: Any, validate: bool) -> tuple[Any, Any]:
    """The outcome of decoding ``batch`` on the C path, then on the pure-Python path."""

    def call() -> Any:
        return ao.from_record_batch(batch, custom_metadata=meta, validate=validate)

    return _outcome(call), _on_pure(lambda: _outcome(call))


def _same_outcome(batch: pa.RecordBatch, meta: Any, validate: bool, label: Any) -> Any:
    """The C path's outcome, asserted equal to the pure path's: the same error (type and
    text) or an equal output."""
    c, py = _both_paths(batch, meta, validate)
    assert c[0] == py[0], label
    if c[0] == "error":
        assert c[1] == py[1], label
    else:
        ao.assert_outputs_equal(c[1], py[1])
    return c


def _ipc(batch: pa.RecordBatch) -> tuple[pa.RecordBatch, Any, pa.Buffer]:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, ao.run_schema(batch)) as writer:
        writer.write_batch(batch, custom_metadata=ao.step_custom_metadata(batch))
    data = sink.getvalue()
    read, meta = pa.ipc.open_stream(data).read_next_batch_with_custom_metadata()
    return read, meta, data


def _walked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the C walk's successes; makes the column decoders fail loudly if they run."""
    taken: list[int] = []
    real = batch_module._decode_fast

    def fast(*args: Any) -> Any:
        got = real(*args)
        taken.append(got is not None)
        return got

    monkeypatch.setattr(batch_module, "_decode_fast", fast)
    return taken


def _arrays(out: Any) -> list[np.ndarray]:
    found = []
    if out.logprobs is not None:
        found += [
            out.logprobs.logprob_token_ids,
            out.logprobs.logprobs,
            out.logprobs.sampled_token_ranks,
        ]
    if out.sampling_masks is not None:
        found += [out.sampling_masks.token_ids, out.sampling_masks.offsets]
    return found


@pytest.mark.parametrize("make", STEPS, ids=STEP_IDS)
@pytest.mark.parametrize("validate", [True, False])
def test_decode_batch_takes_the_walk_and_equals_the_pure_path(
    make: Callable[[], Any], validate: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = make()
    taken = _walked(monkeypatch)
    for batch in (_on_pure(lambda: ao.to_record_batch(out, step=5)), ao.to_record_batch(out)):
        read, meta, _ = _ipc(batch)
        for b, custom in ((batch, None), (read, meta)):
            c = ao.from_record_batch(b, custom_metadata=custom, validate=validate)
            py = _both_paths(b, custom, True)[1][1]
            ao.assert_outputs_equal(c, py)  # strict: kinds, dtypes, shapes, values
            ao.assert_outputs_equal(c, out)
            assert all(type(v) is int for row in c.sampled_token_ids for v in row)
            assert type(c.req_ids) is list
            assert all(type(r) is str for r in c.req_ids)
            assert c.req_id_to_index == {r: i for i, r in enumerate(out.req_ids)}
    assert taken == [True] * 8  # each batch decoded twice on the C path


@pytest.mark.parametrize("make", STEPS[:-1], ids=STEP_IDS[:-1])
def test_decode_batch_views_are_zero_copy_and_read_only(make: Callable[[], Any]) -> None:
    out = make()
    batch = ao.to_record_batch(out, step=1)
    read, meta, data = _ipc(batch)
    back = ao.from_record_batch(read, custom_metadata=meta)
    arrays = _arrays(back)
    assert arrays
    lo, hi = data.address, data.address + data.size
    for arr in arrays:
        assert arr.flags.writeable is False
        assert lo <= arr.ctypes.data
        assert arr.ctypes.data + arr.nbytes <= hi
    # In memory: the producer's own arrays, not copies.
    back = ao.from_record_batch(batch)
    if out.logprobs is not None:
        assert back.logprobs.logprobs.ctypes.data == out.logprobs.logprobs.ctypes.data
        assert back.logprobs.logprob_token_ids.ctypes.data == (
            out.logprobs.logprob_token_ids.ctypes.data
        )
    if out.sampling_masks is not None:
        m = back.sampling_masks
        assert m.token_ids.ctypes.data == out.sampling_masks.token_ids.ctypes.data
        assert m.offsets.ctypes.data == out.sampling_masks.offsets.ctypes.data
    with pytest.raises(ValueError, match="read-only"):
        arrays[0][...] = 0


def test_decode_batch_views_keep_the_memory_alive() -> None:
    out = spec_lp(40, 9)
    expected = out.logprobs.logprobs.copy()
    batch = ao.to_record_batch(out, step=2)
    read, meta, data = _ipc(batch)
    back = ao.from_record_batch(read, custom_metadata=meta)
    del read, meta, data, batch, out
    gc.collect()
    # Other allocations of the same size may now reuse freed memory; the views must not see it.
    junk = [np.full(expected.shape, 7.0, np.float32) for _ in range(64)]
    assert np.array_equal(back.logprobs.logprobs, expected)
    del junk


def test_decode_batch_declines_slices_and_empty_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    out = spec_lp(6, 1)
    batch = ao.to_record_batch(out, step=1)
    taken = _walked(monkeypatch)
    part = ao.from_record_batch(batch.slice(2, 3))
    assert part.req_ids == out.req_ids[2:5]
    assert part.sampled_token_ids == out.sampled_token_ids[2:5]
    empty = ModelRunnerOutput([], {}, [])
    assert ao.from_record_batch(ao.to_record_batch(empty, step=0)).req_ids == []
    assert taken == [False, False]


def _replace(batch: pa.RecordBatch, name: str, col: pa.Array) -> pa.RecordBatch:
    i = batch.schema.get_field_index(name)
    cols = [col if j == i else batch.column(j) for j in range(batch.num_columns)]
    return pa.RecordBatch.from_arrays(cols, schema=batch.schema)


def _list_with_offsets(col: pa.Array, offsets: list[int]) -> pa.Array:
    """``col`` (a list array) with other offsets over the same child, unvalidated."""
    buf = pa.py_buffer(np.array(offsets, np.int32))
    return pa.Array.from_buffers(col.type, len(col), [None, buf], children=[col.values])


def _hostile_batches() -> Iterator[tuple[str, pa.RecordBatch, Any]]:
    """Batches that pass pyarrow's cheap validate() (sizes, first and last offsets) but not
    full validation, or break the format's own rules: each with its IPC custom metadata."""
    out = spec_lp(4, 3)
    batch = ao.to_record_batch(out, step=1)
    read, meta, _ = _ipc(batch)
    sampled = read.column("sampled_token_ids")
    offs = np.asarray(sampled.buffers()[1]).view(np.int32)[: len(sampled) + 1].tolist()
    bad = [offs[0], offs[2], offs[1], *offs[3:]]  # middle offsets out of order
    yield (
        "sampled-offsets",
        _replace(read, "sampled_token_ids", _list_with_offsets(sampled, bad)),
        meta,
    )
    lp = read.column("logprobs")
    lp_offs = np.asarray(lp.buffers()[1]).view(np.int32)[: len(lp) + 1].tolist()
    bad = [lp_offs[0], lp_offs[2], lp_offs[1], *lp_offs[3:]]
    yield "logprob-offsets", _replace(read, "logprobs", _list_with_offsets(lp, bad)), meta
    req = read.column("req_id")
    r_offs = np.asarray(req.buffers()[1]).view(np.int32)[: len(req) + 1].tolist()
    bad_r = pa.py_buffer(np.array([r_offs[0], r_offs[2], r_offs[1], *r_offs[3:]], np.int32))
    bad_req = pa.Array.from_buffers(pa.string(), len(req), [None, bad_r, req.buffers()[2]])
    yield "req-id-offsets", _replace(read, "req_id", bad_req), meta
    bad_utf8 = pa.Array.from_buffers(
        pa.string(),
        4,
        [None, pa.py_buffer(np.array([0, 1, 2, 3, 4], np.int32)), pa.py_buffer(b"a\xffcd")],
    )
    yield "req-id-utf8", _replace(read, "req_id", bad_utf8), meta
    dup = pa.array(["a", "b", "a", "c"], pa.string())
    yield "duplicate-ids", _replace(read, "req_id", dup), meta
    index = pa.array([0, 1, 3, 2], pa.int32())
    yield "req-index-order", _replace(read, "req_index", index), meta
    steps = pa.array([1, 1, 2, 1], pa.int64())
    yield "step-values", _replace(read, "step", steps), meta
    mout = masked(4, 2)
    mread, mmeta, _ = _ipc(ao.to_record_batch(mout, step=1))
    mask = mread.column("sampling_mask")
    inner = mask.values
    csr = np.asarray(inner.buffers()[1]).view(np.int64)[: len(inner) + 1].copy()
    csr[1], csr[2] = csr[2] + 1, csr[1]
    bad_inner = pa.Array.from_buffers(
        inner.type, len(inner), [None, pa.py_buffer(csr)], children=[inner.values]
    )
    bad_mask = pa.Array.from_buffers(
        mask.type, len(mask), [None, mask.buffers()[1]], children=[bad_inner]
    )
    yield "mask-csr", _replace(mread, "sampling_mask", bad_mask), mmeta
    nulls = pa.array([None, 1, None, 2], pa.int32())
    yield "claimed-absent-nans", _replace(read, "num_nans_in_logits", nulls), meta


@pytest.mark.parametrize("validate", [True, False])
def test_decode_batch_hostile_batches_give_the_pure_paths_outcome(validate: bool) -> None:
    seen = 0
    for name, batch, meta in _hostile_batches():
        c = _same_outcome(batch, meta, validate, name)
        if validate:
            assert c[0] == "error", name  # full validation or the format refuses each
            assert issubclass(c[1][0], ao.ArrowOutputsError), name
        seen += 1
    assert seen == 9


def test_decode_batch_mutated_ipc_never_crashes_and_matches_the_pure_path() -> None:
    rng = random.Random(6)
    sources = [decode_lp(8, 1), spec_lp(8, 2), masked(8, 3)]
    streams = []
    for out in sources:
        _, _, data = _ipc(ao.to_record_batch(out, step=1))
        streams.append(data.to_pybytes())
    outcomes: list[str] = []
    for trial in range(240):
        raw = bytearray(streams[trial % len(streams)])
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        try:
            read, meta = pa.ipc.open_stream(bytes(raw)).read_next_batch_with_custom_metadata()
        except (pa.ArrowException, OSError, ValueError):
            continue  # pyarrow refused the stream itself
        for validate in (True, False):
            if not validate:
                try:
                    read.validate()
                except pa.ArrowInvalid:
                    continue  # without validation the pure path trusts sizes: not comparable
            c = _same_outcome(read, meta, validate, trial)
            outcomes.append(c[0])
    # Enough mutations reach the decoders, and both ways out are exercised.
    assert len(outcomes) >= 100
    assert outcomes.count("ok") >= 20
    assert outcomes.count("error") >= 20


def test_decode_batch_low_level_declines_and_checks_its_plan() -> None:
    from arrow_outputs import _speedups

    out = decode_lp(3)
    batch = ao.to_record_batch(out, step=4)
    plan = batch_module._FAST_COLUMNS
    absent = tuple(range(5, 11))

    def walk(step: Any = 4, n: int = 3, sampled: int = 8, lp: Any = (8, 8, False, 5)) -> Any:
        capsule, address = _speedups.array_slot()
        batch._export_to_c(address)
        return _speedups.decode_batch(capsule, n, plan, step, absent, sampled, lp, None, None)

    got = walk()
    assert got is not None
    assert got[0] == out.req_ids
    assert walk(step=5) is None  # another step's number in the column
    assert walk(step=None) is None  # the column is not all null
    assert walk(n=2) is None  # not the batch's row count
    assert walk(sampled=0) is None  # a pooling claim over sampled ids
    assert walk(lp=(8, 8, False, 6)) is None  # another width than the layout's
    assert walk(lp=(8, 8, True, -1))[3][5] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="bad logprobs spec"):
        walk(lp=(3, 8, False, 5))
    with pytest.raises(TypeError):
        walk(sampled=5)
    capsule, _ = _speedups.array_slot()  # never exported into: released, so declined
    assert _speedups.decode_batch(capsule, 3, plan, 4, absent, 8, None, None, None) is None
    capsule, address = _speedups.array_slot()
    batch._export_to_c(address)
    with pytest.raises(ValueError, match="column position out of range"):
        _speedups.decode_batch(capsule, 3, (0, 1, 2, 3, 4, 99), 4, absent, 8, None, None, None)


def _same_requests(out: Any, like: Any) -> Any:
    """``out`` with ``like``'s requests (a decode step after ``like``: new tokens, same ids)."""
    out.req_ids = list(like.req_ids)
    out.req_id_to_index = dict(like.req_id_to_index)
    return out


def test_decode_batch_reuses_the_last_steps_request_ids_as_fresh_containers() -> None:
    first, second = decode_lp(64, seed=1), _same_requests(decode_lp(64, seed=2), decode_lp(64, 1))
    a = ao.from_record_batch(ao.to_record_batch(first, step=1))
    b = ao.from_record_batch(ao.to_record_batch(second, step=2))
    assert ao.first_difference(b, second) is None
    # The same str objects (not decoded again), in a new list and a new dict.
    assert all(x is y for x, y in zip(a.req_ids, b.req_ids, strict=True))
    assert b.req_ids is not a.req_ids
    assert b.req_id_to_index is not a.req_id_to_index
    # What a caller does to its containers never reaches the next step's.
    a.req_ids.reverse()
    a.req_id_to_index.clear()
    b.req_ids[0] = "changed"
    c = ao.from_record_batch(ao.to_record_batch(second, step=3))
    assert c.req_ids == second.req_ids
    assert c.req_id_to_index == second.req_id_to_index


def test_decode_batch_never_reuses_request_ids_that_differ_in_one_byte() -> None:
    first = decode_lp(64, seed=1)
    other = decode_lp(64, seed=2)
    ids = list(first.req_ids)
    ids[40] = ids[40][:-1] + ("x" if ids[40][-1] != "x" else "y")  # same length, one byte
    other.req_ids, other.req_id_to_index = ids, {r: i for i, r in enumerate(ids)}
    ao.from_record_batch(ao.to_record_batch(first, step=1))
    got = ao.from_record_batch(ao.to_record_batch(other, step=2))
    assert got.req_ids == ids
    assert got.req_id_to_index == other.req_id_to_index


def _with_ids(out: Any, ids: list[str]) -> Any:
    out.req_ids, out.req_id_to_index = ids, {r: i for i, r in enumerate(ids)}
    return out


def test_decode_batch_reuses_the_ids_of_the_rows_that_kept_their_request() -> None:
    first = decode_lp(64, seed=1)
    a = ao.from_record_batch(ao.to_record_batch(first, step=1))
    ids = list(first.req_ids)
    ids[3] = ids[3][:-1] + ("x" if ids[3][-1] != "x" else "y")  # same length, one byte
    ids[10] = ids[10] + "-longer"
    ids[11] = ""
    ids[12] = "req-\u00e9\u4e2d"  # not ASCII
    ids[20], ids[21] = ids[21], ids[20]  # two requests that swapped rows
    ids.append("joined")  # one more row than the last step
    second = _with_ids(decode_lp(65, seed=2), ids)
    b = ao.from_record_batch(ao.to_record_batch(second, step=2))
    assert ao.first_difference(b, second) is None
    changed = {3, 10, 11, 12, 20, 21, 64}
    for i, r in enumerate(b.req_ids):
        assert r == ids[i]
        # An unchanged ASCII row (vLLM's ids are ASCII) has the last step's very str, its hash
        # already known; every other row is decoded afresh.
        assert (i < 64 and r is a.req_ids[i]) is (i not in changed and r.isascii()), i
    # Fewer rows than the last step: the rows there are still compared one by one.
    third = _with_ids(decode_lp(40, seed=3), ids[:40])
    c = ao.from_record_batch(ao.to_record_batch(third, step=3))
    assert ao.first_difference(c, third) is None
    assert all((c.req_ids[i] is b.req_ids[i]) is c.req_ids[i].isascii() for i in range(40))


def test_decode_batch_row_reuse_over_a_run_of_changing_steps() -> None:
    """Steps whose request ids change a few rows at a time (replaced, swapped, shortened,
    lengthened by a byte, emptied, made non-ASCII, rows added and removed): each decodes to
    its own ids, equal to what the pure-Python path decodes."""
    rng = random.Random(7)
    ids = [f"cmpl-{rng.getrandbits(64):016x}-0" for _ in range(48)]
    prev: list[str] = []
    reused = 0
    for step in range(60):
        ids = list(ids)
        for _ in range(rng.randint(0, 5)):
            i = rng.randrange(len(ids))
            change = rng.randrange(6)
            if change == 0:
                ids[i] = f"cmpl-{rng.getrandbits(64):016x}-0"
            elif change == 1:
                j = rng.randrange(len(ids))
                ids[i], ids[j] = ids[j], ids[i]
            elif change == 2:
                ids[i] = ids[i][:-1] + chr(ord(ids[i][-1]) ^ 1)
            elif change == 3:
                ids[i] = ids[i] + "x" if rng.random() < 0.5 else ids[i][:-1]
            elif change == 4:
                ids[i] = "" if rng.random() < 0.5 else ids[i] + "\u00e9"
            elif len(ids) > 33:
                del ids[i]
            else:
                ids.insert(i, f"new-{step}-{i}")
        if len(set(ids)) != len(ids):
            ids = list(dict.fromkeys(ids))
        out = _with_ids(decode_lp(len(ids), seed=step), ids)
        batch = ao.to_record_batch(out, step=step)
        got = ao.from_record_batch(batch)
        assert ao.first_difference(got, out) is None, step
        _accel.set_pure_python(True)
        try:
            spec = ao.from_record_batch(batch)
        finally:
            _accel.set_pure_python(False)
        assert got.req_ids == spec.req_ids
        assert got.req_id_to_index == spec.req_id_to_index
        reused += sum(r is p for r, p in zip(got.req_ids, prev))
        prev = got.req_ids
    assert reused > 1000  # the walk took its strs from the step before, most rows each step


def test_decode_batch_reuses_only_strs_equal_to_the_row(monkeypatch: pytest.MonkeyPatch) -> None:
    out = decode_lp(64, seed=1)
    ao.from_record_batch(ao.to_record_batch(out, step=1))
    assert type(_accel._known_req_ids) is tuple  # the step kept an entry
    # An entry whose ids are not the rows' (a str of other bytes, a str subclass, not a
    # str): each row is compared with the str itself, so none of them comes out.
    wrong = ["other-id-" + r[9:] for r in out.req_ids]
    wrong[1] = type("S", (str,), {})(out.req_ids[1])
    wrong[2] = 7  # type: ignore[call-overload]
    monkeypatch.setattr(_accel, "_known_req_ids", (b"", b"", tuple(wrong), {}))
    second = _with_ids(decode_lp(64, seed=2), list(out.req_ids))
    got = ao.from_record_batch(ao.to_record_batch(second, step=2))
    assert ao.first_difference(got, second) is None
    assert all(type(r) is str for r in got.req_ids)
    assert got.req_ids[1] is not wrong[1]


def test_decode_batch_decodes_afresh_past_a_bad_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    out = decode_lp(64, seed=1)
    batch = ao.to_record_batch(out, step=1)
    ao.from_record_batch(batch)
    known = _accel._known_req_ids
    assert type(known) is tuple
    assert known[2] == tuple(out.req_ids)
    # An entry whose bytes match but whose ids are not strs is not used.
    monkeypatch.setattr(_accel, "_known_req_ids", (*known[:2], tuple(range(64)), known[3]))
    assert ao.from_record_batch(batch).req_ids == out.req_ids
    # Small steps keep no entry.
    ao.from_record_batch(ao.to_record_batch(decode_lp(3), step=2))
    assert _accel._known_req_ids is None


@pytest.mark.parametrize("make", STEPS, ids=STEP_IDS)
def test_decode_batch_output_has_every_field_as_its_constructor_sets_it(
    make: Callable[[], Any],
) -> None:
    # The walk's output is made without __init__ (its fields stored at once): the same
    # fields, in the dataclass's order, as the constructor stores them.
    out = make()
    back = ao.from_record_batch(ao.to_record_batch(out, step=3))
    assert type(back) is ModelRunnerOutput
    names = [f.name for f in dataclasses.fields(ModelRunnerOutput)]
    assert list(vars(back)) == names
    rebuilt = ModelRunnerOutput(**vars(back))
    assert list(vars(rebuilt)) == names
    ao.assert_outputs_equal(back, rebuilt)
    # Fresh containers per output, never shared between outputs.
    again = ao.from_record_batch(ao.to_record_batch(out, step=3))
    assert again.prompt_logprobs_dict == {}
    assert again.prompt_logprobs_dict is not back.prompt_logprobs_dict
    assert again.prompt_token_id_logprobs_dict is not back.prompt_token_id_logprobs_dict


def test_plan_by_shared_tail_is_the_plan_by_layouts() -> None:
    from arrow_outputs import _stepmeta
    from arrow_outputs.schema import check_format

    batch = ao.to_record_batch(spec_lp(4, 2), step=1)
    raw = batch.schema.metadata[b"arrow_outputs.step"]
    path, spec = batch_module._CUSTOM_PATH, batch_module._SPEC
    _stepmeta.parse_shared(raw, path, spec)  # the first parse may be the full one
    meta, tail = _stepmeta.parse_shared(raw.replace(b'"step":1', b'"step":2'), path, spec)
    assert tail is not None
    assert meta["step"] == 2
    assert all(meta[k] is tail[k] for k in tail if k not in ("step", "rows"))
    schema = batch.schema
    types = batch_module._decode_types(schema, check_format(schema))
    by_layouts = batch_module._fast_plan(meta, types)
    assert by_layouts is not None
    assert batch_module._fast_plan(meta, types, tail) == by_layouts
    assert batch_module._fast_plan(meta, types, tail) is batch_module._fast_plan(meta, types, tail)
