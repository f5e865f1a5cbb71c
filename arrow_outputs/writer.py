"""``OutputWriter``: a run's steps into an Arrow IPC stream or file, off the engine's thread.

The caller's ``write()`` only checks the argument's kind and queues it; a background thread
turns each step into a record batch and writes it with its step metadata. Every batch also
carries the run's running counts, and ``close()`` ends the run with a 0-row marker batch, so
a reader tells a complete run from a cut one (see ``docs/streaming.md``).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from . import _accel
from .batch import run_schema, step_custom_metadata, step_metadata, to_record_batch
from .errors import (
    ArrowOutputsError,
    FieldTypeError,
    SchemaMismatchError,
    UnsupportedValueError,
    WriterError,
)
from .schema import KEY_RUN, KEY_STEP, check_format

__all__ = ["KEY_END", "KEY_PROGRESS", "OutputWriter", "WriterStats"]

#: IPC custom metadata of every step batch: JSON ``{"index", "steps", "rows", "dropped"}``.
KEY_PROGRESS = b"arrow_outputs.progress"
#: IPC custom metadata of the run's last, 0-row batch: JSON ``{"steps", "rows", "dropped"}``.
KEY_END = b"arrow_outputs.end"

FORMATS = ("stream", "file")
COMPRESSIONS = (None, "lz4", "zstd")
ON_FULL = ("block", "drop")
_STOP = object()
_ABORT = object()


@dataclass(frozen=True)
class WriterStats:
    """What an :class:`OutputWriter` has done so far.

    ``steps`` and ``rows`` are written (complete in the sink); ``queued`` wait in the queue;
    ``dropped`` were refused by a full queue under ``on_full="drop"`` (recorded in the file).
    """

    steps: int
    rows: int
    queued: int
    dropped: int


class OutputWriter:
    """Writes a run's steps to an Arrow IPC stream or file from a background thread.

    Parameters
    ----------
    sink
        A path (``str`` or ``os.PathLike``; created or truncated, closed by the writer) or a
        writable binary stream (a pyarrow ``NativeOutputStream`` or a Python file object;
        left open).
    format
        ``"stream"`` (default): Arrow IPC stream format, readable while it grows
        (:func:`~arrow_outputs.follow`) and recoverable up to the last whole step.
        ``"file"``: Arrow IPC file format, with a footer for random access.
    compression
        ``None`` (default), ``"lz4"`` or ``"zstd"``: IPC buffer compression. Compressed files
        are smaller but reading them is not zero-copy.
    queue_size
        Steps that may wait for the background thread (at least 1).
    on_full
        What ``write()`` does when the queue is full: ``"block"`` (default) waits for room;
        ``"drop"`` drops the step, counts it, and records the count in the file.
    run_metadata
        User run metadata (a JSON-serialisable dict: model, config...), stored in the schema.
    schema
        The run's schema (:func:`~arrow_outputs.run_schema`); by default the first step's.

    Examples
    --------
    >>> import arrow_outputs as ao, pyarrow as pa
    >>> sink = pa.BufferOutputStream()
    >>> with ao.OutputWriter(sink) as writer:
    ...     for step in range(3):
    ...         writer.write(ao.ModelRunnerOutput(["a"], {"a": 0}, [[step]]))
    >>> writer.stats
    WriterStats(steps=3, rows=3, queued=0, dropped=0)
    """

    def __init__(
        self,
        sink: Any,
        *,
        format: str = "stream",
        compression: str | None = None,
        queue_size: int = 64,
        on_full: str = "block",
        run_metadata: dict[str, Any] | None = None,
        schema: pa.Schema | None = None,
    ) -> None:
        if format not in FORMATS:
            raise FieldTypeError("format", " or ".join(map(repr, FORMATS)), repr(format))
        if compression not in COMPRESSIONS:
            raise FieldTypeError("compression", "None, 'lz4' or 'zstd'", repr(compression)[:60])
        if type(queue_size) is not int or queue_size < 1:
            raise FieldTypeError("queue_size", "an int >= 1", repr(queue_size)[:60])
        if on_full not in ON_FULL:
            raise FieldTypeError("on_full", "'block' or 'drop'", repr(on_full)[:60])
        if run_metadata is not None and not isinstance(run_metadata, dict):
            raise FieldTypeError("run_metadata", "a dict or None", type(run_metadata).__name__)
        if schema is not None:
            if not isinstance(schema, pa.Schema):
                raise FieldTypeError("schema", "a pyarrow.Schema (run_schema(batch))", repr(schema))
            check_format(schema)
            schema = _with_run_metadata(run_schema(schema), run_metadata)
        self._format = format
        self._options = pa.ipc.IpcWriteOptions(compression=compression)
        self._on_full = on_full
        self._run_metadata = run_metadata
        self._schema: pa.Schema | None = schema
        self._sink, self._owns_sink = _open_sink(sink)
        self._writer: Any = None
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()  # orders step numbers with queue order
        self._next_index = 0
        self._steps = 0
        self._rows = 0
        self._dropped = 0
        self._error: BaseException | None = None
        self._error_raised = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="arrow_outputs-writer", daemon=True)
        self._thread.start()

    # -- the caller's side -------------------------------------------------------------

    def write(
        self, step_output: Any, *, step: int | None = None, custom_metadata: Any = None
    ) -> None:
        """Queue one step.

        Parameters
        ----------
        step_output
            A ``ModelRunnerOutput`` (ours or vLLM's; not to be changed after this call), an
            ``AsyncModelRunnerOutput`` (its ``get_record_batch`` or ``get_output`` runs on the
            writer's thread), or a record batch of this format.
        step
            The step number stored in the batch; by default the writer counts from 0. Ignored
            for a record batch, which has its own.
        custom_metadata
            For a record batch read from IPC: the custom metadata of its message (its step
            JSON). Batches made by ``to_record_batch`` carry their own.
        """
        self._raise_pending()
        if self._closed:
            raise WriterError("writer", "an open writer", "write() after close()")
        if isinstance(step_output, pa.RecordBatch):
            if custom_metadata is None:
                # Refused here, not in the thread: a batch without its own step JSON.
                custom_metadata = step_custom_metadata(step_output)
            item: tuple[str, Any, Any, Any] = ("batch", step_output, None, custom_metadata)
        elif custom_metadata is not None:
            raise FieldTypeError(
                "custom_metadata", "None unless a record batch is written", "a value"
            )
        elif callable(getattr(step_output, "get_output", None)):
            item = ("async", step_output, step, None)
        elif hasattr(step_output, "req_ids") and hasattr(step_output, "req_id_to_index"):
            item = ("output", step_output, step, None)
        else:
            raise FieldTypeError(
                "step_output",
                "a ModelRunnerOutput, an AsyncModelRunnerOutput or a record batch",
                type(step_output).__name__,
            )
        with self._lock:
            if self._on_full == "drop":
                try:
                    self._queue.put_nowait((self._next_index, item))
                except queue.Full:
                    self._dropped += 1
                    self._next_index += 1  # the step number stays used: a visible gap
                    return
            else:
                self._put((self._next_index, item))
            self._next_index += 1

    def _put(self, entry: Any) -> None:
        # Wake up now and then, so a writer thread that died does not block us forever.
        while True:
            try:
                self._queue.put(entry, timeout=0.1)
                return
            except queue.Full:
                if not self._thread.is_alive():
                    self._raise_pending()
                    raise WriterError(
                        "writer", "a running writer thread", "it has stopped"
                    ) from None

    def flush(self) -> None:
        """Wait until every queued step is written (or an error stopped the writer)."""
        self._queue.join()
        self._raise_pending()

    def close(self) -> None:
        """Write every queued step, end the run with its end marker, and close the writer.

        Raises the background thread's error if one stopped it and was not raised yet; the
        run is then left without its end marker (incomplete, which readers report).
        """
        if self._closed:
            self._raise_pending()
            return
        with self._lock:
            self._closed = True
            self._put(_STOP)
        self._thread.join()
        self._raise_pending()

    def abort(self) -> BaseException | None:
        """Write the steps already queued, then close without the end marker: the run reads
        as incomplete, as a run cut short should (an upload that broke off, a failed job).

        Returns the background thread's error if one stopped it and was not raised yet,
        rather than raising it.
        """
        if not self._closed:
            with self._lock:
                self._closed = True
                self._put(_ABORT)
            self._thread.join()
        err = None if self._error_raised else self._error
        self._error_raised = True
        return err

    def __enter__(self) -> OutputWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:  # do not hide the caller's exception behind one of ours
            with contextlib.suppress(ArrowOutputsError):
                self.close()

    @property
    def stats(self) -> WriterStats:
        """Counts of steps and rows written, steps queued and steps dropped."""
        return WriterStats(self._steps, self._rows, self._queue.qsize(), self._dropped)

    @property
    def schema(self) -> pa.Schema | None:
        """The run's schema, once its first step is written (or given)."""
        return self._schema

    def _raise_pending(self) -> None:
        err = self._error
        if err is None:
            return
        if not self._error_raised:
            self._error_raised = True
            raise err
        raise WriterError(
            "writer", "a writer that has not failed", f"it stopped after an error: {err}"
        ) from err

    # -- the background thread ---------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                entry = self._queue.get()
                try:
                    if entry is _STOP:
                        self._finish()
                        return
                    if entry is _ABORT:
                        return  # the sink is closed below, without the end marker
                    if self._error is None:
                        self._write_entry(*entry)
                except BaseException as e:  # surfaced on the caller's next call
                    if self._error is None:
                        self._error = e
                finally:
                    self._queue.task_done()
        finally:
            self._close_sink()

    def _write_entry(self, index: int, item: tuple[str, Any, Any, Any]) -> None:
        kind, value, step, custom = item
        if step is None and kind != "batch":
            step = index
        if kind == "batch":
            batch, meta = self._checked_batch(value, custom)
        else:
            # The run metadata goes into the run's schema (_check_schema), not each batch.
            if kind == "async":
                batch = _async_batch(value, step, self._schema)
            else:
                batch = to_record_batch(value, step=step, schema=self._schema)
            meta = step_custom_metadata(batch)
            self._check_schema(batch)
        writer = self._writer_for(batch)
        progress = {
            "index": self._steps,
            "steps": self._steps + 1,
            "rows": self._rows + batch.num_rows,
            "dropped": self._dropped,
        }
        meta = {**meta, KEY_PROGRESS: json.dumps(progress).encode()}
        writer.write_batch(batch, custom_metadata=meta)
        self._steps += 1
        self._rows += batch.num_rows

    def _checked_batch(self, batch: pa.RecordBatch, custom: Any) -> tuple[pa.RecordBatch, Any]:
        """A batch from elsewhere: our format, the run's schema, whole, with its step JSON."""
        check_format(batch.schema)
        self._check_schema(batch)
        try:
            _accel.validate_full(batch)
        except pa.ArrowException as e:
            raise SchemaMismatchError("batch", "a valid record batch", str(e)[:200]) from e
        meta = step_metadata(batch, custom)
        if meta["rows"] != batch.num_rows:
            raise SchemaMismatchError(
                "custom_metadata[arrow_outputs.step].rows",
                f"{batch.num_rows} (the batch's rows)",
                str(meta["rows"]),
            )
        return batch, {KEY_STEP: _step_raw(custom)}

    def _check_schema(self, batch: pa.RecordBatch) -> None:
        if self._schema is None:
            self._schema = _with_run_metadata(run_schema(batch), self._run_metadata)
        elif not batch.schema.equals(self._schema, check_metadata=False):
            raise SchemaMismatchError("batch.schema", str(self._schema), str(batch.schema))

    def _writer_for(self, batch: pa.RecordBatch) -> Any:
        if self._writer is None:
            assert self._schema is not None
            opener = pa.ipc.new_stream if self._format == "stream" else pa.ipc.new_file
            self._writer = opener(self._sink, self._schema, options=self._options)
        return self._writer

    def _finish(self) -> None:
        if self._error is not None:
            return
        if self._writer is None and self._schema is None:
            # No step at all: a valid, complete run needs a schema; use the format's default.
            from .schema import output_schema

            self._schema = output_schema(metadata=self._run_metadata)
        writer = self._writer_for(pa.RecordBatch.from_pylist([], schema=self._schema))
        end = {"steps": self._steps, "rows": self._rows, "dropped": self._dropped}
        empty = pa.RecordBatch.from_pylist([], schema=self._schema)
        writer.write_batch(empty, custom_metadata={KEY_END: json.dumps(end).encode()})
        writer.close()
        self._writer = None

    def _close_sink(self) -> None:
        if self._writer is not None:  # stopped by an error or aborted: no end marker
            with contextlib.suppress(pa.ArrowException, OSError):
                self._writer.close()
        if self._owns_sink:
            try:
                self._sink.close()
            except (pa.ArrowException, OSError) as e:
                if self._error is None:
                    self._error = e


def _open_sink(sink: Any) -> tuple[Any, bool]:
    if isinstance(sink, (str, os.PathLike)):
        try:
            return pa.OSFile(os.fspath(sink), "wb"), True
        except (OSError, pa.ArrowException) as e:
            raise FieldTypeError("sink", "a writable path", f"{os.fspath(sink)!r} ({e})") from e
    if isinstance(sink, pa.NativeFile):
        if not sink.writable():
            raise FieldTypeError("sink", "a writable stream", "a read-only pyarrow file")
        return sink, False
    if callable(getattr(sink, "write", None)):
        return pa.PythonFile(sink, mode="w"), False
    raise FieldTypeError("sink", "a path or a writable binary stream", type(sink).__name__)


def _with_run_metadata(schema: pa.Schema, run_metadata: dict[str, Any] | None) -> pa.Schema:
    if run_metadata is None:
        return schema
    meta = dict(schema.metadata or {})
    try:
        meta[KEY_RUN] = json.dumps(run_metadata, allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise FieldTypeError("run_metadata", "JSON-serialisable values", str(e)) from e
    return schema.with_metadata(meta)


def _step_raw(custom: Any) -> bytes:
    for key, value in custom.items():
        if key in (KEY_STEP, KEY_STEP.decode()):
            return value.encode() if isinstance(value, str) else bytes(value)
    raise UnsupportedValueError("custom_metadata", "an arrow_outputs.step key", "none")


def _async_batch(value: Any, step: int | None, schema: pa.Schema | None) -> pa.RecordBatch:
    """An async output's batch: its own record-batch method when it has one (no lists)."""
    get_batch: Callable[..., pa.RecordBatch] | None = getattr(value, "get_record_batch", None)
    if callable(get_batch):
        return get_batch(step=step, schema=schema)
    return to_record_batch(value.get_output(), step=step, schema=schema)
