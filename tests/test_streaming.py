"""OutputWriter, run readers, follow and recover (docs/streaming.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import decode_step as make_step

import arrow_outputs as ao
from arrow_outputs.writer import KEY_END, KEY_PROGRESS

ROOT = Path(__file__).resolve().parent.parent


STEPS = [make_step(s, n) for s, n in enumerate((3, 5, 0, 4, 1))]


def write_run(path, steps=STEPS, **kw) -> None:
    with ao.OutputWriter(path, **kw) as writer:
        for out in steps:
            writer.write(out)


def assert_steps(outputs, steps=STEPS) -> None:
    outputs = list(outputs)
    assert len(outputs) == len(steps)
    for got, want in zip(outputs, steps, strict=True):
        ao.assert_outputs_equal(got, want)


# -- writing -----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["stream", "file"])
@pytest.mark.parametrize("compression", [None, "lz4", "zstd"])
def test_round_trip_every_format(tmp_path, fmt, compression):
    path = tmp_path / "run.arrow"
    write_run(path, format=fmt, compression=compression, run_metadata={"model": "toy"})
    run = ao.open_run(path)
    assert run.format == fmt
    assert run.complete
    assert run.end == ao.reader.RunEnd(steps=5, rows=13, dropped=0)
    assert ao.run_metadata(run.schema) == {"model": "toy"}
    assert [s.step for s in run] == [0, 1, 2, 3, 4]
    assert_steps(run.outputs())
    assert_steps(ao.iter_outputs(path))


@pytest.mark.parametrize("validate", [True, False])
def test_outputs_validate_each_batch_once(tmp_path, monkeypatch, validate):
    """``outputs()`` of a reader that validated its batches in full does not validate them
    again in their decode; a reader of a trusted file leaves it to the decode, as before."""
    import arrow_outputs.batch as codec

    path = tmp_path / "run.arrows"
    write_run(path)
    full, decoded = codec._validate_full, []

    def counted(batch):
        decoded.append(batch)
        full(batch)

    monkeypatch.setattr(codec, "_validate_full", counted)
    run = ao.open_run(path, validate=validate)
    assert_steps(run.outputs())
    assert len(decoded) == (0 if validate else len(STEPS))


def test_every_batch_carries_running_counts(tmp_path):
    path = tmp_path / "run.arrows"
    write_run(path)
    reader = pa.ipc.open_stream(pa.memory_map(str(path)))
    seen = []
    while True:
        try:
            batch, meta = reader.read_next_batch_with_custom_metadata()
        except StopIteration:
            break
        seen.append((batch.num_rows, meta))
    progress = [json.loads(m[KEY_PROGRESS]) for _, m in seen[:-1]]
    assert [p["index"] for p in progress] == [0, 1, 2, 3, 4]
    assert [p["rows"] for p in progress] == [3, 8, 8, 12, 13]
    assert seen[-1][0] == 0
    assert json.loads(seen[-1][1][KEY_END]) == {"steps": 5, "rows": 13, "dropped": 0}


def test_stream_cut_at_a_message_boundary_reads_as_incomplete(tmp_path):
    path = tmp_path / "run.arrows"
    write_run(path)
    data = path.read_bytes()
    # Re-read message by message to find where step 3 ends.
    stream = pa.BufferReader(data)
    reader = pa.ipc.open_stream(stream)
    for _ in range(4):
        reader.read_next_batch()
    cut = stream.tell()
    short = ao.open_run(data[:cut])
    assert len(short) == 4
    assert not short.complete  # plain pyarrow would read 4 steps and say nothing


def test_writer_accepts_vllm_like_objects_batches_and_async_outputs(tmp_path):
    class Foreign:  # duck typed like vLLM's ModelRunnerOutput
        def __init__(self, out):
            for name in ao.ModelRunnerOutput.__dataclass_fields__:
                setattr(self, name, getattr(out, name))

    class Async(ao.AsyncModelRunnerOutput):
        def __init__(self, out):
            self.out, self.calls = out, []

        def get_output(self):
            self.calls.append(threading.current_thread().name)
            return self.out

        def get_kv_connector_output(self):
            return None

    path = tmp_path / "run.arrows"
    first = ao.to_record_batch(STEPS[0], step=0)
    pending = Async(STEPS[2])
    with ao.OutputWriter(path) as writer:
        writer.write(first)
        writer.write(Foreign(STEPS[1]))
        writer.write(pending)
    # The async result was taken on the writer's thread, not the caller's.
    assert pending.calls == ["arrow_outputs-writer"]
    assert_steps(ao.iter_outputs(path), STEPS[:3])


def test_batch_read_from_a_file_is_written_with_its_own_step_json(tmp_path):
    src = tmp_path / "a.arrows"
    write_run(src)
    dst = tmp_path / "b.arrows"
    with ao.OutputWriter(dst) as writer:
        for step in ao.open_run(src):
            writer.write(step.batch, custom_metadata=step.custom_metadata)
        # Without its message's metadata, a file's batch is refused (never another step's).
        with pytest.raises(ao.StepMetadataError):
            writer.write(ao.read_table(src).to_batches()[1])
    assert_steps(ao.iter_outputs(dst), STEPS)


def test_error_in_background_thread_surfaces_and_leaves_run_incomplete(tmp_path):
    path = tmp_path / "run.arrows"
    writer = ao.OutputWriter(path)
    writer.write(STEPS[1])
    bad = ao.ModelRunnerOutput(["x"], {"x": 0}, [[1.5]])  # a float token id
    writer.write(bad)
    with pytest.raises(ao.FieldTypeError, match="sampled_token_ids"):
        writer.flush()
    with pytest.raises(ao.WriterError, match="stopped after an error"):
        writer.write(STEPS[1])
    with pytest.raises(ao.WriterError):
        writer.close()
    run = ao.open_run(path)
    assert len(run) == 1
    assert not run.complete


def test_error_surfaces_on_close_when_not_raised_before(tmp_path):
    writer = ao.OutputWriter(tmp_path / "run.arrows")
    writer.write(ao.ModelRunnerOutput(["x"], {"x": 1}, [[1]]))  # index disagrees
    with pytest.raises(ao.ConsistencyError):
        writer.close()


def test_schema_fixed_at_first_step(tmp_path):
    writer = ao.OutputWriter(tmp_path / "run.arrows")
    writer.write(STEPS[1])
    lp = ao.LogprobsLists(np.ones((1, 4), np.int32), np.ones((1, 4), np.float32), np.ones(1))
    writer.write(ao.ModelRunnerOutput(["a"], {"a": 0}, [[1]], lp))  # int32 ids, run has int64
    with pytest.raises(ao.DTypeError, match="logprob"):
        writer.close()


class Gated(ao.AsyncModelRunnerOutput):
    """An async output whose result waits for ``gate``: it holds the writer's thread."""

    def __init__(self, gate: threading.Event):
        self.gate = gate

    def get_output(self):
        self.gate.wait(10)
        return STEPS[1]

    def get_kv_connector_output(self):
        return None


def test_drop_policy_counts_drops_in_the_file(tmp_path):
    gate = threading.Event()
    path = tmp_path / "run.arrows"
    writer = ao.OutputWriter(path, queue_size=1, on_full="drop")
    writer.write(Gated(gate))  # taken by the thread, which then waits
    deadline = time.monotonic() + 5
    while writer.stats.queued and time.monotonic() < deadline:
        time.sleep(0.01)
    writer.write(STEPS[0])  # fills the queue
    writer.write(STEPS[3])  # dropped
    writer.write(STEPS[4])  # dropped
    assert writer.stats.dropped == 2
    gate.set()
    writer.close()
    run = ao.open_run(path)
    assert run.end is not None
    assert run.end.dropped == 2
    # Dropped steps keep their step numbers: the gap shows where.
    assert [s.step for s in run] == [0, 1]
    assert writer.stats == ao.WriterStats(steps=2, rows=8, queued=0, dropped=2)


def test_block_policy_applies_back_pressure(tmp_path):
    gate = threading.Event()
    writer = ao.OutputWriter(tmp_path / "run.arrows", queue_size=1)
    writer.write(Gated(gate))
    while writer.stats.queued:
        time.sleep(0.01)
    writer.write(STEPS[0])
    done = threading.Event()
    t = threading.Thread(target=lambda: (writer.write(STEPS[3]), done.set()))
    t.start()
    assert not done.wait(0.3)  # blocked: the queue is full
    gate.set()
    assert done.wait(10)
    t.join()
    writer.close()
    assert writer.stats.steps == 3
    assert writer.stats.dropped == 0


def test_writes_from_several_threads(tmp_path):
    path = tmp_path / "run.arrows"
    with ao.OutputWriter(path, queue_size=4) as writer:

        def produce(k):
            for i in range(20):
                writer.write(make_step(100 * k + i, 2, seed=k))

        threads = [threading.Thread(target=produce, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    run = ao.open_run(path)
    assert run.complete
    assert len(run) == 80
    # Step numbers are unique and in queue order; every step arrived whole.
    assert sorted(s.step for s in run) == list(range(80))
    ids = sorted(r for out in run.outputs() for r in out.req_ids)
    want = sorted(f"req-{100 * k + i}-{j}" for k in range(4) for i in range(20) for j in range(2))
    assert ids == want


def test_writer_to_python_stream_and_empty_run(tmp_path):
    import io

    sink = io.BytesIO()
    with ao.OutputWriter(sink):
        pass
    run = ao.open_run(sink.getvalue())
    assert run.complete
    assert len(run) == 0
    assert run.read_all().num_rows == 0


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"format": "parquet"}, "format"),
        ({"compression": "gzip"}, "compression"),
        ({"queue_size": 0}, "queue_size"),
        ({"on_full": "wait"}, "on_full"),
        ({"run_metadata": [1]}, "run_metadata"),
    ],
)
def test_bad_arguments(tmp_path, kw, field):
    with pytest.raises(ao.FieldTypeError) as info:
        ao.OutputWriter(tmp_path / "x.arrows", **kw)
    assert info.value.field == field


def test_bad_write_arguments(tmp_path):
    with ao.OutputWriter(tmp_path / "x.arrows") as writer:
        with pytest.raises(ao.FieldTypeError, match="step_output"):
            writer.write({"req_ids": []})
        with pytest.raises(ao.FieldTypeError, match="custom_metadata"):
            writer.write(STEPS[0], custom_metadata={b"arrow_outputs.step": b"{}"})
    with pytest.raises(ao.WriterError, match="after close"):
        writer.write(STEPS[0])


# -- reading -----------------------------------------------------------------------------


def test_read_table_is_zero_copy_over_the_memory_map(tmp_path):
    path = tmp_path / "big.arrows"
    n, k = 2048, 20
    rng = np.random.default_rng(1)
    ids = [f"r{i}" for i in range(n)]
    with ao.OutputWriter(path) as writer:
        for _ in range(12):
            writer.write(
                ao.ModelRunnerOutput(
                    ids,
                    {r: i for i, r in enumerate(ids)},
                    [[1]] * n,
                    ao.LogprobsLists(
                        rng.integers(0, 32000, (n, k)),
                        rng.random((n, k), dtype=np.float32),
                        np.ones(n, np.int64),
                    ),
                )
            )
    size = path.stat().st_size
    assert size > 4_000_000
    before = pa.total_allocated_bytes()
    table = ao.read_table(path)
    grew = pa.total_allocated_bytes() - before
    assert table.num_rows == 12 * n
    assert grew < size // 100, f"reading allocated {grew} bytes for a {size}-byte file"
    # The columns' buffers lie inside the mapped file's pages.
    mapped = pa.memory_map(str(path)).read_buffer()
    table = ao.read_table(mapped)
    for name in ("req_id", "sampled_token_ids", "logprobs"):
        for chunk in table.column(name).chunks:
            for buf in _all_buffers(chunk):
                assert mapped.address <= buf.address < mapped.address + mapped.size, name


def _all_buffers(arr):
    bufs = [b for b in arr.buffers() if b is not None and b.size]
    return bufs


@pytest.mark.parametrize("tool", ["pandas", "polars", "duckdb"])
def test_reader_feeds_dataframe_tools(tmp_path, tool):
    path = tmp_path / "run.arrows"
    write_run(path)
    run = ao.open_run(path)
    if tool == "pandas":
        pd = pytest.importorskip("pandas")
        df = pd.DataFrame.from_arrow(run)
        assert list(df["req_id"]) == [r for out in STEPS for r in out.req_ids]
    elif tool == "polars":
        pl = pytest.importorskip("polars")
        df = pl.DataFrame(run)
        assert df["sampled_token_ids"].list.len().sum() == sum(
            len(t) for out in STEPS for t in out.sampled_token_ids
        )
    else:
        duckdb = pytest.importorskip("duckdb")
        got = duckdb.sql("select step, count(*) from run group by step order by step").fetchall()
        assert got == [(0, 3), (1, 5), (3, 4), (4, 1)]


def test_validation_catches_bad_offsets_before_any_view(tmp_path):
    path = tmp_path / "run.arrows"
    write_run(path, format="file")
    data = bytearray(path.read_bytes())
    mapped = pa.py_buffer(bytes(data))
    batch = ao.open_run(mapped)[1].batch
    # Corrupt the sampled_token_ids offsets of step 1 in the file's bytes.
    offsets = batch.column("sampled_token_ids").buffers()[1]
    at = offsets.address - mapped.address
    assert 0 < at < len(data)
    data[at + 4 : at + 8] = (10**6).to_bytes(4, "little")
    bad = bytes(data)
    run = ao.open_run(bad)
    run[0]  # other steps stay readable
    with pytest.raises(ao.CorruptFileError, match="batch 1"):
        run[1]
    with pytest.raises(ao.CorruptFileError):
        ao.read_table(bad)
    ao.open_run(bad, validate=False)[1]  # trusted: no check (and no view made here)


def test_not_a_run(tmp_path):
    path = tmp_path / "x.arrows"
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, pa.schema([("a", pa.int8())])) as w:
        w.write_batch(pa.record_batch([pa.array([1], pa.int8())], names=["a"]))
    with pytest.raises(ao.SchemaMismatchError, match=r"arrow_outputs\.format"):
        ao.open_run(path)
    with pytest.raises(ao.CorruptFileError, match="no-such"):
        ao.open_run(tmp_path / "no-such")
    with pytest.raises(ao.CorruptFileError):
        ao.open_run(b"ARROW1\x00\x00garbage")


# -- follow ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["stream", "file"])
def test_follow_yields_steps_while_the_writer_appends(tmp_path, fmt):
    path = tmp_path / "run.arrow"
    written = threading.Event()
    release = threading.Event()

    def produce():
        with ao.OutputWriter(path, format=fmt) as writer:
            for i, out in enumerate(STEPS):
                writer.write(out)
                if i == 1:
                    writer.flush()
                    written.set()
                    release.wait(10)

    t = threading.Thread(target=produce)
    t.start()
    got = []
    for step in ao.follow(path, poll_interval=0.01, idle_timeout=20):
        got.append(step.output())
        if len(got) == 2:
            assert written.is_set()
            release.set()  # the rest is written only now: follow waited at the tail
    t.join()
    assert_steps(got)


def test_follow_waits_at_a_partly_written_message(tmp_path):
    src = tmp_path / "full.arrows"
    write_run(src)
    data = src.read_bytes()
    path = tmp_path / "growing.arrows"
    path.write_bytes(data[: len(data) // 2])  # cut inside a message

    def finish():
        time.sleep(0.3)
        with open(path, "ab") as f:
            f.write(data[len(data) // 2 :])

    t = threading.Thread(target=finish)
    t.start()
    got = [s.output() for s in ao.follow(path, poll_interval=0.01, idle_timeout=20)]
    t.join()
    assert_steps(got)


def test_follow_gives_up_on_a_dead_writer_only_when_asked(tmp_path):
    src = tmp_path / "full.arrows"
    write_run(src)
    path = tmp_path / "dead.arrows"
    path.write_bytes(src.read_bytes()[:-200])
    seen = []

    def drain():
        for step in ao.follow(path, poll_interval=0.01, idle_timeout=0.3):
            seen.append(step.step)

    with pytest.raises(ao.CorruptFileError, match="idle_timeout"):
        drain()
    assert seen == [0, 1, 2, 3, 4]  # every whole step came first


# -- recovery ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["stream", "file"])
def test_recover_every_cut(tmp_path, fmt):
    path = tmp_path / "run.arrow"
    write_run(path, format=fmt)
    data = path.read_bytes()
    # Message ends: where each whole step stops.
    boundaries = _step_ends(data)
    rng = np.random.default_rng(2)
    cuts = sorted({*rng.integers(0, len(data), 40).tolist(), *boundaries, len(data)})
    for cut in cuts:
        src = tmp_path / "cut.arrow"
        src.write_bytes(data[:cut])
        out = tmp_path / "out.arrows"
        whole = sum(1 for b in boundaries if b <= cut)
        if cut < _schema_end(data):
            with pytest.raises(ao.CorruptFileError):
                ao.recover(src, out)
            continue
        report = ao.recover(src, out)
        assert report.steps == min(whole, len(STEPS)), cut
        run = ao.open_run(out)
        assert run.complete
        assert_steps(run.outputs(), STEPS[: report.steps])
        assert report.complete == (cut >= _end_marker_end(data, fmt))
        assert report.lost_bytes == (
            0 if report.complete else len(data[:cut]) - _used(data, report.steps)
        )


def _messages(data: bytes) -> list[int]:
    """Offsets where each IPC message of the stream part ends (schema first)."""
    start = 8 if data[:6] == b"ARROW1" else 0
    stream = pa.BufferReader(pa.py_buffer(data[start:]))
    reader = pa.ipc.MessageReader.open_stream(stream)
    ends = []
    while True:
        try:
            reader.read_next_message()
        except StopIteration:
            return ends
        ends.append(start + stream.tell())


def _schema_end(data: bytes) -> int:
    return _messages(data)[0]


def _step_ends(data: bytes) -> list[int]:
    return _messages(data)[1 : len(STEPS) + 1]


def _end_marker_end(data: bytes, fmt: str) -> int:
    return _messages(data)[len(STEPS) + 1]


def _used(data: bytes, steps: int) -> int:
    return _messages(data)[steps]


SIGKILL_WRITER = r"""
import sys
import numpy as np
import arrow_outputs as ao
sys.path.insert(0, sys.argv[3])
from test_streaming import make_step
with ao.OutputWriter(sys.argv[1], format=sys.argv[2]) as writer:
    for i in range(10_000):
        writer.write(make_step(i, 1 + i % 7, seed=9))
        writer.flush()
        print(i + 1, flush=True)
"""


@pytest.mark.parametrize("fmt", ["stream", "file"])
def test_recover_after_sigkill_at_random_moments(tmp_path, fmt):
    rng = np.random.default_rng(7 if fmt == "stream" else 8)
    script = tmp_path / "writer.py"
    script.write_text(SIGKILL_WRITER)
    for trial in range(6):
        path = tmp_path / f"run{trial}.arrow"
        with subprocess.Popen(
            [sys.executable, str(script), str(path), fmt, str(ROOT / "tests")],
            stdout=subprocess.PIPE,
            text=True,
        ) as proc:
            assert proc.stdout is not None
            target = int(rng.integers(1, 40))
            finished = 0
            for line in proc.stdout:
                finished = int(line)
                if finished >= target:
                    break
            time.sleep(float(rng.random()) * 0.02)  # land anywhere in the next step's write
            proc.kill()
            proc.wait()
            finished = max([finished, *(int(x) for x in proc.stdout.read().split())])
        out = tmp_path / f"out{trial}.arrows"
        report = ao.recover(path, out)
        # Every step the writer finished is there; at most the one in flight also made it.
        assert finished <= report.steps <= finished + 1, (trial, finished, report)
        assert not report.complete
        run = ao.open_run(out)
        assert run.complete
        want = [make_step(i, 1 + i % 7, seed=9) for i in range(report.steps)]
        assert_steps(run.outputs(), want)
        assert [s.step for s in run] == list(range(report.steps))


def test_recover_bad_arguments(tmp_path):
    with pytest.raises(ao.CorruptFileError):
        ao.recover(tmp_path / "none.arrows", tmp_path / "out.arrows")
    assert not os.path.exists(tmp_path / "out.arrows")


def test_a_file_without_its_footer_points_to_recover(tmp_path):
    path = tmp_path / "run.arrow"
    write_run(path, format="file")
    cut = tmp_path / "cut.arrow"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ao.CorruptFileError) as e:
        ao.open_run(cut)
    assert e.value.field == str(cut)
    assert "recover" in e.value.expected
    assert ao.recover(cut, tmp_path / "saved.arrows").steps > 0


def test_follow_refuses_bad_timings(tmp_path):
    path = tmp_path / "run.arrows"
    write_run(path)
    bad = [
        {"idle_timeout": -1},
        {"idle_timeout": float("nan")},
        {"idle_timeout": "5"},
        {"idle_timeout": True},
        {"poll_interval": 0},
        {"poll_interval": "0.1"},
    ]
    for kw in bad:
        with pytest.raises(ao.FieldTypeError) as e:
            next(ao.follow(path, **kw))
        assert e.value.field == next(iter(kw)), kw
    assert len(list(ao.follow(path, idle_timeout=0))) == len(STEPS)  # a closed run ends


def test_recover_refuses_to_write_over_its_source(tmp_path):
    path = tmp_path / "run.arrows"
    write_run(path)
    data = path.read_bytes()
    link = tmp_path / "link.arrows"
    link.symlink_to(path)
    for out in (path, str(path), link):
        with pytest.raises(ao.ConsistencyError) as e:
            ao.recover(path, out)
        assert e.value.field == "out"
    assert path.read_bytes() == data  # the run is untouched
    assert_steps(ao.open_run(path).outputs())


def test_schema_doc_specifies_the_run_keys_the_writer_writes():
    doc = (ROOT / "docs" / "schema.md").read_text()
    section = doc.split("## Runs: running counts and the end marker")[1].split("\n## ")[0]
    for key, fields in (
        (KEY_PROGRESS, '{"index", "steps", "rows", "dropped"}'),
        (KEY_END, '{"steps", "rows", "dropped"}'),
    ):
        assert f"`{key.decode()}`" in section
        assert fields in section


def test_abort_keeps_queued_steps_without_the_end_marker(tmp_path):
    path = tmp_path / "run.arrows"
    writer = ao.OutputWriter(path)
    for out in STEPS[:3]:
        writer.write(out)
    assert writer.abort() is None
    run = ao.open_run(path)
    assert not run.complete
    assert_steps(run.outputs(), STEPS[:3])
    with pytest.raises(ao.WriterError):
        writer.write(STEPS[0])
    bad = ao.OutputWriter(tmp_path / "bad.arrows")
    bad.write(ao.ModelRunnerOutput(["x"], {"x": 1}, [[1]]))
    assert isinstance(bad.abort(), ao.ConsistencyError)  # returned, not raised
