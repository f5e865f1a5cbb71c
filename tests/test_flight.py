"""arrow_outputs.flight: the Flight server and client, on loopback."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as fl
import pytest
from conftest import write_stream_lying_about_rows
from test_batch import _decode_requests, _decode_step, _empty, _speculative

import arrow_outputs as ao
from arrow_outputs.export import check_run_name
from arrow_outputs.flight import FlightRunClient, FlightRunServer, PutResult, serve
from arrow_outputs.reader import open_run
from arrow_outputs.writer import OutputWriter

TOKEN = "t0k3n-for-tests"


def _decode(n_req: int, seed: int) -> ao.ModelRunnerOutput:
    return _decode_requests(n_req, seed, width=4)


def _run(n: int, seed: int = 0) -> list[ao.ModelRunnerOutput]:
    return [_decode(1 + (seed + s) % 4, seed * 1000 + s) for s in range(n)]


def _same(want: list, got: list) -> None:
    assert len(got) == len(want)
    for a, b in zip(want, got):
        ao.assert_outputs_equal(a, b)


@pytest.fixture
def server(tmp_path):
    with FlightRunServer(tmp_path / "runs") as srv:
        yield srv


@pytest.fixture
def client(server):
    with FlightRunClient(server.location) as c:
        yield c


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# ----------------------------------------------------------------------------- put / get


def test_put_then_get_round_trips_outputs(server, client):
    outputs = [_decode_step(), _speculative(), _empty(), _decode_step()]
    result = client.put("run-1", outputs, run_metadata={"model": "tiny"})
    assert result == PutResult("run-1", 4, 3 + 4 + 0 + 3)
    stream = client.get("run-1")
    _same(outputs, list(stream.outputs()))
    assert stream.complete
    assert stream.totals == {"steps": 4, "rows": 10}
    assert ao.run_metadata(stream.schema) == {"model": "tiny"}
    # Stored with the writer: a complete run file that the readers open.
    stored = open_run(server.root / "run-1.arrows")
    assert stored.complete
    assert len(stored) == 4
    _same(outputs, list(stored.outputs()))
    table = client.read_table("run-1")
    assert table.column("req_id").to_pylist() == stored.read_all().column("req_id").to_pylist()


def test_put_accepts_batches_with_their_custom_metadata(server, client, tmp_path):
    outputs = _run(5, seed=2)
    with OutputWriter(tmp_path / "local.arrows") as writer:
        for out in outputs:
            writer.write(out)
    pairs = [(s.batch, s.custom_metadata) for s in open_run(tmp_path / "local.arrows")]
    assert client.put("from-file", pairs).steps == 5
    _same(outputs, list(client.outputs("from-file")))


def test_put_from_a_background_thread_sends_every_queued_step(server, client):
    outputs = _run(20, seed=4)
    upload = client.open_put("queued", queue_size=4)
    caller = threading.get_ident()
    sent_on: set[int] = set()
    real_send = upload._send

    def spy(*args):
        sent_on.add(threading.get_ident())
        real_send(*args)

    upload._send = spy
    for out in outputs:
        upload.write(out)
    result = upload.close()  # everything queued goes first
    assert result == PutResult("queued", 20, sum(len(o.req_ids) for o in outputs))
    assert sent_on
    assert caller not in sent_on  # encoded and sent off the caller's thread
    _same(outputs, list(client.outputs("queued")))


def test_put_from_a_background_thread_raises_the_servers_refusal_on_the_callers_thread(
    server, client
):
    client.put("taken", _run(1))
    upload = client.open_put("taken", queue_size=2)
    upload.write(_decode(1, 0))

    def keep_writing() -> None:
        for _ in range(100):  # the refusal lands on the thread, then surfaces here
            upload.write(_decode(1, 0))
            time.sleep(0.01)
        upload.close()

    with pytest.raises(ao.ConsistencyError, match=r"^server: run: expected a new run name"):
        keep_writing()
    with pytest.raises(ao.ConsistencyError, match=r"write\(\) after close"):
        upload.write(_decode(1, 0))
    assert client.run_info("taken").steps == 1


def test_get_replays_step_json_as_app_metadata_for_plain_flight_clients(server, client):
    outputs = _run(3)
    client.put("plain", outputs)
    chunks = []
    with fl.FlightClient(server.location) as raw:
        reader = raw.do_get(fl.Ticket(json.dumps({"run": "plain"}).encode()))
        while True:
            try:
                chunks.append(reader.read_chunk())
            except StopIteration:
                break
    assert len(chunks) == 4  # three steps and the end marker
    for out, chunk in zip(outputs, chunks):
        back = ao.from_record_batch(
            chunk.data, custom_metadata={b"arrow_outputs.step": chunk.app_metadata.to_pybytes()}
        )
        ao.assert_outputs_equal(out, back)
    end = chunks[-1]
    assert end.data.num_rows == 0
    assert json.loads(end.app_metadata.to_pybytes()) == {
        "arrow_outputs.end": {"steps": 3, "rows": sum(len(o.req_ids) for o in outputs)}
    }


def test_list_runs_and_run_info(server, client):
    client.put("a", _run(2))
    client.put("b", _run(3, seed=1))
    runs = {r.name: r for r in client.list_runs()}
    assert set(runs) == {"a", "b"}
    b = runs["b"]
    assert (b.steps, b.rows, b.complete, b.live) == (
        3,
        sum(1 + (1 + s) % 4 for s in range(3)),
        True,
        False,
    )
    assert b.bytes == (server.root / "b.arrows").stat().st_size
    assert b.schema.equals(open_run(server.root / "b.arrows").schema)
    assert client.run_info("a") == runs["a"]
    with pytest.raises(fl.FlightServerError, match="'zzz'"):
        client.run_info("zzz")


def test_put_of_a_stored_run_name_is_refused(server, client):
    client.put("once", _run(2))
    before = (server.root / "once.arrows").read_bytes()
    with pytest.raises(ao.ConsistencyError, match=r"server: run: expected a new run name"):
        client.put("once", _run(1))
    assert (server.root / "once.arrows").read_bytes() == before


def test_get_of_unknown_run_is_refused(client):
    with pytest.raises(fl.FlightServerError, match="expected a stored run, got 'nothing'"):
        list(client.get("nothing"))


# ----------------------------------------------------------------------------- live tail


def test_get_follow_tails_a_live_run_until_it_closes(server, client):
    outputs = _run(6, seed=3)
    seen: list = []
    upload = client.open_put("live")
    upload.write(outputs[0])
    upload.write(outputs[1])
    _wait_for(lambda: any(r.live and r.steps == 2 for r in client.list_runs()))
    stream = client.get("live", follow=True)

    def consume() -> None:
        seen.extend(stream.outputs())

    consumer = threading.Thread(target=consume)
    consumer.start()
    for out in outputs[2:]:
        _wait_for(lambda: len(seen) >= upload.steps - 1)  # the tail keeps up, step by step
        upload.write(out)
    # A snapshot (follow=False) of the live run: what is stored now, not complete.
    _wait_for(lambda: client.run_info("live").steps == 6)
    snapshot = client.get("live")
    assert len(list(snapshot)) == 6
    assert not snapshot.complete
    assert upload.close() == PutResult("live", 6, sum(len(o.req_ids) for o in outputs))
    consumer.join(10)
    assert not consumer.is_alive()
    _same(outputs, seen)
    assert stream.complete
    info = client.run_info("live")
    assert (info.live, info.complete, info.steps) == (False, True, 6)


def test_get_follow_ends_without_end_marker_when_the_engine_aborts(server, client):
    upload = client.open_put("aborted")
    upload.write(_decode(2, 0))
    _wait_for(lambda: client.run_info("aborted").steps == 1)
    stream = client.get("aborted", follow=True)
    got: list = []
    consumer = threading.Thread(target=lambda: got.extend(stream))
    consumer.start()
    _wait_for(lambda: len(got) == 1)
    upload.abort()
    consumer.join(10)
    assert not consumer.is_alive()
    assert len(got) == 1
    assert not stream.complete
    stored = open_run(server.root / "aborted.arrows")
    assert (len(stored), stored.complete) == (1, False)
    assert not client.run_info("aborted").complete


def test_follow_cancelled_by_its_client_leaves_the_run_alone(server, client):
    outputs = _run(4, seed=5)
    upload = client.open_put("watched")
    upload.write(outputs[0])
    _wait_for(lambda: client.run_info("watched").steps == 1)
    stream = client.get("watched", follow=True)
    first = next(iter(stream))
    assert first[0].num_rows == len(outputs[0].req_ids)
    stream.cancel()  # a consumer that goes away mid-stream
    for out in outputs[1:]:
        upload.write(out)
    upload.close()
    _same(outputs, list(client.outputs("watched")))


# ----------------------------------------------------------------------------- many engines


_KILLED_ENGINE = """
import sys, time
import numpy as np
import arrow_outputs as ao
from arrow_outputs.flight import FlightRunClient

client = FlightRunClient(sys.argv[1])
upload = client.open_put("killed")
for step in range(1000):
    out = ao.ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, [[step], [step + 1]])
    upload.write(out)
    if step == 4:
        print("sent", flush=True)
    time.sleep(0.01)
"""


def test_engines_at_once_and_one_killed_mid_stream_lose_nothing_else(server, client):
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_ENGINE, server.location],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "sent"
        runs = {f"engine-{i}": _run(12, seed=10 + i) for i in range(4)}
        results: dict[str, PutResult] = {}
        errors: list[BaseException] = []

        def engine(name: str) -> None:
            try:
                with FlightRunClient(server.location) as own:
                    upload = own.open_put(name)
                    for out in runs[name]:
                        upload.write(out)
                        time.sleep(0.002)  # interleave with the others
                    results[name] = upload.close()
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=engine, args=(n,)) for n in runs]
        for t in threads:
            t.start()
        time.sleep(0.05)
        child.kill()  # SIGKILL mid-put, while the others write
        child.wait(10)
        for t in threads:
            t.join(30)
        assert not errors
        assert {n: r.steps for n, r in results.items()} == {n: 12 for n in runs}
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        child.stdout.close()
    for name, outputs in runs.items():
        stored = open_run(server.root / f"{name}.arrows")
        assert stored.complete
        _same(outputs, list(stored.outputs()))
    # The killed engine's run: every step that arrived, and marked incomplete.
    _wait_for(lambda: not client.run_info("killed").live)
    killed = open_run(server.root / "killed.arrows")
    assert not killed.complete
    assert len(killed) >= 5
    for i, out in enumerate(killed.outputs()):
        assert out.sampled_token_ids == [[i], [i + 1]]
    stream = client.get("killed")
    assert len(list(stream)) == len(killed)
    assert not stream.complete


def test_max_live_runs_bounds_concurrent_puts(tmp_path):
    with FlightRunServer(tmp_path, max_live_runs=1) as srv, FlightRunClient(srv.location) as c:
        first = c.open_put("one")
        first.write(_decode(1, 0))
        with pytest.raises(ao.UnsupportedValueError, match="at most 1 live runs"):
            c.put("two", [_decode(1, 1)])
        first.close()
        assert c.put("two", [_decode(1, 1)]).steps == 1


# ----------------------------------------------------------------------------- hostile input


def _raw_put(location: str, name: str, schema: pa.Schema, messages: list) -> fl.FlightError:
    # A plain pyarrow client, closed at the end: a put left open would hold the server.
    with fl.FlightClient(location) as raw:
        writer, acks = raw.do_put(fl.FlightDescriptor.for_path(name), schema)

        def send() -> None:
            for batch, app in messages:
                if app is None:
                    writer.write_batch(batch)
                else:
                    writer.write_with_metadata(batch, pa.py_buffer(app))
            writer.done_writing()
            acks.read()
            writer.close()

        with pytest.raises(fl.FlightError) as info:
            send()
        return info.value


def test_put_refuses_a_schema_of_another_format(server):
    schema = pa.schema([("x", pa.int64())])
    batch = pa.record_batch([pa.array([1])], schema=schema)
    err = _raw_put(server.location, "foreign", schema, [(batch, b"{}")])
    assert "schema.metadata[arrow_outputs.format]" in str(err)
    assert not (server.root / "foreign.arrows").exists()


def test_put_refuses_a_lying_step_and_keeps_the_steps_before_it(server, client):
    good = [ao.to_record_batch(_decode(2, s), step=s) for s in range(3)]
    customs = [ao.step_custom_metadata(b)[b"arrow_outputs.step"] for b in good]
    lying = json.loads(customs[2])
    lying["step"] = 99  # the step column says 2
    upload = client.open_put("lying")
    upload.write(good[0])
    upload.write(good[1])
    upload.write(good[2], custom_metadata={b"arrow_outputs.step": json.dumps(lying).encode()})
    with pytest.raises(ao.StepMetadataError, match=r"^server: run\[lying\]\.arrow_outputs\.step"):
        upload.close()
    _wait_for(lambda: not client.run_info("lying").live)
    stored = open_run(server.root / "lying.arrows")
    assert (len(stored), stored.complete) == (2, False)


@pytest.mark.parametrize(
    ("app", "match"),
    [
        (None, r"step\[0\]\.app_metadata: expected the step JSON"),
        (b"not json", "arrow_outputs.step"),
        (b'{"arrow_outputs.end": {"steps": 5, "rows": 0}}', "end marker"),
    ],
)
def test_put_refuses_batches_without_valid_step_json(server, app, match):
    batch = ao.to_record_batch(_decode(2, 0), step=0)
    schema = ao.run_schema(batch)
    if app is not None and app.startswith(b'{"arrow_outputs.end"'):
        batch = pa.RecordBatch.from_pylist([], schema=schema)
    err = _raw_put(server.location, "bad", schema, [(batch, app)])
    assert re.search(match, str(err))
    # Refused before any step was stored: no run is left, and the name is free again.
    _wait_for(lambda: not (server.root / "bad.arrows").exists())
    with FlightRunClient(server.location) as c:
        assert c.put("bad", [_decode(1, 0)]).steps == 1


def test_put_refuses_a_batch_whose_buffers_lie(server):
    # Offsets that go backwards: only full validation sees it, before anything is stored.
    batch = ao.to_record_batch(_decode(2, 0), step=0)
    meta = ao.step_custom_metadata(batch)[b"arrow_outputs.step"]
    col = batch.column("sampled_token_ids")
    bad_offsets = pa.py_buffer(np.array([0, 2, 1], dtype=np.int32).tobytes())  # decreasing
    broken = pa.Array.from_buffers(col.type, 2, [None, bad_offsets], children=[col.values])
    bad = pa.RecordBatch.from_arrays(
        [broken if n == "sampled_token_ids" else batch.column(n) for n in batch.schema.names],
        schema=batch.schema,
    )
    err = _raw_put(server.location, "broken", ao.run_schema(batch), [(bad, meta)])
    assert str(err).startswith("run[broken].batch: expected a valid Arrow record batch")
    # The error travels typed, for FlightRunClient to raise it as itself.
    assert json.loads(err.extra_info)["error"] == "SchemaMismatchError"
    assert "offset" in str(err).lower()
    _wait_for(lambda: not (server.root / "broken.arrows").exists())


@pytest.mark.parametrize("path", [["../escape"], ["a/b"], [".hidden"], ["a", "b"], ["x" * 200]])
def test_put_refuses_descriptors_that_are_not_a_plain_run_name(server, path):
    schema = ao.run_schema(ao.to_record_batch(_decode(1, 0), step=0))

    def put() -> None:
        writer, _ = raw.do_put(fl.FlightDescriptor.for_path(*path), schema)
        writer.done_writing()
        writer.close()

    with (
        fl.FlightClient(server.location) as raw,
        pytest.raises(fl.FlightServerError, match=r"run|descriptor"),
    ):
        put()
    assert list(server.root.iterdir()) == []
    assert not (server.root.parent / "escape.arrows").exists()


@pytest.mark.parametrize(
    "ticket",
    [b"junk", b"[]", b'{"run": "../x"}', b'{"run": "a", "follow": 1}', b'{"run": "a", "x": 1}'],
)
def test_get_refuses_hostile_tickets(server, ticket):
    with (
        fl.FlightClient(server.location) as raw,
        pytest.raises(fl.FlightServerError, match=r"ticket|run"),
    ):
        raw.do_get(fl.Ticket(ticket)).read_all()


def test_get_serves_the_whole_steps_of_a_file_cut_by_a_crash(server, client):
    outputs = _run(4, seed=7)
    client.put("crashed", outputs)
    path = server.root / "crashed.arrows"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 3 // 5])  # the server died while writing
    stream = client.get("crashed")
    got = list(stream.outputs())
    assert not stream.complete
    assert 1 <= len(got) < 4
    _same(outputs[: len(got)], got)
    info = client.run_info("crashed")
    assert (info.steps, info.complete) == (len(got), False)


def test_get_of_a_tampered_file_stops_with_a_typed_error(server, client):
    # A file put in the root by hand whose third step's JSON lies about its rows: the
    # steps before it are served, then the client gets the reader's error, not a traceback.
    batches = [ao.to_record_batch(_decode(2, s), step=s) for s in range(3)]
    write_stream_lying_about_rows(server.root / "tampered.arrows", batches, at=2)
    got = []
    with pytest.raises(ao.CorruptFileError, match=r"^server: run\[tampered\]\..*rows") as info:
        got.extend(client.get("tampered"))
    assert len(got) == 2
    assert "Traceback" not in str(info.value)


def test_client_refuses_bad_names_before_calling(client):
    with pytest.raises(ao.UnsupportedValueError, match=r"^run: "):
        client.get("../../etc")
    with pytest.raises(ao.UnsupportedValueError, match=r"^run: "):
        client.open_put("a b")
    assert check_run_name("ok-1") == "ok-1"


# ----------------------------------------------------------------------------- auth & TLS


def test_token_is_required_when_configured(tmp_path):
    with FlightRunServer(tmp_path, token=TOKEN) as srv:
        for token in (None, "wrong-token", TOKEN + "x"):
            with FlightRunClient(srv.location, token=token) as c:
                with pytest.raises(fl.FlightUnauthenticatedError, match="authorization"):
                    c.list_runs()
                with pytest.raises(fl.FlightUnauthenticatedError):
                    c.put(f"r{len(token or '')}", [_decode(1, 0)])
                with pytest.raises(fl.FlightUnauthenticatedError):
                    list(c.get("r"))
        assert list(tmp_path.iterdir()) == []  # nothing stored by a refused put
        with FlightRunClient(srv.location, token=TOKEN) as c:
            c.put("ok", [_decode(2, 0)])
            assert [r.name for r in c.list_runs()] == ["ok"]
            assert len(list(c.get("ok"))) == 1


def _self_signed(tmp_path: Path) -> tuple[bytes, bytes]:
    """A throwaway certificate for 127.0.0.1 / localhost."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
            "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out", str(cert),
            "-days", "1", "-subj", "/CN=localhost",
            "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert.read_bytes(), key.read_bytes()


def test_tls_serves_encrypted_and_refuses_plain_clients(tmp_path):
    cert, key = _self_signed(tmp_path)
    with FlightRunServer(tmp_path / "runs", tls_cert=cert, tls_key=key, token=TOKEN) as srv:
        assert srv.location.startswith("grpc+tls://127.0.0.1:")
        outputs = _run(3)
        with FlightRunClient(srv.location, token=TOKEN, tls_root_certs=tmp_path / "cert.pem") as c:
            c.put("secure", outputs)
            _same(outputs, list(c.outputs("secure")))
        plain = srv.location.replace("grpc+tls://", "grpc://")
        with FlightRunClient(plain, token=TOKEN, timeout=5) as c, pytest.raises(fl.FlightError):
            c.list_runs()


def test_server_options_are_checked(tmp_path):
    with pytest.raises(ao.UnsupportedValueError, match=r"^host: expected a loopback address"):
        FlightRunServer(tmp_path, host="0.0.0.0")
    with pytest.raises(ao.FieldTypeError, match=r"^token: "):
        FlightRunServer(tmp_path, token="")
    with pytest.raises(ao.UnsupportedValueError, match=r"^token: "):
        FlightRunServer(tmp_path, token="has space")
    with pytest.raises(ao.FieldTypeError, match=r"^tls_key: "):
        FlightRunServer(tmp_path, tls_cert=b"-----BEGIN CERTIFICATE-----")
    with pytest.raises(ao.UnsupportedValueError, match=r"^tls_cert: expected PEM"):
        FlightRunServer(tmp_path, tls_cert=b"nope", tls_key=b"nope")
    with pytest.raises(ao.FieldTypeError, match=r"^port: "):
        FlightRunServer(tmp_path, port=70000)
    with pytest.raises(ao.FieldTypeError, match=r"^location: "):
        FlightRunClient("http://127.0.0.1:1")


def test_serve_blocks_until_stopped(tmp_path):
    stop = threading.Event()
    started: list[FlightRunServer] = []
    thread = threading.Thread(
        target=serve,
        kwargs={
            "root_dir": tmp_path,
            "port": 0,
            "token": TOKEN,
            "ready": started.append,
            "stop": stop,
        },
    )
    thread.start()
    _wait_for(lambda: bool(started))
    with FlightRunClient(started[0].location, token=TOKEN) as c:
        c.put("served", [_decode(1, 0)])
        assert [r.name for r in c.list_runs()] == ["served"]
    assert thread.is_alive()
    stop.set()
    thread.join(10)
    assert not thread.is_alive()
