"""Reading runs: memory-mapped zero-copy readers, following a growing run, recovery.

Run files come from elsewhere, so they are untrusted: by default every batch is validated
in full (``RecordBatch.validate(full=True)``, the format's schema, its step JSON and the
writer's running counts) before it is handed out, and anything pyarrow refuses becomes a
:class:`~arrow_outputs.CorruptFileError`. ``validate=False`` skips the full data validation
for trusted files (the structure is still checked).
"""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import pyarrow as pa

from . import _accel
from .batch import decode_checked, from_record_batch, step_metadata
from .errors import ArrowOutputsError, ConsistencyError, CorruptFileError, FieldTypeError
from .schema import check_format, column_types
from .writer import KEY_END, KEY_PROGRESS, OutputWriter

__all__ = [
    "RecoveryReport",
    "RunReader",
    "StepBatch",
    "follow",
    "iter_batches",
    "iter_outputs",
    "open_run",
    "read_table",
    "recover",
]

_FILE_MAGIC = b"ARROW1"
_FILE_PREFIX = 8  # magic + padding before the stream part of the file format
_MAX_COUNTER_JSON = 4096


class StepBatch(NamedTuple):
    """One step's record batch with the IPC custom metadata of its message."""

    batch: pa.RecordBatch
    custom_metadata: Any

    @property
    def step(self) -> Any:
        """The step number (``None`` when the producer gave none)."""
        return step_metadata(self.batch, self.custom_metadata)["step"]

    def output(self, *, classes: Iterable[type] | None = None) -> Any:
        """The step's ``ModelRunnerOutput`` (arrays are read-only views of the batch)."""
        return from_record_batch(self.batch, custom_metadata=self.custom_metadata, classes=classes)


@dataclass(frozen=True)
class RunEnd:
    """The totals a writer recorded when it closed the run."""

    steps: int
    rows: int
    dropped: int


class RunReader:
    """A run file (IPC stream or file format), memory-mapped; iterate it for its steps.

    Opening reads only the messages' metadata (the data stays in the file's pages). Each
    step's batch is validated when it is first handed out, unless ``validate=False``.

    Parameters
    ----------
    source
        A path, or the run's bytes (``bytes`` or a ``pyarrow.Buffer``).
    validate
        ``True`` (default): full validation of every batch before it is handed out. ``False``:
        for trusted files only; corrupt data may then crash whatever reads it.

    Examples
    --------
    >>> import arrow_outputs as ao, pyarrow as pa
    >>> sink = pa.BufferOutputStream()
    >>> with ao.OutputWriter(sink) as writer:
    ...     writer.write(ao.ModelRunnerOutput(["a"], {"a": 0}, [[5]]))
    >>> run = ao.open_run(sink.getvalue())
    >>> run.complete, len(run), run.num_rows
    (True, 1, 1)
    >>> [out.sampled_token_ids for out in run.outputs()]
    [[[5]]]
    """

    def __init__(self, source: Any, *, validate: bool = True) -> None:
        if type(validate) is not bool:
            raise FieldTypeError("validate", "True or False", repr(validate)[:60])
        self.validate = validate
        self.name, buf = _map(source)
        self._steps: list[StepBatch] = []
        self._checked: list[bool] = []
        self.end: RunEnd | None = None
        self.format = "file" if buf.size >= 6 and buf[:6].to_pybytes() == _FILE_MAGIC else "stream"
        with _as_corrupt(self.name):
            if self.format == "file":
                try:
                    reader = pa.ipc.open_file(buf)
                except pa.ArrowInvalid as e:
                    # A file-format run whose writer died has no footer: say what saves it.
                    raise CorruptFileError(
                        self.name,
                        "an Arrow IPC file with its footer (a writer that died leaves none; "
                        "arrow_outputs.recover saves its whole steps)",
                        _short(e),
                    ) from e
                self.schema: pa.Schema = reader.schema
                messages = (
                    reader.get_batch_with_custom_metadata(i)
                    for i in range(reader.num_record_batches)
                )
                self._read(messages)
            else:
                stream = pa.ipc.open_stream(buf)
                self.schema = stream.schema
                self._read(_stream_messages(stream))
        self.num_rows = sum(s.batch.num_rows for s in self._steps)

    def _read(self, messages: Iterator[tuple[pa.RecordBatch, Any]]) -> None:
        _check_run_schema(self.schema, self.name)
        progress = _Progress(self.name)
        for batch, custom in messages:
            if self.end is not None:
                raise CorruptFileError(
                    f"{self.name}: batch {progress.steps}", "nothing after the run's end", "a batch"
                )
            end = _end_of(batch, custom, self.name)
            if end is not None:
                progress.check_end(end)
                self.end = end
                continue
            progress.add(batch, custom)
            self._steps.append(StepBatch(batch, custom))
            self._checked.append(False)

    @property
    def complete(self) -> bool:
        """Whether the run ends with its writer's end marker (its totals checked): a writer
        that died, or a file cut short, leaves no marker."""
        return self.end is not None

    def __len__(self) -> int:
        return len(self._steps)

    def __getitem__(self, index: int) -> StepBatch:
        step = self._steps[index]
        if self.validate:
            i = range(len(self._steps))[index]
            if not self._checked[i]:
                _check_batch(step, f"{self.name}: batch {i}")
                self._checked[i] = True
        return step

    def __iter__(self) -> Iterator[StepBatch]:
        for i in range(len(self._steps)):
            yield self[i]

    def batches(self) -> Iterator[pa.RecordBatch]:
        """The steps' record batches, in order."""
        for step in self:
            yield step.batch

    def outputs(self, *, classes: Iterable[type] | None = None) -> Iterator[Any]:
        """The steps as ``ModelRunnerOutput`` objects, in order. A batch this reader
        validated in full is not validated again by its decode."""
        for step in self:
            yield decode_checked(
                step.batch, step.custom_metadata, True, "error", classes, validated=self.validate
            )

    def read_all(self) -> pa.Table:
        """Every step in one table (no copy: its chunks are the file's batches)."""
        return pa.Table.from_batches(list(self.batches()), schema=self.schema)

    def __arrow_c_stream__(self, requested_schema: Any = None) -> Any:
        """The run as an Arrow C stream: pandas, Polars, DuckDB and pyarrow read it directly."""
        reader = pa.RecordBatchReader.from_batches(self.schema, self.batches())
        return reader.__arrow_c_stream__(requested_schema)

    def __repr__(self) -> str:
        state = "complete" if self.complete else "incomplete"
        return (
            f"<RunReader {self.name} {self.format}, {len(self)} steps, "
            f"{self.num_rows} rows, {state}>"
        )


def open_run(source: Any, *, validate: bool = True) -> RunReader:
    """Open a run file (or its bytes) for reading: see :class:`RunReader`."""
    return RunReader(source, validate=validate)


def read_table(source: Any, *, validate: bool = True) -> pa.Table:
    """A run file as one table, memory-mapped: uncompressed files are not copied.

    Examples
    --------
    >>> import arrow_outputs as ao, pyarrow as pa
    >>> sink = pa.BufferOutputStream()
    >>> with ao.OutputWriter(sink) as writer:
    ...     writer.write(ao.ModelRunnerOutput(["a", "b"], {"a": 0, "b": 1}, [[5], [6]]))
    >>> ao.read_table(sink.getvalue()).column("req_id").to_pylist()
    ['a', 'b']
    """
    return RunReader(source, validate=validate).read_all()


def iter_batches(source: Any, *, validate: bool = True) -> Iterator[pa.RecordBatch]:
    """A run's record batches, one per step (without the writer's end marker)."""
    return RunReader(source, validate=validate).batches()


def iter_outputs(
    source: Any, *, validate: bool = True, classes: Iterable[type] | None = None
) -> Iterator[Any]:
    """A run's steps as ``ModelRunnerOutput`` objects."""
    return RunReader(source, validate=validate).outputs(classes=classes)


# -- following a run while it is written ---------------------------------------------------


def follow(
    path: str | os.PathLike[str],
    *,
    poll_interval: float = 0.05,
    idle_timeout: float | None = None,
    validate: bool = True,
) -> Iterator[StepBatch]:
    """Yield a run's steps while its writer is still appending; end when the run is closed.

    Waits (polling every ``poll_interval`` seconds) for the file to appear and at a partly
    written tail. With ``idle_timeout``, a run that stops growing for that long without its
    end marker (a writer that died) raises :class:`CorruptFileError`; by default it waits as
    long as the writer takes. Batches are read into memory (not memory-mapped).
    """
    if not _seconds(poll_interval) or not poll_interval > 0:
        raise FieldTypeError(
            "poll_interval", "a positive number of seconds", repr(poll_interval)[:60]
        )
    if idle_timeout is not None and (not _seconds(idle_timeout) or not idle_timeout >= 0):
        raise FieldTypeError(
            "idle_timeout", "None or a number of seconds >= 0", repr(idle_timeout)[:60]
        )
    name = os.fspath(path)
    tail = _Tail(name, poll_interval, idle_timeout)
    try:
        with _as_corrupt(name):
            if tail.peek(_FILE_PREFIX)[:6] == _FILE_MAGIC:
                tail.read(_FILE_PREFIX)
            reader = pa.ipc.open_stream(pa.PythonFile(tail, mode="r"))
            _check_run_schema(reader.schema, name)
        progress = _Progress(name)
        while True:
            with _as_corrupt(name):
                try:
                    batch, custom = reader.read_next_batch_with_custom_metadata()
                except StopIteration:
                    raise CorruptFileError(
                        name, "the run's end marker before its end of stream", "none"
                    ) from None
            end = _end_of(batch, custom, name)
            if end is not None:
                progress.check_end(end)
                return
            progress.add(batch, custom)
            step = StepBatch(batch, custom)
            if validate:
                _check_batch(step, f"{name}: batch {progress.steps - 1}")
            yield step
    finally:
        tail.close()


class _Tail(io.RawIOBase):
    """A file read as it grows: a read waits until its bytes exist (or times out)."""

    def __init__(self, path: str, poll: float, idle_timeout: float | None, wait: bool = True):
        self.path, self.poll, self.idle_timeout, self.wait = path, poll, idle_timeout, wait
        self.file: Any = None
        self.pos = 0

    def readable(self) -> bool:
        return True

    def _open(self) -> Any:
        deadline = None if self.idle_timeout is None else time.monotonic() + self.idle_timeout
        while self.file is None:
            try:
                self.file = open(self.path, "rb")  # noqa: SIM115 - closed by close()
            except FileNotFoundError:
                if not self.wait or (deadline is not None and time.monotonic() > deadline):
                    raise CorruptFileError(self.path, "a run file", "no such file") from None
                time.sleep(self.poll)
        return self.file

    def peek(self, n: int) -> bytes:
        data = self._read_exact(n)
        self.file.seek(self.pos)
        return data

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            raise FieldTypeError("n", "a byte count", repr(n))
        data = self._read_exact(n)
        self.pos += len(data)
        return data

    def _read_exact(self, n: int) -> bytes:
        f = self._open()
        f.seek(self.pos)
        parts: list[bytes] = []
        have = 0
        idle_since = time.monotonic()
        while have < n:
            # Never ask for more than the file holds: a hostile length allocates nothing.
            size = os.fstat(f.fileno()).st_size
            chunk = f.read(min(n - have, max(size - self.pos - have, 0)))
            if chunk:
                parts.append(chunk)
                have += len(chunk)
                idle_since = time.monotonic()
                continue
            if not self.wait:
                break
            if self.idle_timeout is not None and time.monotonic() - idle_since > self.idle_timeout:
                raise CorruptFileError(
                    self.path,
                    f"the run to grow or end within idle_timeout={self.idle_timeout} s",
                    f"no new bytes at offset {self.pos + have}",
                )
            time.sleep(self.poll)
        return b"".join(parts)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        super().close()


# -- recovery ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RecoveryReport:
    """What :func:`recover` saved and what it could not.

    ``steps``/``rows``: recovered (written to ``out``). ``complete``: the source already ended
    with its end marker (nothing was lost). ``lost_bytes``: bytes after the last whole step
    that were discarded; ``reason``: why reading stopped there (``None`` when complete).
    ``dropped``: steps the writer itself had dropped (``on_full="drop"``), as recorded.
    """

    steps: int
    rows: int
    complete: bool
    lost_bytes: int
    reason: str | None
    dropped: int


def recover(source: str | os.PathLike[str], out: Any, *, format: str = "stream") -> RecoveryReport:
    """Write every whole step of a run whose writer died to ``out``, as a complete run.

    Reads ``source`` (IPC stream, or file format with or without its footer) from the start
    up to the first message that is cut short or does not validate; each step before it is
    written to ``out`` (a path or writable stream, with ``format`` as for
    :class:`OutputWriter`), which gets its own end marker.
    """
    name = os.fspath(source)
    if isinstance(out, (str, os.PathLike)) and same_file(name, out):
        # The writer truncates `out` first: the run being saved would be destroyed.
        raise ConsistencyError(
            "out", "a file other than the run being recovered", f"{os.fspath(out)!r}, the same"
        )
    size = _file_size(name)
    tail = _Tail(name, 0.01, None, wait=False)
    steps = rows = dropped = 0
    complete = False
    reason: str | None = None
    consumed = 0
    try:
        try:
            if tail.peek(_FILE_PREFIX)[:6] == _FILE_MAGIC:
                tail.read(_FILE_PREFIX)
            reader = pa.ipc.open_stream(pa.PythonFile(tail, mode="r"))
        except (pa.ArrowException, OSError, ValueError) as e:
            raise CorruptFileError(name, "a run with a readable schema", _short(e)) from e
        _check_run_schema(reader.schema, name)
        consumed = tail.pos
        progress = _Progress(name)
        with OutputWriter(out, format=format, schema=reader.schema) as writer:
            while True:
                try:
                    batch, custom = reader.read_next_batch_with_custom_metadata()
                    end = _end_of(batch, custom, name)
                    if end is not None:
                        progress.check_end(end)
                        complete, dropped = True, end.dropped
                        consumed = tail.pos
                        break
                    progress.add(batch, custom)
                    _check_batch(StepBatch(batch, custom), f"{name}: batch {steps}")
                except StopIteration:
                    reason = "the stream ends without the run's end marker"
                    break
                except (pa.ArrowException, OSError, ValueError, ArrowOutputsError) as e:
                    reason = f"a message that is cut short or corrupt ({_short(e)})"
                    break
                writer.write(batch, custom_metadata=custom)
                dropped = progress.dropped
                steps, rows, consumed = steps + 1, rows + batch.num_rows, tail.pos
    finally:
        tail.close()
    lost = 0 if complete else max(size - consumed, 0)
    return RecoveryReport(steps, rows, complete, lost, None if complete else reason, dropped)


def _seconds(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether the paths ``a`` and ``b`` name one existing file (links included)."""
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


# -- shared checks -----------------------------------------------------------------------


class _Progress:
    """The writer's running counts, checked batch by batch (absent in hand-written runs)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.steps = self.rows = self.dropped = 0

    def add(self, batch: pa.RecordBatch, custom: Any) -> None:
        where = f"{self.name}: batch {self.steps}"
        raw = _meta_get(custom, KEY_PROGRESS)
        self.steps += 1
        self.rows += batch.num_rows
        if raw is None:
            return
        got = _counters(raw, f"{where}: custom_metadata[arrow_outputs.progress]", 4)
        want = {"index": self.steps - 1, "steps": self.steps, "rows": self.rows}
        for key, value in want.items():
            if got[key] != value:
                raise CorruptFileError(
                    f"{where}: custom_metadata[arrow_outputs.progress].{key}",
                    f"{value} (counted from the run)",
                    str(got[key]),
                )
        if got["dropped"] < self.dropped:
            raise CorruptFileError(
                f"{where}: custom_metadata[arrow_outputs.progress].dropped",
                f"at least {self.dropped} (it only grows)",
                str(got["dropped"]),
            )
        self.dropped = got["dropped"]

    def check_end(self, end: RunEnd) -> None:
        for key, counted in (("steps", self.steps), ("rows", self.rows)):
            if getattr(end, key) != counted:
                raise CorruptFileError(
                    f"{self.name}: custom_metadata[arrow_outputs.end].{key}",
                    f"{counted} (counted from the run)",
                    str(getattr(end, key)),
                )


def _end_of(batch: pa.RecordBatch, custom: Any, name: str) -> RunEnd | None:
    raw = _meta_get(custom, KEY_END)
    if raw is None:
        return None
    where = f"{name}: custom_metadata[arrow_outputs.end]"
    if batch.num_rows != 0:
        raise CorruptFileError(where, "a 0-row end-marker batch", f"{batch.num_rows} rows")
    got = _counters(raw, where, 3)
    return RunEnd(got["steps"], got["rows"], got["dropped"])


def _counters(raw: bytes, where: str, keys: int) -> dict[str, int]:
    names = ("index", "steps", "rows", "dropped") if keys == 4 else ("steps", "rows", "dropped")
    if len(raw) > _MAX_COUNTER_JSON:
        raise CorruptFileError(where, f"at most {_MAX_COUNTER_JSON} bytes", f"{len(raw)} bytes")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CorruptFileError(where, "a JSON object of counts", _short(e)) from e
    if type(value) is not dict or sorted(value) != sorted(names):
        raise CorruptFileError(where, f"a JSON object with keys {list(names)}", repr(raw[:80]))
    for key in names:
        if type(value[key]) is not int or not 0 <= value[key] < 2**63:
            raise CorruptFileError(f"{where}.{key}", "a count (int >= 0)", repr(value[key])[:40])
    return value


def _meta_get(custom: Any, key: bytes) -> bytes | None:
    if custom is None:
        return None
    value = custom.get(key)
    return None if value is None else bytes(value)


def _check_run_schema(schema: pa.Schema, name: str) -> None:
    try:
        check_format(schema)
        column_types(schema)
    except ArrowOutputsError as e:
        raise type(e)(f"{name}: {e.field}", e.expected, e.got) from e


def _check_batch(step: StepBatch, where: str) -> None:
    """Full validation: Arrow's own (offsets, UTF-8, bounds) and the step JSON's."""
    try:
        _accel.validate_full(step.batch)
    except pa.ArrowException as e:
        raise CorruptFileError(where, "a valid record batch", _short(e)) from e
    meta = step_metadata(step.batch, step.custom_metadata)
    if meta["rows"] != step.batch.num_rows:
        raise CorruptFileError(
            f"{where}: custom_metadata[arrow_outputs.step].rows",
            f"{step.batch.num_rows} (the batch's rows)",
            str(meta["rows"]),
        )


def _stream_messages(reader: Any) -> Iterator[tuple[pa.RecordBatch, Any]]:
    while True:
        try:
            yield reader.read_next_batch_with_custom_metadata()
        except StopIteration:
            return


class _as_corrupt:
    """Turn pyarrow's and the OS's errors about the bytes into ``CorruptFileError``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, err: Any, tb: Any) -> None:
        if (
            err is not None
            and isinstance(err, (pa.ArrowException, OSError))
            and not isinstance(err, ArrowOutputsError)
        ):
            raise CorruptFileError(self.name, "a whole, valid Arrow IPC run", _short(err)) from err


def _map(source: Any) -> tuple[str, pa.Buffer]:
    if isinstance(source, (str, os.PathLike)):
        name = os.fspath(source)
        try:
            return name, pa.memory_map(name).read_buffer()
        except (OSError, pa.ArrowException) as e:
            raise CorruptFileError(name, "a readable run file", _short(e)) from e
    if isinstance(source, (bytes, bytearray, memoryview)):
        return "<bytes>", pa.py_buffer(source)
    if isinstance(source, pa.Buffer):
        return "<buffer>", source
    raise FieldTypeError("source", "a path, bytes or a pyarrow.Buffer", type(source).__name__)


def _file_size(name: str) -> int:
    try:
        return os.stat(name).st_size
    except OSError as e:
        raise CorruptFileError(name, "a readable run file", _short(e)) from e


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."
