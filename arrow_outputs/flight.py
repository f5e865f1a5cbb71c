"""Arrow Flight: runs of steps between machines.

:class:`FlightRunServer` takes runs from engines (``DoPut``), stores each one on disk with
:class:`~arrow_outputs.OutputWriter` (one Arrow IPC stream file per run,
``<root>/<run>.arrows``), and serves them (``DoGet``, ``ListFlights``, ``GetFlightInfo``),
live runs included: a ``DoGet`` of a run that is still being written follows it until its
engine closes it. :class:`FlightRunClient` is both sides' client.

The wire protocol (``docs/flight.md``) is plain Arrow Flight, so any Flight client can speak
it: a run is the flight descriptor path ``[<run>]``; each step is one record batch of the
format whose Flight ``app_metadata`` is the step JSON (the value of the
``arrow_outputs.step`` IPC custom metadata key); a run ends with a 0-row batch whose
``app_metadata`` is ``{"arrow_outputs.end": {"steps": N, "rows": R}}``. A stream that stops
without that marker is an incomplete run, never a shorter complete one.

Everything a server receives is hostile: run names are checked against a short charset,
schemas must be this format's, every batch is fully validated and decoded before it is
stored, and a refused put keeps the steps stored before it (the run is then incomplete).
Nothing is pickled.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import os
import queue
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as fl

from . import errors as _errors
from ._checks import describe
from .batch import from_record_batch, run_schema, step_custom_metadata, to_record_batch
from .errors import (
    ArrowOutputsError,
    ConsistencyError,
    CorruptFileError,
    FieldTypeError,
    SchemaMismatchError,
    ShapeError,
    StepMetadataError,
    UnsupportedValueError,
)
from .export import RUN_NAME, check_run_name
from .reader import RunReader, open_run, recover
from .schema import KEY_RUN, KEY_STEP, column_types
from .writer import KEY_END, OutputWriter

__all__ = [
    "DEFAULT_PORT",
    "FlightRunClient",
    "FlightRunServer",
    "PutResult",
    "RunInfo",
    "RunStream",
    "RunUpload",
    "serve",
]

#: Arrow Flight's customary port.
DEFAULT_PORT = 8815
#: A run file's suffix in the server's root directory.
SUFFIX = ".arrows"
#: The JSON key of the end-of-run marker's ``app_metadata``.
END_KEY = KEY_END.decode()
_MAX_TICKET = 1024
_MAX_END_JSON = 4096
_MAX_ERROR_INFO = 16384
_BEARER = "Bearer "


# ----------------------------------------------------------------------------- wire pieces


def _end_marker(schema: pa.Schema, steps: int, rows: int) -> tuple[pa.RecordBatch, bytes]:
    """The 0-row batch that ends a run on the wire, with its ``app_metadata``."""
    body = json.dumps({END_KEY: {"steps": steps, "rows": rows}}).encode()
    return pa.RecordBatch.from_pylist([], schema=schema), body


def _parse_end(raw: bytes, path: str) -> dict[str, int] | None:
    """The totals of an end marker's ``app_metadata``; None when it is a step's JSON."""
    if not raw.startswith(b'{"' + KEY_END + b'"'):
        return None
    if len(raw) > _MAX_END_JSON:
        raise StepMetadataError(
            path, f"an end marker of at most {_MAX_END_JSON} bytes", f"{len(raw)}"
        )
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise StepMetadataError(path, "JSON", f"invalid JSON ({e})") from e
    totals = doc.get(END_KEY) if isinstance(doc, dict) and len(doc) == 1 else None
    if not (
        isinstance(totals, dict)
        and set(totals) == {"steps", "rows"}
        and all(type(v) is int and 0 <= v < 2**63 for v in totals.values())
    ):
        raise StepMetadataError(
            path, '{"arrow_outputs.end": {"steps": <int>, "rows": <int>}}', repr(raw[:80])
        )
    return totals


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _app_bytes(buf: Any) -> bytes | None:
    return None if buf is None else buf.to_pybytes()


# ----------------------------------------------------------------------------- errors


def _reject(err: ArrowOutputsError, context: str) -> fl.FlightServerError:
    """A Flight error that carries an arrow_outputs error, so the client raises it again."""
    info = json.dumps(
        {
            "error": type(err).__name__,
            "field": f"{context}.{err.field}" if context else err.field,
            "expected": err.expected,
            "got": err.got,
        }
    ).encode()
    message = f"{context}.{err}" if context else str(err)
    return fl.FlightServerError(message, extra_info=info)


# The classes a server may name; anything else becomes the base class.
_ERROR_CLASSES: dict[str, type[ArrowOutputsError]] = {
    name: cls
    for name in _errors.__all__
    if isinstance(cls := getattr(_errors, name), type) and issubclass(cls, ArrowOutputsError)
}


def _raised_again(e: fl.FlightError) -> ArrowOutputsError | None:
    """The server's arrow_outputs error carried by a Flight error, or None."""
    raw = e.extra_info
    if not raw or len(raw) > _MAX_ERROR_INFO:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(doc, dict) or not all(
        isinstance(doc.get(k), str) for k in ("error", "field", "expected", "got")
    ):
        return None
    cls = _ERROR_CLASSES.get(doc["error"], ArrowOutputsError)
    return cls("server: " + doc["field"], doc["expected"], doc["got"])


@contextlib.contextmanager
def _server_errors() -> Iterator[None]:
    """Re-raise a server's refusal as the arrow_outputs error it was."""
    try:
        yield
    except fl.FlightError as e:
        again = _raised_again(e)
        if again is None:
            raise
        raise again from e


# ----------------------------------------------------------------------------- auth


class _TokenCheck(fl.ServerMiddlewareFactory):
    """Refuses every call without ``authorization: Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self._expected = (_BEARER + token).encode()

    def start_call(self, info: Any, headers: dict[str, list[Any]]) -> None:
        given = headers.get("authorization", [])
        ok = False
        for value in given:
            raw = value.encode() if isinstance(value, str) else bytes(value)
            # compare_digest: the time taken says nothing about how much of the token matched.
            ok |= hmac.compare_digest(raw, self._expected)
        if not ok:
            got = "no authorization header" if not given else "a wrong token"
            raise fl.FlightUnauthenticatedError(
                f"authorization: expected 'Bearer <the server's token>', got {got}"
            )
        return None


def _check_token(token: Any) -> str | None:
    if token is None:
        return None
    if not isinstance(token, str) or not token:
        raise FieldTypeError("token", "a non-empty str or None", describe(token))
    if not all(0x21 <= ord(c) <= 0x7E for c in token):
        raise UnsupportedValueError(
            "token", "printable ASCII without spaces (it travels in an HTTP/2 header)", "other"
        )
    return token


def _pem(value: Any, what: str) -> bytes | None:
    """PEM bytes from bytes, or from a path to a PEM file."""
    if value is None:
        return None
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, (str, os.PathLike)):
        try:
            data = Path(value).read_bytes()
        except OSError as e:
            raise FieldTypeError(
                what, "PEM bytes or a readable PEM file", f"{value!s} ({e})"
            ) from e
    else:
        raise FieldTypeError(what, "PEM bytes or a path to a PEM file", describe(value))
    if b"-----BEGIN " not in data:
        raise UnsupportedValueError(what, "PEM data (-----BEGIN ...)", f"{len(data)} other bytes")
    return data


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ----------------------------------------------------------------------------- server


@dataclass(frozen=True)
class RunInfo:
    """What a server says about one run.

    ``steps`` and ``rows`` count the steps stored so far; ``complete``: the run ended with its
    end marker; ``live``: an engine is writing it now; ``bytes``: the file's size.
    """

    name: str
    schema: pa.Schema = field(repr=False)
    steps: int
    rows: int
    complete: bool
    live: bool
    bytes: int


class _Live:
    """A run being written: its writer and its fate, shared with the tails that follow it."""

    def __init__(self, path: Path, writer: OutputWriter, schema: pa.Schema) -> None:
        self.path = path
        self.writer = writer
        self.schema = schema
        self.state = "live"  # then "closed" (end marker written) or "aborted"
        self.changed = threading.Condition()

    def finish(self, state: str) -> None:
        with self.changed:
            self.state = state
            self.changed.notify_all()


class FlightRunServer(fl.FlightServerBase):
    """An Arrow Flight server that stores runs of steps and serves them, live ones included.

    The server runs from construction (in gRPC's threads) until :meth:`shutdown`; use it as
    a context manager, or :func:`serve` to block.

    Parameters
    ----------
    root
        Directory of the run files (``<root>/<run>.arrows``, Arrow IPC stream format);
        created when missing. Runs already there are served.
    host
        Interface to listen on: loopback by default. Another interface needs a ``token``
        (or ``insecure=True``), and TLS to keep the token and the data private.
    port
        TCP port; 0 picks a free one (see :attr:`port`).
    token
        When set, every call must carry ``authorization: Bearer <token>``.
    tls_cert, tls_key
        PEM certificate chain and private key (bytes or file paths): serve over TLS.
    compression
        The run files' IPC compression: ``None``, ``"lz4"`` or ``"zstd"``.
    max_live_runs
        How many runs may be written at once; more puts are refused.
    max_step_json_bytes
        The largest step JSON accepted with a batch.
    insecure
        Allow a non-loopback ``host`` without a token.

    Examples
    --------
    >>> import tempfile
    >>> with FlightRunServer(tempfile.mkdtemp()) as server:
    ...     server.location.startswith("grpc://127.0.0.1:")
    True
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        tls_cert: Any = None,
        tls_key: Any = None,
        compression: str | None = None,
        max_live_runs: int = 64,
        max_step_json_bytes: int = 64 << 20,
        insecure: bool = False,
    ) -> None:
        if not isinstance(host, str) or not host:
            raise FieldTypeError("host", "a host name or IP address", describe(host))
        if type(port) is not int or not 0 <= port < 65536:
            raise FieldTypeError("port", "an int in 0..65535", describe(port))
        self._token = _check_token(token)
        if not _is_loopback(host) and self._token is None and not insecure:
            raise UnsupportedValueError(
                "host",
                "a loopback address unless a token is set (or insecure=True)",
                repr(host),
            )
        cert, key = _pem(tls_cert, "tls_cert"), _pem(tls_key, "tls_key")
        if (cert is None) != (key is None):
            raise FieldTypeError("tls_key", "tls_cert and tls_key together", "only one of them")
        for name, value in (
            ("max_live_runs", max_live_runs),
            ("max_step_json_bytes", max_step_json_bytes),
        ):
            if type(value) is not int or value < 1:
                raise FieldTypeError(name, "an int >= 1", describe(value))
        if compression not in (None, "lz4", "zstd"):
            raise FieldTypeError("compression", "None, 'lz4' or 'zstd'", repr(compression)[:60])
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._compression = compression
        self._max_live = max_live_runs
        self._max_json = max_step_json_bytes
        self._live: dict[str, _Live] = {}
        self._listed: dict[str, tuple[tuple[int, int], RunInfo]] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._scheme = "grpc+tls" if cert is not None else "grpc"
        self._host = host
        middleware = {"token": _TokenCheck(self._token)} if self._token is not None else None
        bind_host = f"[{host}]" if ":" in host else host
        super().__init__(
            f"{self._scheme}://{bind_host}:{port}",
            tls_certificates=[(cert, key)] if cert is not None else None,
            middleware=middleware,
        )

    @property
    def location(self) -> str:
        """The URI clients connect to, e.g. ``grpc://127.0.0.1:8815``."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{self._scheme}://{host}:{self.port}"

    def shutdown(self) -> None:
        """Stop serving: live tails end now; calls in progress are waited for."""
        self._stopping.set()
        for live in list(self._live.values()):
            with live.changed:
                live.changed.notify_all()
        super().shutdown()

    def __enter__(self) -> FlightRunServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # -- names and paths ---------------------------------------------------------------

    def _path(self, name: str) -> Path:
        return self.root / f"{name}{SUFFIX}"

    def _descriptor_run(self, descriptor: fl.FlightDescriptor) -> str:
        if descriptor.descriptor_type != fl.DescriptorType.PATH or len(descriptor.path) != 1:
            raise _reject(
                FieldTypeError(
                    "descriptor", "a path descriptor of one element: [<run>]", "another"
                ),
                "",
            )
        raw = descriptor.path[0]
        try:
            name = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
            return check_run_name(name)
        except (UnicodeDecodeError, ArrowOutputsError) as e:
            err = (
                e
                if isinstance(e, ArrowOutputsError)
                else FieldTypeError("run", "UTF-8", "other bytes")
            )
            raise _reject(err, "descriptor") from None

    # -- DoPut ---------------------------------------------------------------------------

    def do_put(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
        name = self._descriptor_run(descriptor)
        try:
            schema = run_schema(reader.schema)
            column_types(schema)  # this format's schema, or a clear refusal
        except ArrowOutputsError as e:
            raise _reject(e, f"run[{name}]") from None
        live = self._claim(name, schema)
        steps = rows = 0
        ended: dict[str, int] | None = None
        state = "aborted"
        try:
            # Claimed: say so now, so an engine learns at once that its run is taken (and a
            # consumer may follow the run from here on).
            writer.write(pa.py_buffer(json.dumps({"run": name, "accepted": True}).encode()))
            while True:
                try:
                    chunk = reader.read_chunk()
                except StopIteration:
                    break
                except fl.FlightError:
                    return  # the call itself failed (cancelled, timed out): keep what came
                except pa.ArrowException as e:  # bytes that are no IPC message
                    raise SchemaMismatchError(
                        f"step[{steps}]", "an Arrow IPC record batch message", _short(e)
                    ) from None
                if ended is not None:
                    raise ConsistencyError(
                        "end marker", "the last message of the put", "more data after it"
                    )
                data, app = chunk.data, _app_bytes(chunk.app_metadata)
                where = f"step[{steps}]"
                if data is None:
                    raise FieldTypeError(
                        where, "a record batch with its step JSON", "metadata alone"
                    )
                if app is None:
                    raise StepMetadataError(
                        f"{where}.app_metadata", "the step JSON (arrow_outputs.step)", "none"
                    )
                if data.num_rows == 0 and (ended := _parse_end(app, f"{where}.app_metadata")):
                    continue
                if len(app) > self._max_json:
                    raise StepMetadataError(
                        f"{where}.app_metadata", f"at most {self._max_json} bytes", f"{len(app)}"
                    )
                custom = {KEY_STEP: app}
                # Decoded in full before it is stored: a batch that does not decode never lands.
                from_record_batch(data, custom_metadata=custom)
                live.writer.write(data, custom_metadata=custom)
                steps += 1
                rows += data.num_rows
            if ended is None:
                # The client went away (or never said it was done): what came is kept.
                return
            if ended != {"steps": steps, "rows": rows}:
                raise ConsistencyError(
                    "end marker",
                    f"{{'steps': {steps}, 'rows': {rows}}} (what was sent)",
                    str(ended),
                )
            live.writer.close()
            state = "closed"
            ack = {"run": name, "steps": steps, "rows": rows}
            writer.write(pa.py_buffer(json.dumps(ack).encode()))
        except ArrowOutputsError as e:
            raise _reject(e, f"run[{name}]") from None
        except fl.FlightError:
            raise
        except Exception as e:
            # Not the client's fault (a full disk...): say what, but send no traceback.
            raise fl.FlightInternalError(
                f"run[{name}]: the server could not store the run ({type(e).__name__})"
            ) from e
        finally:
            if state != "closed":
                self._abort(live)
                if steps == 0:  # nothing stored: leave no run (and free the name)
                    live.path.unlink(missing_ok=True)
            self._release(name, live, state)

    def _claim(self, name: str, schema: pa.Schema) -> _Live:
        path = self._path(name)
        with self._lock:
            if self._stopping.is_set():
                raise fl.FlightUnavailableError("the server is shutting down")
            if name in self._live:
                raise _reject(
                    ConsistencyError("run", "a run name not being written", repr(name)), ""
                )
            if len(self._live) >= self._max_live:
                raise _reject(
                    UnsupportedValueError("run", f"at most {self._max_live} live runs", "one more"),
                    "",
                )
            try:
                # O_EXCL: a stored run is never overwritten, even by another server process.
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            except FileExistsError:
                raise _reject(
                    ConsistencyError("run", "a new run name", f"{name!r}, which is stored"), ""
                ) from None
            writer = OutputWriter(
                path, format="stream", compression=self._compression, schema=schema
            )
            live = _Live(path, writer, schema)
            self._live[name] = live
            return live

    def _abort(self, live: _Live) -> None:
        # A run cut short keeps the steps received, without the end marker.
        live.writer.abort()

    def _release(self, name: str, live: _Live, state: str) -> None:
        live.finish(state)
        with self._lock:
            self._live.pop(name, None)

    # -- DoGet ---------------------------------------------------------------------------

    def _ticket(self, ticket: fl.Ticket) -> tuple[str, bool]:
        raw = ticket.ticket
        try:
            if len(raw) > _MAX_TICKET:
                raise FieldTypeError("ticket", f"at most {_MAX_TICKET} bytes", f"{len(raw)} bytes")
            try:
                doc = json.loads(raw)
            except ValueError:
                raise FieldTypeError(
                    "ticket", 'JSON {"run": <name>, "follow": <bool>}', repr(raw[:60])
                ) from None
            if not isinstance(doc, dict) or not set(doc) <= {"run", "follow"} or "run" not in doc:
                raise FieldTypeError(
                    "ticket", 'JSON {"run": <name>, "follow": <bool>}', repr(raw[:60])
                )
            follow = doc.get("follow", False)
            if type(follow) is not bool:
                raise FieldTypeError("ticket.follow", "true or false", describe(follow))
            return check_run_name(doc["run"]), follow
        except ArrowOutputsError as e:
            raise _reject(e, "") from None

    def do_get(self, context: Any, ticket: fl.Ticket) -> fl.GeneratorStream:
        name, follow = self._ticket(ticket)
        with self._lock:
            live = self._live.get(name)
        if live is not None:
            return fl.GeneratorStream(
                live.schema, _refusing(self._tail(live, context, follow), name)
            )
        path = self._path(name)
        if not path.is_file():
            raise fl.FlightServerError(f"run: expected a stored run, got {name!r}, which is not")
        try:
            run, complete = _open_stored(path)
        except ArrowOutputsError as e:
            raise _reject(e, f"run[{name}]") from None
        return fl.GeneratorStream(run.schema, _refusing(_replay(run, complete), name))

    def _tail(self, live: _Live, context: Any, follow: bool) -> Iterator[Any]:
        """A live run's steps as they land; then its end marker when its engine closed it."""
        sent = 0
        with pa.OSFile(str(live.path), "rb") as source:
            stream = None
            while True:
                with live.changed:
                    # A step is readable once the writer counts it: it wrote it whole.
                    while (
                        follow
                        and live.writer.stats.steps <= sent
                        and live.state == "live"
                        and not self._stopping.is_set()
                        and not context.is_cancelled()
                    ):
                        live.changed.wait(0.02)
                    state = live.state
                    available = live.writer.stats.steps
                if context.is_cancelled():
                    return
                if available > sent and stream is None:
                    stream = pa.ipc.open_stream(source)
                while sent < available:
                    assert stream is not None
                    batch, custom = stream.read_next_batch_with_custom_metadata()
                    sent += 1
                    yield batch, custom[KEY_STEP]
                if state == "closed":
                    yield _end_marker(live.schema, sent, live.writer.stats.rows)
                    return
                if state == "aborted" or not follow or self._stopping.is_set():
                    return

    # -- listings ------------------------------------------------------------------------

    def _info(self, name: str) -> RunInfo | None:
        path = self._path(name)
        with self._lock:
            live = self._live.get(name)
        try:
            size = path.stat().st_size
        except OSError:
            return None
        if live is not None:
            s = live.writer.stats
            return RunInfo(name, live.schema, s.steps, s.rows, False, True, size)
        stamp = (path.stat().st_mtime_ns, size)
        cached = self._listed.get(name)
        if cached is not None and cached[0] == stamp:
            return cached[1]  # a stored run does not change: no need to read it again
        try:
            run, complete = _open_stored(path)
        except ArrowOutputsError:
            return None  # not a run at all: not listed
        info = RunInfo(name, run.schema, len(run), run.num_rows, complete, False, size)
        with self._lock:
            self._listed[name] = (stamp, info)
        return info

    def _flight_info(self, info: RunInfo) -> fl.FlightInfo:
        ticket = fl.Ticket(json.dumps({"run": info.name}).encode())
        meta = {
            "steps": info.steps,
            "rows": info.rows,
            "complete": info.complete,
            "live": info.live,
        }
        return fl.FlightInfo(
            info.schema,
            fl.FlightDescriptor.for_path(info.name),
            [fl.FlightEndpoint(ticket, [])],  # no location: this server
            total_records=info.rows,
            total_bytes=info.bytes,
            app_metadata=json.dumps(meta).encode(),
        )

    def list_flights(self, context: Any, criteria: bytes) -> Iterator[fl.FlightInfo]:
        for path in sorted(self.root.glob(f"*{SUFFIX}")):
            name = path.name[: -len(SUFFIX)]
            if RUN_NAME.fullmatch(name) is None:
                continue
            info = self._info(name)
            if info is not None:
                yield self._flight_info(info)

    def get_flight_info(self, context: Any, descriptor: Any) -> fl.FlightInfo:
        name = self._descriptor_run(descriptor)
        info = self._info(name)
        if info is None:
            raise fl.FlightServerError(f"run: expected a stored run, got {name!r}, which is not")
        return self._flight_info(info)


def _open_stored(path: Path) -> tuple[RunReader, bool]:
    """A stored run and whether it is complete. A file cut short (the server died while
    writing it) is served up to its last whole step, through :func:`recover`."""
    try:
        run = open_run(path)
        return run, run.complete
    except CorruptFileError:
        sink = pa.BufferOutputStream()
        report = recover(path, sink)  # raises CorruptFileError when not even the schema reads
        return open_run(sink.getvalue()), report.complete


def _refusing(messages: Iterator[Any], name: str) -> Iterator[Any]:
    """A ``DoGet`` stream whose errors reach the client as typed Flight errors (a file that
    fails validation half-way), never as a server traceback."""
    try:
        yield from messages
    except ArrowOutputsError as e:
        raise _reject(e, f"run[{name}]") from None
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, fl.FlightError):
            raise
        raise fl.FlightInternalError(f"run[{name}]: could not read the run ({_short(e)})") from e


def _replay(run: RunReader, complete: bool) -> Iterator[Any]:
    """A stored run's steps with their step JSON (each validated as it is read: files are
    untrusted), then its end marker if it has one."""
    for batch, custom in run:
        yield batch, custom[KEY_STEP]
    if complete:
        yield _end_marker(run.schema, len(run), run.num_rows)


def serve(
    root_dir: str | os.PathLike[str],
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    token: str | None = None,
    tls_cert: Any = None,
    tls_key: Any = None,
    *,
    compression: str | None = None,
    insecure: bool = False,
    ready: Callable[[FlightRunServer], None] | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Run a :class:`FlightRunServer` until interrupted (Ctrl-C, SIGTERM) or ``stop`` is set.

    Parameters
    ----------
    root_dir, host, port, token, tls_cert, tls_key, compression, insecure
        As for :class:`FlightRunServer`.
    ready
        Called with the running server (its :attr:`~FlightRunServer.location`) once it
        listens.
    stop
        An event that ends serving when set (from another thread).
    """
    stop = stop if stop is not None else threading.Event()
    server = FlightRunServer(
        root_dir,
        host=host,
        port=port,
        token=token,
        tls_cert=tls_cert,
        tls_key=tls_key,
        compression=compression,
        insecure=insecure,
    )
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        if ready is not None:
            ready(server)
        # Short waits: a KeyboardInterrupt reaches this thread between them.
        while not stop.wait(0.2):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        server.shutdown()


# ----------------------------------------------------------------------------- client


@dataclass(frozen=True)
class PutResult:
    """What the server stored for a put: the run name and its steps and rows."""

    run: str
    steps: int
    rows: int


class RunUpload:
    """One run being sent to a server, step by step (:meth:`FlightRunClient.open_put`).

    The run's schema is its first step's; Flight's ``DoPut`` opens with it. :meth:`close`
    sends the end marker and returns once the server has stored the whole run; leaving a
    ``with`` block on an exception sends no end marker, so the server keeps the steps sent
    as an incomplete run.

    With ``queue_size``, :meth:`write` only queues the step and a background thread encodes
    and sends it, as :class:`~arrow_outputs.OutputWriter` does: the engine's thread does not
    wait on the network unless the queue is full. An error on that thread is raised by the
    next :meth:`write` or by :meth:`close`.
    """

    def __init__(
        self,
        client: FlightRunClient,
        run: str,
        run_metadata: dict[str, Any] | None,
        schema: pa.Schema | None,
        queue_size: int | None = None,
    ) -> None:
        self._client = client
        self.run = check_run_name(run)
        if run_metadata is not None and not isinstance(run_metadata, dict):
            raise FieldTypeError("run_metadata", "a dict or None", describe(run_metadata))
        if queue_size is not None and (type(queue_size) is not int or queue_size < 1):
            raise FieldTypeError("queue_size", "None or an int >= 1", describe(queue_size))
        self._run_metadata = run_metadata
        self._schema = None if schema is None else run_schema(schema)
        if self._schema is not None:
            column_types(self._schema)
        self._writer: Any = None
        self._acks: Any = None
        self._steps = 0
        self._rows = 0
        self._closed = False
        self._error: BaseException | None = None
        self._queue: queue.Queue[Any] | None = None
        self._thread: threading.Thread | None = None
        if queue_size is not None:
            self._queue = queue.Queue(maxsize=queue_size)
            self._thread = threading.Thread(
                target=self._drain, name=f"arrow_outputs-upload-{self.run}", daemon=True
            )
            self._thread.start()

    @property
    def steps(self) -> int:
        """Steps sent so far."""
        return self._steps

    def write(
        self, step_output: Any, *, step: int | None = None, custom_metadata: Any = None
    ) -> None:
        """Send one step (or queue it, with ``queue_size``).

        Parameters
        ----------
        step_output
            A ``ModelRunnerOutput`` (ours or vLLM's; not to be changed after this call) or a
            record batch of this format.
        step
            The step number of an output; by default the upload counts from 0.
        custom_metadata
            For a record batch read from IPC: its message's custom metadata (its step JSON).
        """
        self._raise_pending()
        if self._closed:
            raise ConsistencyError("upload", "an open upload", "write() after close()")
        is_batch = isinstance(step_output, pa.RecordBatch)
        if not is_batch and not (
            hasattr(step_output, "req_ids") and hasattr(step_output, "req_id_to_index")
        ):
            raise FieldTypeError(
                "step_output", "a ModelRunnerOutput or a record batch", type(step_output).__name__
            )
        if not is_batch and custom_metadata is not None:
            raise FieldTypeError("custom_metadata", "None for an output", "a value")
        if self._queue is not None:
            self._queue.put((step_output, step, custom_metadata))
            return
        try:
            self._send(step_output, step, custom_metadata)
        except BaseException:
            # Any error ends the run (incomplete), as on the background thread.
            self._closed = True
            self._abort_call()
            raise

    def _send(self, step_output: Any, step: int | None, custom_metadata: Any) -> None:
        if isinstance(step_output, pa.RecordBatch):
            batch = step_output
            raw = _step_raw(batch, custom_metadata)
        else:
            batch = to_record_batch(
                step_output,
                step=self._steps if step is None else step,
                schema=self._schema,
                metadata=self._run_metadata if self._schema is None else None,
            )
            raw = step_custom_metadata(batch)[KEY_STEP]
        if self._writer is None:
            self._open(batch)
        elif not batch.schema.equals(self._schema, check_metadata=False):
            raise SchemaMismatchError("batch.schema", str(self._schema), str(batch.schema))
        with _server_errors():
            self._writer.write_with_metadata(batch, pa.py_buffer(raw))
        self._steps += 1
        self._rows += batch.num_rows

    def _drain(self) -> None:
        assert self._queue is not None
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:  # after an error, queued steps are not sent
                    self._send(*item)
            except BaseException as e:  # raised on the caller's next call
                self._error = e
            finally:
                self._queue.task_done()

    def _stop_thread(self) -> None:
        if self._queue is not None and self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _raise_pending(self) -> None:
        err = self._error
        if err is not None:
            # The run stops here, incomplete: what the server stored stays. Raised once;
            # then the upload is closed.
            self._closed = True
            self._stop_thread()
            self._error = None
            self._abort_call()
            raise err

    def _open(self, first: pa.RecordBatch) -> None:
        if self._schema is None:
            schema = run_schema(first)
            if self._run_metadata is not None and KEY_RUN not in (schema.metadata or {}):
                meta = dict(schema.metadata or {})
                meta[KEY_RUN] = json.dumps(self._run_metadata, allow_nan=False).encode()
                schema = schema.with_metadata(meta)
            self._schema = schema
        elif not first.schema.equals(self._schema, check_metadata=False):
            raise SchemaMismatchError("batch.schema", str(self._schema), str(first.schema))
        with _server_errors():
            self._writer, self._acks = self._client._client.do_put(
                fl.FlightDescriptor.for_path(self.run), self._schema, options=self._client._options
            )
            accepted = self._acks.read()
            if accepted is None:  # refused: the call's status says why
                writer, self._writer = self._writer, None
                writer.close()
        expected = {"run": self.run, "accepted": True}
        if accepted is None or _json_or_none(accepted) != expected:
            raise ConsistencyError("server acknowledgement", str(expected), "another answer")

    def close(self) -> PutResult:
        """Send what is queued and the end marker; wait until the server has stored the run.
        Returns its counts."""
        if self._closed:
            raise ConsistencyError("upload", "an open upload", "close() twice")
        self._stop_thread()
        self._raise_pending()
        self._closed = True
        if self._writer is None:
            if self._schema is None:
                from .schema import output_schema

                self._schema = output_schema(metadata=self._run_metadata)
            self._open(pa.RecordBatch.from_pylist([], schema=self._schema))
        marker, body = _end_marker(self._schema, self._steps, self._rows)
        with _server_errors():
            self._writer.write_with_metadata(marker, pa.py_buffer(body))
            self._writer.done_writing()
            ack = self._acks.read()
            self._writer.close()
        stored = _json_or_none(ack)
        expected = {"run": self.run, "steps": self._steps, "rows": self._rows}
        if stored != expected:
            raise ConsistencyError("server acknowledgement", str(expected), repr(stored)[:200])
        return PutResult(self.run, self._steps, self._rows)

    def abort(self) -> None:
        """Stop sending without the end marker: the server keeps what came (queued steps
        are sent first), as an incomplete run."""
        if self._closed:
            return
        self._closed = True
        self._stop_thread()
        self._abort_call()

    def _abort_call(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(fl.FlightError, pa.ArrowException, OSError):
                self._writer.done_writing()
                self._writer.close()
            self._writer = None

    def __enter__(self) -> RunUpload:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.abort()


def _json_or_none(buf: Any) -> Any:
    """A server's JSON answer (bounded), or None."""
    if buf is None or buf.size > _MAX_END_JSON:
        return None
    try:
        return json.loads(buf.to_pybytes())
    except ValueError:
        return None


def _step_raw(batch: pa.RecordBatch, custom_metadata: Any) -> bytes:
    if custom_metadata is None:
        return step_custom_metadata(batch)[KEY_STEP]
    items = getattr(custom_metadata, "items", None)
    if callable(items):
        for key, value in items():
            if key in (KEY_STEP, KEY_STEP.decode()):
                return value.encode() if isinstance(value, str) else bytes(value)
    raise StepMetadataError(
        "custom_metadata", "a mapping with the arrow_outputs.step key", describe(custom_metadata)
    )


class RunStream:
    """A run read from a server: iterate ``(batch, custom_metadata)`` pairs.

    ``custom_metadata`` is ``{b"arrow_outputs.step": <step JSON>}``, ready for
    ``from_record_batch(batch, custom_metadata=...)``. After the last step, :attr:`complete`
    says whether the run ended with its end marker and :attr:`totals` holds its counts.
    """

    def __init__(self, reader: Any, run: str) -> None:
        self._reader = reader
        self.run = run
        self.schema: pa.Schema = reader.schema
        self.complete = False
        self.totals: dict[str, int] | None = None
        self._steps = 0
        self._rows = 0

    def __iter__(self) -> Iterator[tuple[pa.RecordBatch, dict[bytes, bytes]]]:
        with _server_errors():
            while True:
                try:
                    chunk = self._reader.read_chunk()
                except StopIteration:
                    return
                data, app = chunk.data, _app_bytes(chunk.app_metadata)
                where = f"run[{self.run}].step[{self._steps}]"
                if self.complete:
                    raise ConsistencyError(where, "nothing after the end marker", "more messages")
                if data is None or app is None:
                    raise StepMetadataError(
                        where, "a batch with its step JSON", "a message without"
                    )
                if data.num_rows == 0:
                    totals = _parse_end(app, f"{where}.app_metadata")
                    if totals is not None:
                        if totals != {"steps": self._steps, "rows": self._rows}:
                            raise ShapeError(
                                f"run[{self.run}]",
                                str(totals),
                                f"{self._steps} steps, {self._rows} rows",
                            )
                        self.complete, self.totals = True, totals
                        continue
                self._steps += 1
                self._rows += data.num_rows
                yield data, {KEY_STEP: app}

    def outputs(self, **kw: Any) -> Iterator[Any]:
        """The run's steps as ``ModelRunnerOutput`` objects (``from_record_batch`` options in
        ``kw``; every batch is validated, it came over the network)."""
        for batch, custom in self:
            yield from_record_batch(batch, custom_metadata=custom, **kw)

    def read_all(self) -> pa.Table:
        """The run's rows as one table (step metadata is not kept: see :meth:`__iter__`)."""
        return pa.Table.from_batches([b for b, _ in self], schema=self.schema)

    def cancel(self) -> None:
        """Stop reading (a live tail ends here; the server keeps serving others)."""
        self._reader.cancel()


class FlightRunClient:
    """A client of a :class:`FlightRunServer`, for engines (put) and consumers (get, list).

    Parameters
    ----------
    location
        ``grpc://host:port`` or ``grpc+tls://host:port``.
    token
        The server's token, sent as ``authorization: Bearer <token>`` with every call.
    tls_root_certs
        PEM of the certificate (or CA) to trust for ``grpc+tls``: bytes or a file path.
    timeout
        Seconds each call may take (None: no limit; a live tail needs none).
    """

    def __init__(
        self,
        location: str,
        *,
        token: str | None = None,
        tls_root_certs: Any = None,
        timeout: float | None = None,
    ) -> None:
        if not isinstance(location, str) or not location.startswith(
            ("grpc://", "grpc+tls://", "grpc+tcp://")
        ):
            raise FieldTypeError("location", "a grpc:// or grpc+tls:// URI", describe(location))
        token = _check_token(token)
        headers = [(b"authorization", (_BEARER + token).encode())] if token else []
        self._options = fl.FlightCallOptions(timeout=timeout, headers=headers)
        roots = _pem(tls_root_certs, "tls_root_certs")
        self._client = (
            fl.FlightClient(location, tls_root_certs=roots) if roots else fl.FlightClient(location)
        )

    def close(self) -> None:
        """Close the connection."""
        self._client.close()

    def __enter__(self) -> FlightRunClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- engines -------------------------------------------------------------------------

    def open_put(
        self,
        run: str,
        *,
        run_metadata: dict[str, Any] | None = None,
        schema: pa.Schema | None = None,
        queue_size: int | None = None,
    ) -> RunUpload:
        """Start sending a new run; write its steps, then close (a context manager).

        Parameters
        ----------
        run
            The run's name (:func:`check_run_name`); the server refuses one it has.
        run_metadata
            User run metadata (JSON-serialisable), stored in the run's schema.
        schema
            The run's schema; by default its first step's.
        queue_size
            None (default): :meth:`RunUpload.write` sends on the caller's thread. An int:
            steps are queued (at most that many) and sent by a background thread.
        """
        return RunUpload(self, run, run_metadata, schema, queue_size)

    def put(
        self,
        run: str,
        steps: Iterable[Any],
        *,
        run_metadata: dict[str, Any] | None = None,
        schema: pa.Schema | None = None,
    ) -> PutResult:
        """Send a whole run: outputs, batches, or ``(batch, custom_metadata)`` pairs."""
        upload = self.open_put(run, run_metadata=run_metadata, schema=schema)
        try:
            for item in steps:
                if isinstance(item, tuple) and len(item) == 2:
                    upload.write(item[0], custom_metadata=item[1])
                else:
                    upload.write(item)
        except BaseException:
            upload.abort()
            raise
        return upload.close()

    # -- consumers -----------------------------------------------------------------------

    def get(self, run: str, *, follow: bool = False) -> RunStream:
        """A run's steps: those stored now, or with ``follow=True`` a live run's steps as they
        land, until its engine closes it (or :meth:`RunStream.cancel`)."""
        check_run_name(run)
        if type(follow) is not bool:
            raise FieldTypeError("follow", "True or False", describe(follow))
        ticket = fl.Ticket(json.dumps({"run": run, "follow": follow}).encode())
        with _server_errors():
            reader = self._client.do_get(ticket, options=self._options)
            return RunStream(reader, run)

    def outputs(self, run: str, *, follow: bool = False, **kw: Any) -> Iterator[Any]:
        """A run's steps as ``ModelRunnerOutput`` objects."""
        return self.get(run, follow=follow).outputs(**kw)

    def read_table(self, run: str) -> pa.Table:
        """A stored run's rows as one table."""
        return self.get(run).read_all()

    def list_runs(self) -> list[RunInfo]:
        """Every run the server has, live ones included."""
        with _server_errors():
            return [_run_info(info) for info in self._client.list_flights(options=self._options)]

    def run_info(self, run: str) -> RunInfo:
        """One run's :class:`RunInfo`."""
        check_run_name(run)
        with _server_errors():
            info = self._client.get_flight_info(
                fl.FlightDescriptor.for_path(run), options=self._options
            )
        return _run_info(info)


def _run_info(info: fl.FlightInfo) -> RunInfo:
    name = info.descriptor.path[0]
    name = name.decode() if isinstance(name, bytes) else name
    meta = json.loads(info.app_metadata or b"{}")
    return RunInfo(
        check_run_name(name),
        info.schema,
        int(meta.get("steps", 0)),
        int(meta.get("rows", 0)),
        bool(meta.get("complete", False)),
        bool(meta.get("live", False)),
        int(info.total_bytes),
    )
