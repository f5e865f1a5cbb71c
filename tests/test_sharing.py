"""Cross-process sharing (arrow_outputs.sharing): zero-copy reads, holders never see a batch
change, slow and dead consumers bounded, a dead producer noticed, hostile bytes refused.

The multi-process tests start children with the "spawn" context; the children report back
through JSON files (never pickle), and every run directory is removed at the end.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from conftest import codec_on

from arrow_outputs import (
    ArrowOutputsError,
    FieldTypeError,
    LogprobsLists,
    ModelRunnerOutput,
    SchemaMismatchError,
    _accel,
    assert_outputs_equal,
    from_record_batch,
    run_schema,
    step_custom_metadata,
    to_record_batch,
)
from arrow_outputs.sharing import (
    CONTROL_NAME,
    SCHEMA_NAME,
    CorruptSegmentError,
    ProducerGoneError,
    SharingError,
    StepPublisher,
    StepSubscriber,
    StepTimeoutError,
    SubscriberEvictedError,
    _custom_metadata,
    remove_run,
)

SPAWN = multiprocessing.get_context("spawn")
CHILD_TIMEOUT = 60.0


def _step(seq: int) -> ModelRunnerOutput:
    """A deterministic decode step for sequence number ``seq``: 1 to 5 requests, 4
    logprobs each (numpy only, so spawned children start fast)."""
    rng = np.random.default_rng(seq)
    n = 1 + seq % 5
    req_ids = [f"s{seq}-r{i}" for i in range(n)]
    ids = rng.integers(0, 50_000, size=(n, 5), dtype=np.int64)
    lps = -rng.random((n, 5), dtype=np.float32)
    ranks = rng.integers(1, 9, size=n, dtype=np.int64)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[int(ids[i, 0])] for i in range(n)],
        logprobs=LogprobsLists(ids, lps, ranks, None),
    )


def _schema() -> pa.Schema:
    return run_schema(to_record_batch(_step(1), step=1))


def _batch(seq: int) -> pa.RecordBatch:
    return to_record_batch(_step(seq), step=seq, schema=_schema())


def _buffers(batch: pa.RecordBatch) -> list[pa.Buffer]:
    out: list[pa.Buffer] = []

    def walk(arr: pa.Array) -> None:
        out.extend(b for b in arr.buffers() if b is not None and b.size)

    for col in batch.columns:
        walk(col)
    return out


def _inside(batch: pa.RecordBatch, sub: StepSubscriber, seq: int) -> bool:
    """Every buffer of the batch lies inside the subscriber's mapping of its slot file."""
    m = sub._maps[(seq - 1) % sub._slots]
    assert m is not None
    lo, hi = m.address, m.address + m.size
    bufs = _buffers(batch)
    return bool(bufs) and all(lo <= b.address and b.address + b.size <= hi for b in bufs)


def _snapshot(batch: pa.RecordBatch) -> list[bytes]:
    return [b.to_pybytes() for b in _buffers(batch)]


# ----------------------------------------------------------------------------- children


def _consumer(path: str, out: str, steps: int, hold_first: bool) -> None:
    """Read ``steps`` steps; check each against ``_step(seq)`` and its zero-copy placement;
    optionally hold the first step's batch for the whole run and check it never changed."""
    report: dict[str, Any] = {"seqs": [], "zero_copy": True, "equal": True, "held_same": None}
    try:
        with StepSubscriber(path, spin_s=0.0005) as sub:
            held = None
            for _ in range(steps):
                step = sub.next(timeout=CHILD_TIMEOUT)
                assert step is not None
                report["seqs"].append(step.seq)
                report["zero_copy"] &= _inside(step.batch, sub, step.seq)
                assert_outputs_equal(step.output(), _step(step.seq))
                if hold_first and held is None:
                    held = (step, _snapshot(step.batch), [b.address for b in _buffers(step.batch)])
                time.sleep(0.002)  # slower than the producer: the ring fills up
            if held is not None:
                step, before, addrs = held
                report["held_same"] = (
                    _snapshot(step.batch) == before
                    and [b.address for b in _buffers(step.batch)] == addrs
                )
                assert_outputs_equal(step.output(), _step(step.seq))
            report["end"] = sub.next(timeout=CHILD_TIMEOUT) is None
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}"
    Path(out).write_text(json.dumps(report))


def _idle_consumer(path: str, ready: str) -> None:
    """Attach, say so, then never read (the parent kills it)."""
    sub = StepSubscriber(path)
    Path(ready).write_text(str(os.getpid()))
    time.sleep(600)
    sub.close()


def _crashing_producer(path: str, steps: int) -> None:
    """Publish ``steps`` steps to a waiting subscriber, then die without close()."""
    pub = StepPublisher(path, slots=4)
    pub.wait_for_subscribers(1, timeout=CHILD_TIMEOUT)
    for seq in range(1, steps + 1):
        pub.publish(_batch(seq))
    os._exit(0)


def _join(proc: Any) -> None:
    proc.join(CHILD_TIMEOUT)
    if proc.is_alive():
        proc.kill()
        proc.join()
        pytest.fail("child process did not finish")


@pytest.fixture
def run_dir(tmp_path: Path) -> Any:
    path = tmp_path / "run"
    yield path
    remove_run(path)


# ----------------------------------------------------------------------------- in process


@pytest.mark.parametrize(
    "case",
    ["_everything", "_speculative", "_pooling", "_empty_with_kv", "_masks_csr_cu_none"],
)
def test_subscriber_roundtrip_zero_copy(case: str, run_dir: Path) -> None:
    import test_batch  # torch-using builders: imported here, not in spawned children

    out = getattr(test_batch, case)()
    batch = to_record_batch(out, step=3)
    with StepPublisher(run_dir, slots=2) as pub, StepSubscriber(run_dir) as sub:
        assert pub.publish(batch) == 1
        step = sub.next(timeout=5)
        assert step is not None
        assert step.seq == 1
        assert step.batch.equals(batch)
        assert step.step_metadata()["step"] == 3
        assert_outputs_equal(step.output(), out)
        if batch.num_rows:
            assert _inside(step.batch, sub, 1)


@pytest.mark.parametrize("path", ["c", "python"])
def test_a_steps_custom_metadata_is_every_pair_the_publisher_wrote(
    path: str, run_dir: Path
) -> None:
    """Duplicates and foreign keys included; decoding reads the step key's last value, as
    from a KeyValueMetadata."""
    batch = _batch(1)
    own = step_custom_metadata(batch)[b"arrow_outputs.step"]
    wrong = step_custom_metadata(_batch(2))[b"arrow_outputs.step"]
    pairs = [
        (b"arrow_outputs.step", wrong),
        (b"k", b"1"),
        (b"k", b"2"),
        (b"arrow_outputs.step", own),
    ]
    with codec_on(path), StepPublisher(run_dir) as pub, StepSubscriber(run_dir) as sub:
        pub.publish(batch, pa.KeyValueMetadata(pairs))
        step = sub.next(timeout=5)
        assert step is not None
        assert_outputs_equal(step.output(), _step(1))
        assert step.step_metadata()["step"] == 1
        custom = step.custom_metadata
        assert isinstance(custom, pa.KeyValueMetadata)
        assert list(custom.items()) == pairs
        assert step.custom_metadata is custom  # made once


def test_subscriber_sees_every_step_in_order_then_end(run_dir: Path) -> None:
    with StepPublisher(run_dir, slots=3) as pub, StepSubscriber(run_dir) as sub:
        for seq in range(1, 8):
            pub.publish(_batch(seq))
            step = sub.next(timeout=5)
            assert step is not None
            assert step.seq == seq
            assert_outputs_equal(step.output(), _step(seq))
        assert sub.poll() is None
        pub.close()
        assert sub.next(timeout=5) is None  # closed and drained
    assert not run_dir.exists()  # close() removed the run's files


def _validation_spy(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """Counts the decode's full validations and records what its fast walk was told."""
    import arrow_outputs.batch as codec

    seen: dict[str, list[Any]] = {"full": [], "walk": []}
    full, walk = codec._validate_full, codec._decode_fast

    def counted_full(batch: pa.RecordBatch) -> None:
        seen["full"].append(batch)
        full(batch)

    def recorded_walk(
        batch: pa.RecordBatch, meta: Any, types: Any, validated: bool, *rest: Any
    ) -> Any:
        seen["walk"].append(validated)
        return walk(batch, meta, types, validated, *rest)

    monkeypatch.setattr(codec, "_validate_full", counted_full)
    monkeypatch.setattr(codec, "_decode_fast", recorded_walk)
    return seen


@pytest.mark.parametrize("validate", [True, False])
def test_step_output_does_not_validate_twice(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, validate: bool
) -> None:
    """A step the subscriber validated in full decodes without a second full validation,
    and its walk is told so (no constant-time validate() either); ``validate=True`` runs it
    again. A step of a subscriber that trusts the producer is validated by its decode, as
    ``from_record_batch`` does by default."""
    seen = _validation_spy(monkeypatch)
    with StepPublisher(run_dir, slots=2) as pub, StepSubscriber(run_dir, validate=validate) as sub:
        pub.publish(_batch(1))
        step = sub.next(timeout=5)
        assert step is not None
        assert step.validated is validate
        assert_outputs_equal(step.output(), _step(1))
        assert seen["full"] == ([] if validate else [step.batch])
        if seen["walk"]:  # the C path's fast walk (the pure-Python path has none)
            assert seen["walk"] == [True]  # validated in full, by one side or the other
        assert_outputs_equal(step.output(validate=True), _step(1))
        assert len(seen["full"]) == (1 if validate else 2)
        assert_outputs_equal(step.output(validate=False), _step(1))
        if seen["walk"]:  # trusted: the walk runs its constant-time checks unless validated
            assert seen["walk"][-1] is validate
        assert len(seen["full"]) == (1 if validate else 2)
        with pytest.raises(FieldTypeError, match="validate"):
            step.output(validate="yes")  # type: ignore[arg-type]


def test_subscriber_drains_steps_published_before_close(run_dir: Path) -> None:
    pub = StepPublisher(run_dir, slots=4)
    sub = StepSubscriber(run_dir)
    for seq in range(1, 4):
        pub.publish(_batch(seq))
    pub.close(unlink=False)
    assert [s.seq for s in sub] == [1, 2, 3]
    sub.close()


def test_held_batch_survives_slot_reuse_and_close(run_dir: Path) -> None:
    pub = StepPublisher(run_dir, slots=2)
    sub = StepSubscriber(run_dir)
    pub.publish(_batch(1))
    held = sub.next(timeout=5)
    assert held is not None
    before = _snapshot(held.batch)
    addrs = [b.address for b in _buffers(held.batch)]
    for seq in range(2, 9):  # slot 0 comes round three more times
        pub.publish(_batch(seq))
        assert sub.next(timeout=5) is not None
    assert pub.stats.replaced_slots >= 1  # the held slot was replaced, not rewritten
    pub.close()  # unlinks every file; the held mapping stays
    assert _snapshot(held.batch) == before
    assert [b.address for b in _buffers(held.batch)] == addrs
    assert_outputs_equal(held.output(), _step(1))
    sub.close()


def test_released_slot_is_rewritten_in_place(run_dir: Path) -> None:
    with StepPublisher(run_dir, slots=2) as pub, StepSubscriber(run_dir) as sub:
        for seq in range(1, 9):
            pub.publish(_batch(seq))
            step = sub.next(timeout=5)
            assert step is not None
            del step  # nothing held: slot pages are reused
        assert pub.stats.replaced_slots == 0
        # One file per slot: the generation never moved past the first (or a growth).
        slots = sorted(p.name for p in run_dir.glob("slot-*"))
        assert len(slots) == 2


def test_slot_files_and_writers_are_reused_step_after_step(run_dir: Path) -> None:
    """No file, mapping or IPC writer is made per step once each slot has its file; each
    slot still holds a plain IPC stream: schema.arrows' bytes, the batch, end of stream."""
    with StepPublisher(run_dir, slots=3) as pub, StepSubscriber(run_dir) as sub:
        for seq in range(1, 4):
            pub.publish(_batch(seq))
            assert sub.next(timeout=5) is not None
        files = list(pub._files)
        writers = [f.writer for f in files if f is not None]
        inodes = sorted(os.stat(p).st_ino for p in run_dir.glob("slot-*"))
        for seq in range(4, 13):
            pub.publish(_batch(seq))
            step = sub.next(timeout=5)
            assert step is not None
            assert _inside(step.batch, sub, seq)
            assert_outputs_equal(step.output(), _step(seq))
            del step
        assert [f is g for f, g in zip(pub._files, files)] == [True] * 3
        assert [f.writer for f in pub._files if f is not None] == writers
        assert sorted(os.stat(p).st_ino for p in run_dir.glob("slot-*")) == inodes
        assert [int(e[1]) for e in pub._slot_tab] == [1, 1, 1]  # S_GEN: first generation
        schema_bytes = (run_dir / SCHEMA_NAME).read_bytes()
        for slot, f in enumerate(pub._files):
            assert f is not None
            length = int(pub._slot_tab[slot][2])
            raw = bytes(f.map[:length])
            assert raw.startswith(schema_bytes)
            assert raw.endswith(b"\xff\xff\xff\xff\x00\x00\x00\x00")
            reader = pa.ipc.open_stream(raw)
            batch, custom = reader.read_next_batch_with_custom_metadata()
            seq = int(pub._slot_tab[slot][0])
            assert_outputs_equal(from_record_batch(batch, custom_metadata=custom), _step(seq))
            with pytest.raises(StopIteration):
                reader.read_next_batch()


def test_a_larger_step_gets_a_larger_slot_file(run_dir: Path) -> None:
    big = ModelRunnerOutput(
        req_ids=[f"r{i}" for i in range(3000)],
        req_id_to_index={f"r{i}": i for i in range(3000)},
        sampled_token_ids=[[i, i + 1] for i in range(3000)],
    )
    with StepPublisher(run_dir, slots=2) as pub, StepSubscriber(run_dir) as sub:
        pub.publish(_batch(1))
        pub.publish(_batch(2))
        assert [s.seq for s in (sub.next(timeout=5), sub.next(timeout=5)) if s] == [1, 2]
        small = pub._files[0]
        assert small is not None
        batch = to_record_batch(big, step=3, schema=pub.schema)
        assert batch.nbytes > small.capacity  # cannot fit: a new, larger generation
        pub.publish(batch)
        step = sub.next(timeout=5)
        assert step is not None
        assert int(pub._slot_tab[0][1]) == 2
        assert _inside(step.batch, sub, 3)
        assert_outputs_equal(step.output(), big)
        assert pub.stats.replaced_slots == 0  # grown, not replaced for a holder
        assert len(list(run_dir.glob("slot-*"))) == 2


@pytest.mark.skipif(_accel._bridge is None, reason="arrow_outputs._arrowbridge not loaded")
def test_arrows_writer_in_one_call_writes_pyarrows_bytes(tmp_path: Path) -> None:
    """The C path writes each slot's message with _arrowbridge.write_message; the pure path
    with pyarrow's stream writer. Every slot holds the same bytes either way: small steps,
    a step that outgrows its file, and custom metadata given as a KeyValueMetadata (which
    goes to pyarrow's writer on both paths)."""
    big = ModelRunnerOutput(
        req_ids=[f"r{i}" for i in range(3000)],
        req_id_to_index={f"r{i}": i for i in range(3000)},
        sampled_token_ids=[[i, i + 1] for i in range(3000)],
    )
    written: dict[str, list[bytes]] = {}
    pyarrows_writer: dict[str, list[bool]] = {}
    for path in ("c", "python"):
        run = tmp_path / path
        with codec_on(path), StepPublisher(run, slots=2) as pub, StepSubscriber(run) as sub:
            raws = []
            for seq in range(1, 7):
                batch = to_record_batch(big if seq == 4 else _step(seq), step=seq)
                custom = step_custom_metadata(batch)
                pub.publish(batch, pa.KeyValueMetadata(custom) if seq == 5 else None)
                step = sub.next(timeout=5)
                assert step is not None
                assert_outputs_equal(step.output(), big if seq == 4 else _step(seq))
                slot = (seq - 1) % 2
                f = pub._files[slot]
                assert f is not None
                raws.append(bytes(f.map[: int(pub._slot_tab[slot][2])]))
                if seq == 3:
                    pyarrows_writer[path] = [
                        g is not None and g.writer is not None for g in pub._files
                    ]
                del step
            written[path] = raws
        remove_run(run)
    assert written["c"] == written["python"]
    assert pyarrows_writer == {"c": [False, False], "python": [True, True]}


def _sleeping(pub: StepPublisher) -> bool:
    return any(r[6] and r[0] == 1 for r in pub._rows)  # R_SLEEPING of an ACTIVE row


@pytest.mark.parametrize("closing", [False, True])
def test_a_sleeping_subscriber_is_woken_through_its_fifo(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, closing: bool
) -> None:
    """Past its spin, a subscriber sleeps on its FIFO; a publish (or the run's close) wakes
    it. With the sleeper's own re-check pushed out to 60 s, only the FIFO can end its wait
    before next()'s 20 s timeout."""
    import threading

    import arrow_outputs.sharing as sharing

    monkeypatch.setattr(sharing, "_WAKE_CAP_S", 60.0)
    got: list[Any] = []
    with StepPublisher(run_dir) as pub, StepSubscriber(run_dir, spin_s=0.0) as sub:
        fifos = list(run_dir.glob("wake-*"))
        assert len(fifos) == 1
        assert fifos[0].is_fifo()

        def read() -> None:
            try:
                got.append(sub.next(timeout=20))
            except Exception as e:  # reported to the main thread
                got.append(e)

        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 10
        while not _sleeping(pub) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert _sleeping(pub)
        if closing:
            pub.close(unlink=False)
        else:
            pub.publish(_batch(1))
        reader.join(30)
        assert not reader.is_alive()
        assert pub.stats.wakeups == 1
        if closing:
            assert got == [None]
        else:
            assert got[0].seq == 1
            assert_outputs_equal(got[0].output(), _step(1))
        assert not _sleeping(pub)
    assert not fifos[0].exists()  # the subscriber's close() removed its FIFO


def test_publish_skips_the_fifo_of_a_subscriber_that_is_awake(run_dir: Path) -> None:
    with StepPublisher(run_dir) as pub, StepSubscriber(run_dir) as sub:
        for seq in range(1, 4):
            pub.publish(_batch(seq))
            assert sub.next(timeout=5) is not None
        assert pub.stats.wakeups == 0  # no syscall on the publisher's side


def test_remove_run_removes_a_dead_subscribers_fifo(run_dir: Path) -> None:
    pub = StepPublisher(run_dir)
    sub = StepSubscriber(run_dir)
    assert len(list(run_dir.glob("wake-*"))) == 1
    pub.close(unlink=False)
    del sub  # (its close() removes the FIFO; a killed one leaves it)
    os.mkfifo(run_dir / "wake-0003-00000000000000ff")
    remove_run(run_dir)
    assert not run_dir.exists()


def test_slow_subscriber_is_evicted_after_the_bound(run_dir: Path) -> None:
    pub = StepPublisher(run_dir, slots=2, lag_timeout_s=0.05)
    slow = StepSubscriber(run_dir)
    with StepSubscriber(run_dir) as fast:
        for seq in range(1, 5):
            pub.publish(_batch(seq))  # never blocks for longer than the bound
            assert fast.next(timeout=5) is not None
    assert pub.stats.evicted == 1
    assert pub.stats.evicted_pids == [os.getpid()]
    with pytest.raises(SubscriberEvictedError, match="evicted by the publisher"):
        slow.next(timeout=1)
    slow.close()
    with StepSubscriber(run_dir) as again:  # a new subscriber attaches at the next step
        pub.publish(_batch(5))
        step = again.next(timeout=5)
        assert step is not None
        assert step.seq == 5
    pub.close()


def test_on_lag_raise_publishes_nothing(run_dir: Path) -> None:
    pub = StepPublisher(run_dir, slots=2, lag_timeout_s=0.02, on_lag="raise")
    sub = StepSubscriber(run_dir)
    pub.publish(_batch(1))
    pub.publish(_batch(2))
    with pytest.raises(StepTimeoutError, match="to read step 1"):
        pub.publish(_batch(3))
    assert pub.head == 2
    assert [sub.next(timeout=5).seq for _ in range(2)] == [1, 2]  # type: ignore[union-attr]
    assert pub.publish(_batch(3)) == 3  # room again
    assert sub.next(timeout=5).seq == 3  # type: ignore[union-attr]
    sub.close()
    pub.close()


def test_closed_subscriber_with_live_batch_keeps_its_slot(run_dir: Path) -> None:
    pub = StepPublisher(run_dir, slots=2)
    sub = StepSubscriber(run_dir)
    pub.publish(_batch(1))
    held = sub.next(timeout=5)
    assert held is not None
    before = _snapshot(held.batch)
    sub.close()  # detached, but the batch lives on in this process
    for seq in range(2, 6):
        pub.publish(_batch(seq))
    assert _snapshot(held.batch) == before
    pub.close()


def test_copy_mode_reads_private_memory(run_dir: Path) -> None:
    with StepPublisher(run_dir) as pub, StepSubscriber(run_dir, copy=True) as sub:
        pub.publish(_batch(1))
        step = sub.next(timeout=5)
        assert step is not None
        assert not _inside(step.batch, sub, 1)
        assert_outputs_equal(step.output(), _step(1))


def test_default_path_is_on_dev_shm_and_removed() -> None:
    pub = StepPublisher()
    path = pub.path
    if Path("/dev/shm").is_dir():
        assert path.parent == Path("/dev/shm")
    pub.publish(_batch(1))
    assert (path / CONTROL_NAME).exists()
    pub.close()
    assert not path.exists()


def test_publisher_refuses_existing_dir_and_bad_settings(run_dir: Path) -> None:
    run_dir.mkdir()
    with pytest.raises(FileExistsError):
        StepPublisher(run_dir)
    run_dir.rmdir()
    with pytest.raises(FieldTypeError, match="slots: expected an int within 2"):
        StepPublisher(run_dir, slots=1)
    with pytest.raises(FieldTypeError, match="on_lag: expected one of"):
        StepPublisher(run_dir, on_lag="block")


def test_publish_refuses_another_schema(run_dir: Path) -> None:
    with StepPublisher(run_dir) as pub:
        pub.publish(_batch(1))
        out = _step(2)
        lp = out.logprobs
        assert lp is not None
        out.logprobs = LogprobsLists(lp.logprob_token_ids.astype(np.int32), *lp[1:])
        other = to_record_batch(out, step=2)  # int32 logprob ids: another schema
        with pytest.raises(SchemaMismatchError, match="the run's schema"):
            pub.publish(other)
        assert pub.head == 1


@pytest.mark.parametrize("custom", [{b"k": 1}, {1: b"v"}, 5, [(b"k", None)]])
def test_publish_refuses_bad_custom_metadata_before_touching_a_slot(
    custom: Any, run_dir: Path
) -> None:
    with StepPublisher(run_dir, slots=2) as pub, StepSubscriber(run_dir) as sub:
        pub.publish(_batch(1))
        with pytest.raises(FieldTypeError, match="custom_metadata"):
            pub.publish(_batch(2), custom)
        assert pub.head == 1
        assert [int(e[0]) for e in pub._slot_tab] == [1, 0]  # S_SEQ: slot 1 never taken
        pub.publish(_batch(2))
        assert [s.seq for s in (sub.next(timeout=5), sub.next(timeout=5)) if s] == [1, 2]


def test_max_consumers_full(run_dir: Path) -> None:
    with (
        StepPublisher(run_dir, max_consumers=1),
        StepSubscriber(run_dir),
        pytest.raises(SharingError, match="a free row of the publisher's 1"),
    ):
        StepSubscriber(run_dir)


def test_subscriber_timeout(run_dir: Path) -> None:
    with (
        StepPublisher(run_dir),
        StepSubscriber(run_dir, spin_s=0.001) as sub,
        pytest.raises(StepTimeoutError, match="step 1: expected to be published"),
    ):
        sub.next(timeout=0.05)


# ----------------------------------------------------------------------------- hostile bytes


def test_corrupt_slot_length_is_refused(run_dir: Path) -> None:
    with StepPublisher(run_dir) as pub, StepSubscriber(run_dir) as sub:
        pub.publish(_batch(1))
        pub._slot_tab[0][2] = 1 << 40  # S_LEN beyond the file
        with pytest.raises(CorruptSegmentError, match=r"control.slot\[0\].length"):
            sub.next(timeout=5)


def test_corrupt_slot_generation_is_refused(run_dir: Path) -> None:
    with StepPublisher(run_dir) as pub, StepSubscriber(run_dir) as sub:
        pub.publish(_batch(1))
        pub._slot_tab[0][1] = 77  # S_GEN of a file that does not exist
        with pytest.raises(CorruptSegmentError, match="generation 77"):
            sub.next(timeout=5)


def test_garbage_message_is_refused_and_reader_recovers(run_dir: Path) -> None:
    with StepPublisher(run_dir, slots=2) as pub, StepSubscriber(run_dir) as sub:
        pub.publish(_batch(1))
        f = pub._files[0]
        assert f is not None
        start = pub._schema_len
        f.map[start : start + 64] = b"\xa5" * 64  # the batch message's header
        with pytest.raises(CorruptSegmentError, match=r"slot 0 \(step 1\)"):
            sub.next(timeout=5)
        assert sub.position == 1  # the refused step is skipped, not retried
        pub.publish(_batch(2))
        step = sub.next(timeout=5)  # a fresh reader: later steps read fine
        assert step is not None
        assert step.seq == 2
        assert_outputs_equal(step.output(), _step(2))


def test_corrupt_offsets_fail_full_validation(run_dir: Path) -> None:
    batch = _batch(1)
    with StepPublisher(run_dir) as pub, StepSubscriber(run_dir) as sub:
        pub.publish(batch)
        f = pub._files[0]
        assert f is not None
        # Find the sampled_token_ids offsets inside the slot by reading a private copy.
        raw = pa.py_buffer(bytes(f.map[: pub._files[0].capacity]))  # type: ignore[union-attr]
        copy = pa.ipc.open_stream(raw).read_next_batch()
        offsets = copy.column("sampled_token_ids").buffers()[1]
        at = offsets.address - raw.address
        bad = np.frombuffer(f.map, dtype=np.uint8)
        bad[at : at + 4] = np.frombuffer(np.int32(1 << 30).tobytes(), dtype=np.uint8)
        del bad
        with pytest.raises(SchemaMismatchError, match="full validation"):
            sub.next(timeout=5)


def _message_metadata(custom: list[tuple[bytes, bytes]] | None) -> pa.Buffer:
    """The flatbuffer of one record-batch message written by pyarrow with ``custom``."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, _schema()) as w:
        kv = None if custom is None else pa.KeyValueMetadata(custom)
        w.write_batch(_batch(1), custom_metadata=kv)
    reader = pa.BufferReader(sink.getvalue())
    pa.ipc.read_message(reader)  # the schema message
    return pa.ipc.read_message(reader).metadata


@pytest.mark.parametrize(
    "custom",
    [
        None,
        [],
        [(b"arrow_outputs.step", b'{"step": 1}')],
        [(b"a", b""), (b"", b"b"), (b"a", b"again"), (b"\x00\xff", b"x" * 5000)],
    ],
)
def test_custom_metadata_reader_matches_pyarrow(custom: list[tuple[bytes, bytes]] | None) -> None:
    meta = _message_metadata(custom)
    assert _custom_metadata(memoryview(meta), "m") == (custom or [])
    # The same through pyarrow's own stream reader.
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, _schema()) as w:
        w.write_batch(_batch(1), custom_metadata=None if custom is None else dict(custom))
    _, kv = pa.ipc.open_stream(sink.getvalue()).read_next_batch_with_custom_metadata()
    assert dict(_custom_metadata(memoryview(meta), "m")) == dict(kv or {})


def test_custom_metadata_reader_refuses_hostile_flatbuffers() -> None:
    """Truncated and mutated message flatbuffers: a CorruptSegmentError or a list of byte
    pairs, never another exception, never a read outside the bytes."""
    meta = _message_metadata([(b"arrow_outputs.step", b"{}"), (b"k", b"v")]).to_pybytes()
    for cut in range(len(meta)):
        try:
            got = _custom_metadata(meta[:cut], "m")
        except CorruptSegmentError:
            continue
        assert all(isinstance(k, bytes) and isinstance(v, bytes) for k, v in got)
    rng = np.random.default_rng(8)
    messages: set[str] = set()
    for _ in range(1500):
        bad = bytearray(meta)
        for at in rng.integers(0, len(bad), size=int(rng.integers(1, 4))):
            bad[at] = int(rng.integers(0, 256))
        try:
            got = _custom_metadata(bytes(bad), "m")
        except CorruptSegmentError as e:
            messages.add(str(e).split(":")[0])
            continue
        assert all(isinstance(k, bytes) and isinstance(v, bytes) for k, v in got)
        assert sum(len(k) + len(v) for k, v in got) <= len(bad)
    assert messages == {"m custom_metadata"}  # refused, and only by the flatbuffer checks
    with pytest.raises(CorruptSegmentError, match="flatbuffer within 8 bytes"):
        _custom_metadata(b"\xff\xff\xff\x7f\x00\x00\x00\x00", "m")


def test_lying_custom_metadata_offsets_in_a_slot_are_refused(run_dir: Path) -> None:
    """A slot whose message flatbuffer lies is refused (by Arrow's flatbuffer check or by
    the custom metadata reader), the step is skipped and later steps read fine."""
    with StepPublisher(run_dir, slots=2) as pub, StepSubscriber(run_dir) as sub:
        pub.publish(_batch(1))
        f = pub._files[0]
        assert f is not None
        start = pub._schema_len + 8  # continuation marker and length, then the flatbuffer
        f.map[start : start + 4] = (1 << 30).to_bytes(4, "little")  # root offset far away
        with pytest.raises(CorruptSegmentError, match=r"slot 0 \(step 1\)"):
            sub.next(timeout=5)
        assert sub.position == 1
        pub.publish(_batch(2))
        step = sub.next(timeout=5)
        assert step is not None
        assert_outputs_equal(step.output(), _step(2))


def test_end_of_stream_in_place_of_the_batch_is_refused(run_dir: Path) -> None:
    with StepPublisher(run_dir, slots=2) as pub, StepSubscriber(run_dir) as sub:
        pub.publish(_batch(1))
        f = pub._files[0]
        assert f is not None
        start = pub._schema_len
        f.map[start : start + 8] = b"\xff\xff\xff\xff\x00\x00\x00\x00"
        with pytest.raises(CorruptSegmentError, match="end of stream"):
            sub.next(timeout=5)
        pub.publish(_batch(2))
        step = sub.next(timeout=5)
        assert step is not None
        assert_outputs_equal(step.output(), _step(2))


def _published_message(pub: StepPublisher, batch: pa.RecordBatch) -> tuple[int, Any, int, int]:
    """Publish ``batch``: its step, the slot file it went to, and where its batch message
    lies in that file (after the schema message, before the end-of-stream marker)."""
    seq = pub.publish(batch)
    slot = (seq - 1) % pub._slots
    f = pub._files[slot]
    assert f is not None
    return seq, f, pub._schema_len, int(pub._slot_tab[slot][2]) - 8


def test_mutated_slot_messages_give_only_our_errors(run_dir: Path) -> None:
    """Random byte changes in a slot's batch message (header and body): every read either
    returns a batch that passed full validation or raises an arrow_outputs error."""
    rng = np.random.default_rng(88)
    with StepPublisher(run_dir, slots=2) as pub, StepSubscriber(run_dir) as sub:
        refused = 0
        for i in range(300):
            seq, f, start, end = _published_message(pub, _batch(1 + i % 5))
            span = min(end - start, 600) if i % 2 else end - start  # the header, or anywhere
            for at in start + rng.integers(0, span, size=int(rng.integers(1, 5))):
                f.map[int(at)] = int(rng.integers(0, 256))
            try:
                step = sub.next(timeout=5)
            except ArrowOutputsError:
                refused += 1
                continue
            assert step is not None
            assert step.seq == seq
        assert refused > 0
        assert sub.position == pub.head  # refused steps are skipped, never retried


def _raw_layout(batch: pa.RecordBatch) -> list[Any]:
    return [
        (str(col.type), len(col), [None if b is None else b.to_pybytes() for b in col.buffers()])
        for col in batch.columns
    ]


@pytest.mark.skipif(_accel._bridge is None, reason="arrow_outputs._arrowbridge not loaded")
def test_arrows_reader_in_one_call_reads_as_pyarrow_reads(run_dir: Path) -> None:
    """The C path reads a slot's message with _arrowbridge.read_message, the pure path with
    pyarrow's read_message and read_record_batch: over intact and mutated messages (header
    and body), both give the same batch and custom metadata, or both refuse alike."""
    rng = np.random.default_rng(89)
    taken = 0
    with StepPublisher(run_dir, slots=2) as pub, StepSubscriber(run_dir) as sub:
        for i in range(400):
            _, f, start, end = _published_message(pub, _batch(1 + i % 5))
            raw = bytearray(f.map[start:end])
            assert sub.next(timeout=5) is not None
            if i % 4:  # one in four intact
                span = min(len(raw), 600) if i % 2 else len(raw)
                for at in rng.integers(0, span, size=int(rng.integers(1, 5))):
                    raw[int(at)] = int(rng.integers(0, 256))
            data = pa.py_buffer(bytes(raw))
            seen = []
            for path in ("c", "python"):
                with codec_on(path):
                    try:
                        batch, custom = sub._decode(data, "m")
                    except ArrowOutputsError as e:
                        seen.append((type(e), str(e)))
                    else:
                        seen.append((batch, custom))
            if isinstance(seen[0][0], pa.RecordBatch) and isinstance(seen[1][0], pa.RecordBatch):
                taken += 1
                # Compared buffer by buffer: an unvalidated batch is not safe to read by
                # its offsets (equals() would).
                assert _raw_layout(seen[0][0]) == _raw_layout(seen[1][0])
                assert seen[0][1] == seen[1][1]
            else:
                assert seen[0] == seen[1]
    assert taken > 100


def test_control_file_of_another_layout_is_refused(run_dir: Path) -> None:
    run_dir.mkdir()
    (run_dir / CONTROL_NAME).write_bytes(b"AOSHARE1" + b"\x07" + b"\x00" * 200)
    with pytest.raises(CorruptSegmentError, match="layout version"):
        StepSubscriber(run_dir, attach_timeout_s=0.2)
    (run_dir / CONTROL_NAME).write_bytes(b"not a run")
    with pytest.raises(StepTimeoutError, match="a run's control file"):
        StepSubscriber(run_dir, attach_timeout_s=0.05)


def test_control_file_with_wrong_size_is_refused(run_dir: Path) -> None:
    with StepPublisher(run_dir, slots=4):
        data = (run_dir / CONTROL_NAME).read_bytes()
        other = run_dir.parent / "other"
        other.mkdir()
        (other / CONTROL_NAME).write_bytes(data + b"\x00" * 8)
        with pytest.raises(CorruptSegmentError, match="bytes for 4 slots"):
            StepSubscriber(other)
        remove_run(other)


# ----------------------------------------------------------------------------- processes


def test_two_consumer_processes_zero_copy_and_held_batch_unchanged(
    run_dir: Path, tmp_path: Path
) -> None:
    steps = 16
    outs = [tmp_path / "c0.json", tmp_path / "c1.json"]
    pub = StepPublisher(run_dir, slots=4, lag_timeout_s=CHILD_TIMEOUT)
    procs = [
        SPAWN.Process(target=_consumer, args=(str(run_dir), str(out), steps, i == 0))
        for i, out in enumerate(outs)
    ]
    for p in procs:
        p.start()
    try:
        pub.wait_for_subscribers(2, timeout=CHILD_TIMEOUT)
        for seq in range(1, steps + 1):
            assert pub.publish(_batch(seq)) == seq  # waits for the children: slots=4
        pub.close()
    finally:
        for p in procs:
            _join(p)
    reports = [json.loads(o.read_text()) for o in outs]
    for r in reports:
        assert "error" not in r, r["error"]
        assert r["seqs"] == list(range(1, steps + 1))
        assert r["zero_copy"] is True
        assert r["end"] is True
    assert reports[0]["held_same"] is True
    assert pub.stats.lag_waits >= 1  # the children were slower: the ring filled up
    assert pub.stats.replaced_slots >= 1  # the held slot was replaced, not rewritten
    assert pub.stats.evicted == 0


def test_dead_consumer_does_not_block_the_producer(run_dir: Path, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    pub = StepPublisher(run_dir, slots=2, lag_timeout_s=CHILD_TIMEOUT)
    child = SPAWN.Process(target=_idle_consumer, args=(str(run_dir), str(ready)))
    child.start()
    try:
        pub.wait_for_subscribers(1, timeout=CHILD_TIMEOUT)
        os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
        child.join(CHILD_TIMEOUT)
        start = time.monotonic()
        for seq in range(1, 7):
            pub.publish(_batch(seq))
        waited = time.monotonic() - start
    finally:
        if child.is_alive():
            child.kill()
        pub.close()
    assert pub.stats.evicted == 1
    assert pub.stats.evicted_pids == [child.pid]
    assert waited < CHILD_TIMEOUT / 2  # dropped at once, not after lag_timeout_s


def test_consumer_notices_a_dead_producer(run_dir: Path) -> None:
    child = SPAWN.Process(target=_crashing_producer, args=(str(run_dir), 2))
    child.start()
    try:
        sub = StepSubscriber(run_dir, spin_s=0.001, attach_timeout_s=CHILD_TIMEOUT)
        got = [sub.next(timeout=CHILD_TIMEOUT) for _ in range(2)]
        assert [s.seq for s in got if s is not None] == [1, 2]
        for s in got:
            assert s is not None
            assert_outputs_equal(s.output(), _step(s.seq))
        _join(child)
        with pytest.raises(ProducerGoneError, match="without close"):
            sub.next(timeout=CHILD_TIMEOUT)
        sub.close()
    finally:
        if child.is_alive():
            child.kill()


def test_subscriber_waits_while_the_control_file_is_still_empty(run_dir: Path) -> None:
    # A publisher creates its control file, then sizes it: a subscriber attaching in between
    # sees 0 bytes and must wait, not call the run corrupt.
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "control").touch()
    start = time.monotonic()
    with pytest.raises(CorruptSegmentError, match="0 bytes"):
        StepSubscriber(run_dir, attach_timeout_s=0.3)  # still empty at the deadline
    assert time.monotonic() - start >= 0.3  # it waited for the publisher to size the file
