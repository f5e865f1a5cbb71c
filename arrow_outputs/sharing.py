"""Steps shared between processes on one machine, never copied by the consumers.

A :class:`StepPublisher` (one per run, in the engine process) writes each step's record
batch as one Arrow IPC message into a slot of a small ring of files on a tmpfs
(``/dev/shm`` by default); any number of :class:`StepSubscriber` processes memory-map
those files and read the batches in place: every column buffer of a batch a subscriber
returns lies inside its mapping of the slot file (no copy of the payload). The run's
schema is written to ``schema.arrows``; each slot file holds a plain Arrow IPC stream: the
same schema message, one record-batch message with its step custom metadata
(uncompressed), end of stream. Slot files, their mappings and their IPC writers are kept
and reused step after step (a new file only for a slot's first step, a larger step, or a
slot a subscriber holds): no file is created, mapped or removed per step.

Guarantees, and how they are kept:

* **A batch a subscriber holds never changes.** Each subscriber marks the slots whose
  memory it still uses (a lease that ends when the last Arrow buffer, numpy view or tensor
  over that memory is freed); the publisher rewrites a slot only when no subscriber holds
  it. A held slot that the ring needs again is *replaced*: the publisher unlinks its file
  and writes a new one (a new generation), and the holder keeps the old pages, which Linux
  keeps alive while they are mapped.
* **A slow or dead subscriber never blocks the publisher for longer than a bound.** The
  ring has ``slots`` entries: a subscriber may lag that many steps behind. When the ring is
  full because of a subscriber that has not read an old step yet, the publisher waits at
  most ``lag_timeout_s`` (a subscriber whose process is gone is dropped at once), then
  applies ``on_lag``: ``"evict"`` (default) drops the subscriber (counted in
  :attr:`StepPublisher.stats`; its next read raises :class:`SubscriberEvictedError`), and
  ``"raise"`` raises :class:`StepTimeoutError` and publishes nothing.
* **Everything a subscriber reads is hostile.** Slot numbers, generations and lengths from
  the control file are checked against the files before anything is mapped or sliced,
  every batch is fully validated (``batch.validate(full=True)``) unless the subscriber
  was made with ``validate=False`` (for trusted producers, e.g. benchmarks), and bad bytes
  raise :class:`CorruptSegmentError` or a :class:`~arrow_outputs.errors.SchemaMismatchError`.
  Nothing is ever pickled.

The control file is a small array of little-endian int64 words that every party maps;
the publisher writes the header and the slot table, each subscriber writes only its own
row. Word stores are single aligned 8-byte stores, and the protocol relies on the store
order of x86-64 (total store order): it is written and tested for Linux on x86-64.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import select
import stat
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from . import _accel, _pyspeedups
from .batch import decode_checked, run_schema, step_custom_metadata, step_metadata
from .errors import ArrowOutputsError, FieldTypeError, SchemaMismatchError
from .schema import KEY_STEP, check_format

__all__ = [
    "CorruptSegmentError",
    "ProducerGoneError",
    "PublisherStats",
    "SharedStep",
    "SharingError",
    "StepPublisher",
    "StepSubscriber",
    "StepTimeoutError",
    "SubscriberEvictedError",
]


# ----------------------------------------------------------------------------- errors


class SharingError(ArrowOutputsError):
    """A failure of the cross-process handoff (not of a step's content)."""


class CorruptSegmentError(SharingError, ValueError):
    """The control file, the schema file or a slot holds bytes that break the layout."""


class SubscriberEvictedError(SharingError):
    """The publisher dropped this subscriber (it lagged past the ring or its timeout)."""


class ProducerGoneError(SharingError):
    """The publisher's process ended without closing the run; no more steps will come."""


class StepTimeoutError(SharingError, TimeoutError):
    """A wait ran past its timeout (a subscriber waiting for a step, or the publisher
    waiting for a lagging subscriber with ``on_lag="raise"``)."""


# ----------------------------------------------------------------------------- layout

MAGIC = int.from_bytes(b"AOSHARE1", "little")
LAYOUT_VERSION = 1
CONTROL_NAME = "control"
SCHEMA_NAME = "schema.arrows"
LOCK_NAME = "lock"
MAX_SLOTS = 4096
MAX_CONSUMERS = 1024

# Header words.
H_MAGIC, H_VERSION, H_SLOTS, H_CONSUMERS, H_PID, H_HEAD, H_CLOSED, H_SCHEMA_LEN = range(8)
H_EVICTED = 8
HEADER_WORDS = 16
# Slot table: one entry per slot.
S_SEQ, S_GEN, S_LEN = range(3)
SLOT_WORDS = 4
# Consumer rows: fixed words, then one "held" word per slot.
R_STATE, R_PID, R_POSITION, R_TOKEN, R_SEEN_NS, R_EVICTED_AT, R_SLEEPING = range(7)
ROW_FIXED = 8
# DETACHED: closed while the process still holds batches of it (its marks still count).
FREE, ACTIVE, EVICTED, DETACHED = 0, 1, 2, 3

_ON_LAG = ("evict", "raise")
_MIN_SLOT_BYTES = 64 * 1024
_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # an IPC stream's end: continuation, length 0
# The longest a sleeping subscriber waits on its wake-up FIFO before it looks again on its own
# (a bound on a lost wake-up, and how often it checks that the publisher is alive).
_WAKE_CAP_S = 0.05
_FENCE = threading.Lock()


def _fence() -> None:
    """A full memory barrier: an uncontended lock round trip is a locked read-modify-write
    on x86-64, which orders every earlier store before every later load (shared mappings
    too). A sleeper stores its flag then loads the head; the publisher stores the head then
    loads the flags: with a fence on each side, one of them sees the other's store."""
    with _FENCE:
        pass


def _wake_name(row: int, token: int) -> str:
    return f"wake-{row:04d}-{token:016x}"


def _row_words(slots: int) -> int:
    return ROW_FIXED + slots


def _control_words(slots: int, consumers: int) -> int:
    return HEADER_WORDS + slots * SLOT_WORDS + consumers * _row_words(slots)


def _slot_name(slot: int, gen: int) -> str:
    return f"slot-{slot:04d}-{gen:010d}"


def _views(
    ctl_map: mmap.mmap, slots: int, consumers: int
) -> tuple[memoryview, list[memoryview], list[memoryview]]:
    """The control words, one view per slot entry and one per consumer row. Plain
    memoryviews: an item store is one aligned 8-byte store, and far cheaper than numpy's."""
    if sys.byteorder != "little":
        raise SharingError("platform", "a little-endian machine", sys.byteorder)
    ctl = memoryview(ctl_map)[: _control_words(slots, consumers) * 8].cast("q")
    base = HEADER_WORDS
    tab = [ctl[base + i * SLOT_WORDS : base + (i + 1) * SLOT_WORDS] for i in range(slots)]
    base += slots * SLOT_WORDS
    w = _row_words(slots)
    rows = [ctl[base + i * w : base + (i + 1) * w] for i in range(consumers)]
    return ctl, tab, rows


def _address(m: mmap.mmap) -> int:
    view = np.frombuffer(m, dtype=np.uint8)
    try:
        return int(view.ctypes.data)
    finally:
        del view  # the export ends here; the map itself lives on


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def _default_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def _map_file(path: Path, *, write: bool) -> tuple[mmap.mmap, int]:
    """Map a whole regular file (no symlinks followed); returns the map and its size."""
    flags = (os.O_RDWR if write else os.O_RDONLY) | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptSegmentError(str(path), "a regular file", f"mode {oct(st.st_mode)}")
        if st.st_size == 0:
            raise CorruptSegmentError(str(path), "a non-empty file", "0 bytes")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if write else 0)
        return mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, prot), st.st_size
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- publisher


@dataclass
class PublisherStats:
    """Counters of a :class:`StepPublisher` (this process's view)."""

    published: int = 0  #: steps published
    payload_bytes: int = 0  #: IPC bytes written into slots
    evicted: int = 0  #: subscribers dropped (lag past the ring, timeout, or process gone)
    replaced_slots: int = 0  #: slot files replaced because a subscriber still held them
    lag_waits: int = 0  #: publishes that had to wait for a lagging subscriber
    lag_wait_s: float = 0.0  #: total time spent in those waits
    evicted_pids: list[int] = field(default_factory=list)  #: pids of dropped subscribers
    wakeups: int = 0  #: sleeping subscribers woken through their FIFO


class _SlotFile:
    """One generation of a slot's file, mapped writable by the publisher for the whole
    time it is the slot's file (its pages are reused step after step).

    It keeps one IPC stream writer over its own ``pyarrow.MemoryMappedFile`` for its whole
    life: the first step writes the schema message then the batch; each later step seeks
    back to the end of the schema message and writes only the batch message (and the
    end-of-stream marker). No file, mapping or writer is made per step."""

    __slots__ = ("capacity", "file", "gen", "map", "started", "writer")

    def __init__(self, path: Path, gen: int, capacity: int) -> None:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, capacity)
            self.map = mmap.mmap(fd, capacity)
        finally:
            os.close(fd)
        # The file was just made by us (O_EXCL, in our 0700 directory): opening it by name
        # again cannot reach another file.
        self.file = pa.memory_map(str(path), "r+")
        self.gen = gen
        self.capacity = capacity
        self.writer: Any = None
        self.started = False

    def close(self) -> None:
        self.writer = None
        self.file.close()


class StepPublisher:
    """The producer side: publishes each step's record batch to shared memory.

    Parameters
    ----------
    path
        Directory to create for the run (it must not exist). Default: a fresh directory
        under ``/dev/shm`` (or the temp dir where there is no ``/dev/shm``). Subscribers
        open the same path; :attr:`path` says where it is.
    slots
        Ring size: how many published steps may be in flight (unread by a subscriber).
    max_consumers
        Rows in the control file: how many subscribers may be attached at once.
    lag_timeout_s
        The longest a publish waits for a subscriber that has not read the step whose slot
        is needed next. A subscriber whose process is gone is dropped without waiting.
    on_lag
        What happens at the timeout: ``"evict"`` drops the lagging subscribers (their next
        read raises :class:`SubscriberEvictedError`), ``"raise"`` raises
        :class:`StepTimeoutError` and publishes nothing (call again to retry).
    check_pids
        Drop subscribers whose process has ended (``kill(pid, 0)``). Turn it off when
        subscribers live in another PID namespace.

    Examples
    --------
    >>> import arrow_outputs as ao
    >>> out = ao.ModelRunnerOutput(["a"], {"a": 0}, [[7]])
    >>> with StepPublisher(slots=4) as pub, StepSubscriber(pub.path) as sub:
    ...     seq = pub.publish(ao.to_record_batch(out, step=0))
    ...     step = sub.next(timeout=5)
    ...     (seq, step.seq, step.output().sampled_token_ids)
    (1, 1, [[7]])
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        slots: int = 8,
        max_consumers: int = 8,
        lag_timeout_s: float = 1.0,
        on_lag: str = "evict",
        check_pids: bool = True,
    ) -> None:
        if not isinstance(slots, int) or not 2 <= slots <= MAX_SLOTS:
            raise FieldTypeError("slots", f"an int within 2..{MAX_SLOTS}", repr(slots))
        if not isinstance(max_consumers, int) or not 1 <= max_consumers <= MAX_CONSUMERS:
            raise FieldTypeError(
                "max_consumers", f"an int within 1..{MAX_CONSUMERS}", repr(max_consumers)
            )
        if on_lag not in _ON_LAG:
            raise FieldTypeError("on_lag", f"one of {_ON_LAG}", repr(on_lag))
        if not isinstance(lag_timeout_s, (int, float)) or not lag_timeout_s >= 0:
            raise FieldTypeError("lag_timeout_s", "a number >= 0", repr(lag_timeout_s))
        if path is None:
            name = f"arrow_outputs-{os.getpid()}-{secrets.token_hex(6)}"
            path = _default_dir() / name
        self.path = Path(path)
        os.mkdir(self.path, 0o700)  # fails if it exists: a run never reuses another's files
        self._slots = slots
        self._consumers = max_consumers
        self._lag_timeout_s = float(lag_timeout_s)
        self._on_lag = on_lag
        self._check_pids = check_pids
        self.stats = PublisherStats()
        self._closed = False
        words = _control_words(slots, max_consumers)
        ctl_path = self.path / CONTROL_NAME
        fd = os.open(ctl_path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, words * 8)
            self._ctl_map = mmap.mmap(fd, words * 8)
        finally:
            os.close(fd)
        (self.path / LOCK_NAME).touch(0o600)
        self._ctl, self._slot_tab, self._rows = _views(self._ctl_map, slots, max_consumers)
        self._head = 0
        self._files: list[_SlotFile | None] = [None] * slots
        self._schema: pa.Schema | None = None
        self._schema_bytes = b""
        self._schema_len = 0
        self._options = pa.ipc.IpcWriteOptions(use_threads=False)
        self._wake_fds: dict[int, tuple[int, int]] = {}  # row -> (token, FIFO fd)
        ctl = self._ctl
        ctl[H_VERSION] = LAYOUT_VERSION
        ctl[H_SLOTS] = slots
        ctl[H_CONSUMERS] = max_consumers
        ctl[H_PID] = os.getpid()
        ctl[H_MAGIC] = MAGIC  # last: a subscriber that sees the magic sees the rest

    # -- properties

    @property
    def head(self) -> int:
        """Sequence number of the last published step (0 before the first; steps count
        from 1)."""
        return self._head

    @property
    def schema(self) -> pa.Schema | None:
        """The run's schema, fixed by the first published batch."""
        return self._schema

    def subscribers(self) -> int:
        """How many subscribers are attached (not evicted) now."""
        return sum(1 for r in self._rows if r[R_STATE] == ACTIVE)

    def wait_for_subscribers(self, n: int, timeout: float = 10.0) -> None:
        """Block until ``n`` subscribers are attached; :class:`StepTimeoutError` after
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self.subscribers() < n:
            if time.monotonic() > deadline:
                raise StepTimeoutError(
                    "subscribers", f"{n} attached within {timeout} s", str(self.subscribers())
                )
            time.sleep(0.001)

    # -- publishing

    def _start_run(self, batch: pa.RecordBatch) -> None:
        schema = run_schema(batch)
        check_format(schema)
        out = pa.BufferOutputStream()
        pa.ipc.new_stream(out, schema, options=self._options).close()
        data = out.getvalue().to_pybytes()[:-8]  # the schema message, without end-of-stream
        tmp = self.path / (SCHEMA_NAME + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self.path / SCHEMA_NAME)
        self._schema = schema
        self._schema_bytes = data
        self._schema_len = len(data)
        self._ctl[H_SCHEMA_LEN] = len(data)

    def _write(self, f: _SlotFile, batch: pa.RecordBatch, custom: Any) -> int:
        """The slot's IPC stream (schema, the batch with its custom metadata, end of
        stream) in the slot's pages: Arrow's writer copies the buffers straight into them.
        The schema message is written once per slot file (see :class:`_SlotFile`)."""
        if f.writer is None:
            # Arrow's own writer in one call (same bytes), while pyarrow's has not taken
            # this file: only its first step writes the schema there.
            end = _accel.write_message(batch, custom, f.map, self._schema_len)
            if end is not None:
                if not f.started:
                    f.map[: self._schema_len] = self._schema_bytes
                    f.started = True
                return end
        if type(custom) is dict:
            # pyarrow's own conversion of a dict in write_batch costs several times more
            # (about 20 us against 2 us per step, measured).
            custom = pa.KeyValueMetadata(custom)
        sink = f.file
        if f.writer is None:
            f.writer = pa.ipc.new_stream(sink, self._schema, options=self._options)
        else:
            sink.seek(self._schema_len)
        f.writer.write_batch(batch, custom_metadata=custom)
        if not f.started:
            # The writer's schema message must be the run's, byte for byte: subscribers
            # skip that many bytes of every slot (checked once per slot file).
            if f.map[: self._schema_len] != self._schema_bytes:
                raise SharingError(
                    "slot schema message", "the bytes of schema.arrows", "other bytes"
                )
            f.started = True
        sink.write(_EOS)
        return int(sink.tell())

    def publish(
        self, batch: pa.RecordBatch, custom_metadata: Mapping[bytes, bytes] | None = None
    ) -> int:
        """Publish one step's record batch; returns its sequence number (1, 2, ...).

        Parameters
        ----------
        batch
            A whole step's batch made by :func:`~arrow_outputs.to_record_batch`. The first
            batch fixes the run's schema; later batches must have it (build them with
            ``schema=publisher.schema``).
        custom_metadata
            The batch's step custom metadata; default
            :func:`~arrow_outputs.step_custom_metadata` of the batch.

        Notes
        -----
        The payload is copied once, into the slot file (the consumers never copy it).
        """
        if self._closed:
            raise SharingError("publisher", "an open publisher", "publish after close()")
        if not isinstance(batch, pa.RecordBatch):
            raise FieldTypeError("batch", "a pyarrow.RecordBatch", type(batch).__name__)
        custom = step_custom_metadata(batch) if custom_metadata is None else custom_metadata
        if not isinstance(custom, pa.KeyValueMetadata) and not _bytes_dict(custom):
            # Checked and converted before any slot is touched; a dict of bytes goes to
            # Arrow's writer as it is (_accel.write_message).
            try:
                custom = pa.KeyValueMetadata(custom)
            except (TypeError, ValueError) as e:
                raise FieldTypeError(
                    "custom_metadata", "a mapping of bytes (or str) to bytes (or str)", str(e)
                ) from e
        if self._schema is None:
            self._start_run(batch)
        elif not batch.schema.equals(self._schema, check_metadata=False):
            raise SchemaMismatchError(
                "batch.schema",
                "the run's schema (fixed by the first published batch; build later batches "
                "with schema=publisher.schema)",
                f"a different schema: {batch.schema.names}",
            )
        seq = self._head + 1
        slot = (seq - 1) % self._slots
        in_place = self._acquire(slot, seq)
        ent = self._slot_tab[slot]
        ent[S_SEQ] = 0  # the slot is being written: no subscriber may take it now
        f = self._files[slot]
        if f is None or not in_place:
            f = self._new_file(slot, self._guess(batch, custom), replacing=f is not None)
        try:
            size = self._write(f, batch, custom)
        except OSError:  # out of the file's bounds: a larger step than the file has held
            f = self._new_file(slot, 2 * max(f.capacity, self._guess(batch, custom)))
            size = self._write(f, batch, custom)
        ent[S_GEN] = f.gen
        ent[S_LEN] = size
        ent[S_SEQ] = seq  # stores become visible in order (x86-64): length before seq ...
        self._ctl[H_HEAD] = seq  # ... and the slot before the head
        self._wake_sleepers()
        self._head = seq
        self.stats.published += 1
        self.stats.payload_bytes += size
        return seq

    def _guess(self, batch: pa.RecordBatch, custom: Mapping[bytes, bytes]) -> int:
        """About the size of the step's stream (a larger one is written again)."""
        meta = sum(len(k) + len(v) for k, v in custom.items())
        return 2 * self._schema_len + batch.nbytes + 64 * batch.num_columns + meta + 4096

    def _new_file(self, slot: int, need: int, *, replacing: bool = False) -> _SlotFile:
        """A new generation of the slot's file: its first use, a larger step, or old pages
        that a subscriber still maps (they stay valid for it after the unlink)."""
        cur = self._files[slot]
        gen = 1 if cur is None else cur.gen + 1
        capacity = max(_MIN_SLOT_BYTES, need, 0 if cur is None else cur.capacity)
        capacity = -(-capacity // mmap.PAGESIZE) * mmap.PAGESIZE
        f = _SlotFile(self.path / _slot_name(slot, gen), gen, capacity)
        if cur is not None:
            cur.close()  # ours only: subscribers' mappings of its pages live on
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path / _slot_name(slot, cur.gen))
            if replacing:
                self.stats.replaced_slots += 1
        self._files[slot] = f
        return f

    def _acquire(self, slot: int, seq: int) -> bool:
        """Make ``slot`` free for ``seq``: every attached subscriber has read the step in
        it. Returns whether the slot's file may be rewritten in place (no one holds it)."""
        old = seq - self._slots
        if old <= 0:
            return True
        rows = self._rows
        start = 0.0
        while True:
            lagging = [r for r in rows if r[R_STATE] == ACTIVE and r[R_POSITION] < old]
            if not lagging:
                break
            now = time.monotonic()
            if start == 0.0:
                start = now
                self.stats.lag_waits += 1
            for r in lagging:
                if self._check_pids and not _pid_alive(r[R_PID]):
                    self._evict(r, seq)
            if now - start >= self._lag_timeout_s:
                lagging = [r for r in rows if r[R_STATE] == ACTIVE and r[R_POSITION] < old]
                if not lagging:
                    break
                self.stats.lag_wait_s += now - start
                if self._on_lag == "raise":
                    pids = [r[R_PID] for r in lagging]
                    raise StepTimeoutError(
                        f"subscribers {pids}",
                        f"to read step {old} within lag_timeout_s={self._lag_timeout_s} "
                        f"(the ring has {self._slots} slots)",
                        "no progress; nothing was published",
                    )
                for r in lagging:
                    self._evict(r, seq)
                break
            os.sched_yield() if now - start < 0.001 else time.sleep(0.0002)
        if start:
            self.stats.lag_wait_s += time.monotonic() - start
        # Held: any row that still marks this slot (an evicted subscriber's too, while its
        # process lives).
        mark = ROW_FIXED + slot
        in_place = True
        for r in rows:
            if r[mark] and r[R_STATE] != FREE:
                if self._check_pids and not _pid_alive(r[R_PID]):
                    # Its mappings died with it: the marks mean nothing any more.
                    if r[R_STATE] == ACTIVE:
                        self._evict(r, seq)
                    r[R_STATE] = FREE
                    continue
                in_place = False
        return in_place

    def _evict(self, r: memoryview, seq: int) -> None:
        pid = r[R_PID]
        r[R_EVICTED_AT] = seq
        if _pid_alive(pid) or not self._check_pids:
            r[R_STATE] = EVICTED
        else:
            r[R_STATE] = FREE  # its mappings died with it
        self.stats.evicted += 1
        self.stats.evicted_pids.append(pid)
        self._ctl[H_EVICTED] = self.stats.evicted

    # -- closing

    def _wake_sleepers(self) -> None:
        """One byte into the FIFO of every subscriber that sleeps (after its spin): the
        store of the head comes first, then a fence, then the look at the flags."""
        _fence()
        for i, r in enumerate(self._rows):
            if r[R_SLEEPING] and r[R_STATE] == ACTIVE:
                self._wake(i, int(r[R_TOKEN]))

    def _wake(self, row: int, token: int) -> None:
        cached = self._wake_fds.get(row)
        if cached is not None and cached[0] != token:
            os.close(cached[1])
            del self._wake_fds[row]
            cached = None
        if cached is None:
            try:
                # Read-write (Linux): the FIFO then always has a reader, so a write never
                # raises SIGPIPE in the engine, even after the subscriber died.
                fd = os.open(
                    self.path / _wake_name(row, token),
                    os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                )
            except OSError:  # gone: it wakes on its own within _WAKE_CAP_S
                return
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.close(fd)  # not ours to write into
                return
            cached = (token, fd)
            self._wake_fds[row] = cached
        try:
            os.write(cached[1], b"\0")
            self.stats.wakeups += 1
        except BlockingIOError:
            pass  # full: bytes are waiting for it already

    def close(self, *, unlink: bool = True, drain_timeout_s: float | None = None) -> None:
        """End the run: subscribers read the steps still in the ring, then
        :meth:`StepSubscriber.next` returns ``None``.

        Parameters
        ----------
        unlink
            Remove the run's files (default). First waits until every attached subscriber
            has read the last step (at most ``drain_timeout_s``; subscribers whose process
            is gone are not waited for), so that none misses a step whose file was removed.
            Batches that subscribers hold stay valid (their pages live while mapped).
        drain_timeout_s
            The longest to wait for that; default 10 s (or ``lag_timeout_s`` if longer).
        """
        if self._closed:
            return
        self._closed = True
        self._ctl[H_CLOSED] = 1
        self._wake_sleepers()
        if unlink and self._head:
            wait = max(10.0, self._lag_timeout_s) if drain_timeout_s is None else drain_timeout_s
            deadline = time.monotonic() + wait
            head = self._head
            while time.monotonic() < deadline and any(
                r[R_STATE] == ACTIVE
                and r[R_POSITION] < head
                and (not self._check_pids or _pid_alive(r[R_PID]))
                for r in self._rows
            ):
                time.sleep(0.0005)
        for f in self._files:
            if f is not None:
                f.close()
        self._files = [None] * self._slots  # unmapped when nothing refers to them
        for _, fd in self._wake_fds.values():
            os.close(fd)
        self._wake_fds.clear()
        if unlink:
            remove_run(self.path)

    def __enter__(self) -> StepPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if not self._closed:
                self.close(drain_timeout_s=0)


def remove_run(path: str | os.PathLike[str]) -> None:
    """Remove a run directory made by :class:`StepPublisher` (after a crash, say): only the
    file names the publisher makes are removed, then the directory."""
    p = Path(path)
    if not p.is_dir():
        return
    for child in p.iterdir():
        n = child.name
        if (
            n in (CONTROL_NAME, SCHEMA_NAME, SCHEMA_NAME + ".tmp", LOCK_NAME)
            or (n.startswith("slot-") and child.is_file())
            or (n.startswith("wake-") and child.is_fifo())
        ):
            with contextlib.suppress(FileNotFoundError):
                child.unlink()
    with contextlib.suppress(OSError):
        p.rmdir()


# ----------------------------------------------------------------------------- subscriber


def _bytes_dict(custom: Any) -> bool:
    """Whether ``custom`` is a dict of bytes to bytes (what ``step_custom_metadata`` gives)."""
    return type(custom) is dict and all(
        type(k) is bytes and type(v) is bytes for k, v in custom.items()
    )


def _custom_metadata(meta: Any, where: str) -> list[tuple[bytes, bytes]]:
    """The ``custom_metadata`` entries of an IPC ``Message`` flatbuffer (``meta``: the bytes
    of ``pyarrow.ipc.Message.metadata``), every offset checked against the bytes.

    pyarrow's ``Message`` does not expose them, and reading them here lets a subscriber
    decode a slot's one message with ``read_message`` and ``read_record_batch`` instead of
    a stream reader over a Python file object (about 30 us less per step). One C walk
    (``_accel.message_custom_metadata``); on a refusal, the specification says what is out
    of bounds."""
    pairs = _accel.message_custom_metadata(meta)
    if pairs is not None:
        return pairs
    try:
        return _pyspeedups.custom_metadata_pairs(meta)
    except struct.error as e:
        raise CorruptSegmentError(
            f"{where} custom_metadata", f"a flatbuffer within {len(meta)} bytes", str(e)
        ) from e


class _Mapping:
    """One slot file generation, mapped read-only, alive while any lease uses it."""

    __slots__ = ("__weakref__", "address", "gen", "map", "size")

    def __init__(self, path: Path, gen: int) -> None:
        self.map, self.size = _map_file(path, write=False)
        self.gen = gen
        self.address = _address(self.map)


class _Lease:
    """Kept alive by every Arrow buffer over one step's bytes; on its end, the slot is
    marked free in the subscriber's row (if the row is still this subscriber's)."""

    __slots__ = ("mapping", "row", "seq", "slot", "token")

    def __init__(self, row: memoryview, token: int, slot: int, seq: int, mapping: Any) -> None:
        self.row = row
        self.token = token
        self.slot = slot
        self.seq = seq
        self.mapping = mapping

    def __del__(self) -> None:
        row = self.row
        with contextlib.suppress(Exception):
            if row[R_TOKEN] == self.token and row[ROW_FIXED + self.slot] == self.seq:
                row[ROW_FIXED + self.slot] = 0


class SharedStep:
    """One step as a subscriber has it: the record batch (its buffers in shared memory)
    and its IPC custom metadata.

    Attributes
    ----------
    seq
        The step's sequence number in the run (1, 2, ...).
    batch
        The record batch, validated unless the subscriber was made with ``validate=False``.
    validated
        Whether the subscriber validated the batch in full (it does unless made with
        ``validate=False``).
    """

    __slots__ = ("_custom", "batch", "seq", "validated")

    def __init__(
        self, seq: int, batch: pa.RecordBatch, custom_metadata: Any, validated: bool = False
    ) -> None:
        self.seq = seq
        self.batch = batch
        # A subscriber passes the message's (key, value) pairs: the KeyValueMetadata is made
        # only when asked for (about 1-2 us a step that decoding does not need).
        self._custom = custom_metadata
        self.validated = validated

    @property
    def custom_metadata(self) -> Any:
        """The batch's IPC custom metadata (its step JSON), a ``pyarrow.KeyValueMetadata``
        for the steps a subscriber reads."""
        custom = self._custom
        if type(custom) is list:
            custom = self._custom = pa.KeyValueMetadata(custom)
        return custom

    def _step_custom(self) -> Any:
        """What decoding reads of the custom metadata, without making it: its step key's
        last value (as a KeyValueMetadata is read, ``batch._custom_raw``)."""
        custom = self._custom
        if type(custom) is not list:
            return custom
        raw = None
        for key, value in custom:
            if key == KEY_STEP:
                raw = value
        return None if raw is None else {KEY_STEP: raw}

    def output(
        self,
        *,
        validate: bool | None = None,
        missing_step_metadata: str = "error",
        classes: Iterable[type] | None = None,
    ) -> Any:
        """The step as a ``ModelRunnerOutput`` (:func:`~arrow_outputs.from_record_batch`,
        whose keyword arguments these are; arrays are read-only views of the shared buffers).
        The full validation is not repeated for a batch the subscriber validated, nor are the
        checks it covers (``validate=True`` re-runs it)."""
        again = validate is True
        if validate is None:
            validate = not self.validated
        return decode_checked(
            self.batch,
            self._step_custom(),
            validate,
            missing_step_metadata,
            classes,
            validated=self.validated and not again,
        )

    def step_metadata(self) -> dict[str, Any]:
        """The step JSON, checked (:func:`~arrow_outputs.step_metadata`)."""
        return step_metadata(self.batch, self._step_custom())

    def __repr__(self) -> str:
        return f"SharedStep(seq={self.seq}, rows={self.batch.num_rows})"


class StepSubscriber:
    """The consumer side: reads the steps a :class:`StepPublisher` publishes, zero-copy.

    A subscriber attaches at the next step to be published and then sees every step, in
    order, until the publisher closes the run (:meth:`next` returns ``None``). It is not
    thread-safe: use one per thread.

    Parameters
    ----------
    path
        The publisher's :attr:`StepPublisher.path`.
    validate
        Fully validate every batch (``batch.validate(full=True)``) before returning it.
        ``False`` trusts the producer's bytes: only for producers you control.
    copy
        Copy each step's bytes into private memory before reading it (a consumer that
        does not trust the producer's process not to scribble on shared pages after
        validation). Default ``False``: zero-copy.
    spin_s
        How long :meth:`next` spins (``sched_yield``) for a new step before it sleeps on
        its wake-up FIFO (``wake-<row>-<token>`` in the run directory), into which the
        publisher writes a byte when it publishes a step or closes the run while this
        subscriber sleeps. A sleeper also looks on its own every 50 ms (and checks that
        the publisher is alive).
    attach_timeout_s
        How long to wait for the publisher's control file to appear.

    Raises
    ------
    SharingError
        No free row for one more subscriber (the publisher's ``max_consumers``).
    CorruptSegmentError
        The control file is not a run's.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        validate: bool = True,
        copy: bool = False,
        spin_s: float = 0.005,
        attach_timeout_s: float = 5.0,
    ) -> None:
        self.path = Path(path)
        self._validate = validate
        self._copy = copy
        self._spin_s = spin_s
        self._closed = True
        ctl_path = self.path / CONTROL_NAME
        deadline = time.monotonic() + attach_timeout_s
        not_ready: CorruptSegmentError | None = None
        while True:
            try:
                self._ctl_map, size = _map_file(ctl_path, write=True)
                ctl = memoryview(self._ctl_map)[: size - size % 8].cast("q")
                if size >= HEADER_WORDS * 8 and ctl[H_MAGIC] == MAGIC:
                    break
            except FileNotFoundError:
                pass
            except CorruptSegmentError as e:
                # The publisher creates the file, then sizes it: empty for a moment.
                not_ready = e
            if time.monotonic() > deadline:
                if not_ready is not None:
                    raise not_ready
                raise StepTimeoutError(
                    str(ctl_path), f"a run's control file within {attach_timeout_s} s", "none"
                )
            time.sleep(0.002)
        if ctl[H_VERSION] != LAYOUT_VERSION:
            raise CorruptSegmentError(
                f"{ctl_path}[version]", f"layout version {LAYOUT_VERSION}", str(ctl[H_VERSION])
            )
        slots, consumers = int(ctl[H_SLOTS]), int(ctl[H_CONSUMERS])
        if not (2 <= slots <= MAX_SLOTS and 1 <= consumers <= MAX_CONSUMERS):
            raise CorruptSegmentError(
                f"{ctl_path}[slots, consumers]",
                f"2..{MAX_SLOTS} and 1..{MAX_CONSUMERS}",
                f"{slots}, {consumers}",
            )
        if size != _control_words(slots, consumers) * 8:
            raise CorruptSegmentError(
                str(ctl_path),
                f"{_control_words(slots, consumers) * 8} bytes for {slots} slots and "
                f"{consumers} consumers",
                f"{size} bytes",
            )
        ctl.release()
        self._ctl, self._slot_tab, rows = _views(self._ctl_map, slots, consumers)
        self._slots = slots
        self._producer_pid = int(self._ctl[H_PID])
        self._token = secrets.randbits(62) + 1
        self._row_index = self._register(rows)
        self._wake_fd = self._make_fifo()
        self._row = rows[self._row_index]
        self._closed = False
        self._maps: list[_Mapping | None] = [None] * slots
        self._schema: pa.Schema | None = None
        self._schema_len = 0

    def _make_fifo(self) -> int:
        """This subscriber's wake-up FIFO (read end, non-blocking), named by its row and
        token; -1 where none can be made (then a sleeping :meth:`next` naps instead)."""
        for old in self.path.glob(f"wake-{self._row_index:04d}-*"):
            with contextlib.suppress(OSError):  # a previous holder's of this row
                if old.is_fifo():
                    old.unlink()
        path = self.path / _wake_name(self._row_index, self._token)
        try:
            os.mkfifo(path, 0o600)
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return -1
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.close(fd)
            return -1
        return fd

    def _register(self, rows: list[memoryview]) -> int:
        import fcntl  # POSIX only: imported here so that the package imports anywhere

        lock_fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            for i, r in enumerate(rows):
                state = int(r[R_STATE])
                reusable = (
                    state == FREE
                    or not _pid_alive(int(r[R_PID]))
                    or (state in (EVICTED, DETACHED) and not any(r[ROW_FIXED:]))
                )
                if reusable:
                    r[R_STATE] = FREE
                    for j in range(ROW_FIXED, len(r)):
                        r[j] = 0
                    r[R_PID] = os.getpid()
                    r[R_TOKEN] = self._token
                    r[R_EVICTED_AT] = 0
                    r[R_SLEEPING] = 0
                    r[R_SEEN_NS] = time.monotonic_ns()
                    # Attach at the next step: every step after the current head is ours.
                    r[R_POSITION] = self._ctl[H_HEAD]
                    r[R_STATE] = ACTIVE
                    return i
        finally:
            os.close(lock_fd)  # releases the lock
        raise SharingError(
            "subscribers",
            f"a free row of the publisher's {len(rows)} (max_consumers)",
            "all taken by live subscribers",
        )

    # -- reading

    @property
    def position(self) -> int:
        """Sequence number of the last step this subscriber has read."""
        return int(self._row[R_POSITION])

    def _check_mine(self) -> None:
        row = self._row
        if row[R_TOKEN] != self._token or row[R_STATE] != ACTIVE:
            at = int(row[R_EVICTED_AT]) if row[R_TOKEN] == self._token else 0
            raise SubscriberEvictedError(
                f"subscriber {os.getpid()} at {self.path}",
                f"to keep up within the publisher's {self._slots}-slot ring and lag timeout",
                f"evicted by the publisher (at step {at}, after reading step "
                f"{int(row[R_POSITION])}); make a new StepSubscriber to attach again",
            )

    def _open_schema(self) -> None:
        n = int(self._ctl[H_SCHEMA_LEN])
        path = self.path / SCHEMA_NAME
        mapped, size = _map_file(path, write=False)
        with mapped:
            if not 0 < n <= size:
                raise CorruptSegmentError(
                    str(path), f"at least {n} bytes (the control file says)", f"{size} bytes"
                )
            data = mapped[:n]
        try:
            schema = pa.ipc.read_schema(pa.py_buffer(data))
        except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as e:
            raise CorruptSegmentError(str(path), "an Arrow IPC schema message", str(e)) from e
        check_format(schema)
        self._schema = schema
        self._schema_len = n

    def _mapping(self, slot: int, gen: int, length: int) -> _Mapping:
        m = self._maps[slot]
        if m is None or m.gen != gen:
            if not 1 <= gen < 1 << 40:
                raise CorruptSegmentError(f"control.slot[{slot}].gen", "1..2**40", str(gen))
            try:
                m = _Mapping(self.path / _slot_name(slot, gen), gen)
            except FileNotFoundError as e:
                # Replaced since we read the slot table: the step is gone for us.
                self._check_mine()
                if self._ctl[H_CLOSED]:
                    raise SharingError(
                        f"step {self.position + 1}",
                        "its slot file",
                        "a run closed and removed before this subscriber read it "
                        "(the publisher's drain_timeout_s ran out)",
                    ) from e
                raise CorruptSegmentError(
                    f"slot {slot}", f"generation {gen} to exist", "a missing file"
                ) from e
            self._maps[slot] = m
        if not 0 < length <= m.size:
            raise CorruptSegmentError(
                f"control.slot[{slot}].length", f"1..{m.size} (the slot file's size)", str(length)
            )
        return m

    def _read(self, seq: int) -> SharedStep:
        slot = (seq - 1) % self._slots
        ent = self._slot_tab[slot]
        row = self._row
        got = int(ent[S_SEQ])
        if got != seq:
            self._check_mine()
            raise CorruptSegmentError(f"control.slot[{slot}].seq", str(seq), str(got))
        gen, length = int(ent[S_GEN]), int(ent[S_LEN])
        mapping = self._mapping(slot, gen, length)
        row[ROW_FIXED + slot] = seq  # held: before the position moves (see _acquire)
        self._check_mine()
        if self._schema is None:
            self._open_schema()
        # The slot holds a whole IPC stream; its schema message is the run's (read once
        # from schema.arrows), so only the batch message is decoded.
        start, end = self._schema_len, length - 8
        if not start < end:
            raise CorruptSegmentError(
                f"control.slot[{slot}].length",
                f"more than {start + 8} bytes (schema, batch, end of stream)",
                str(length),
            )
        if self._copy:
            data = pa.py_buffer(bytes(memoryview(mapping.map)[start:end]))
            row[ROW_FIXED + slot] = 0
        else:
            lease = _Lease(row, self._token, slot, seq, mapping)
            data = pa.foreign_buffer(mapping.address + start, end - start, base=lease)
            del lease
        try:
            batch, custom = self._decode(data, f"slot {slot} (step {seq})")
        except CorruptSegmentError:
            row[R_POSITION] = seq  # the step is refused, not retried: the next read moves on
            raise
        if int(ent[S_SEQ]) != seq or int(ent[S_GEN]) != gen:
            self._check_mine()
            raise CorruptSegmentError(f"control.slot[{slot}]", f"step {seq}", "rewritten")
        row[R_POSITION] = seq
        row[R_SEEN_NS] = time.monotonic_ns()
        if self._validate:
            try:
                _accel.validate_full(batch)
            except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
                raise SchemaMismatchError(
                    f"step {seq}", "a record batch that passes full validation", str(e)
                ) from e
        return SharedStep(seq, batch, custom, self._validate)

    def _decode(self, data: pa.Buffer, where: str) -> tuple[pa.RecordBatch, Any]:
        """One record-batch message that fills ``data`` exactly: the batch (its buffers are
        slices of ``data``) and its custom metadata as (key, value) pairs. Arrow checks the
        message's flatbuffer and that every buffer lies within the body; full validation
        comes after."""
        got = _accel.read_message(data, self._schema)  # Arrow's reader in one call
        if got is not None:
            return got
        try:
            stream = pa.BufferReader(data)
            message = pa.ipc.read_message(stream)
            if stream.tell() != data.size:
                raise CorruptSegmentError(
                    where,
                    f"one record-batch message of {data.size} bytes",
                    f"a message of {stream.tell()} bytes",
                )
            custom = _custom_metadata(memoryview(message.metadata), where)
            batch = pa.ipc.read_record_batch(message, self._schema)
        except EOFError as e:  # read_message at an end-of-stream marker
            raise CorruptSegmentError(
                where, "one Arrow IPC record-batch message", "end of stream"
            ) from e
        except (pa.ArrowException, OSError) as e:
            raise CorruptSegmentError(where, "one Arrow IPC record-batch message", str(e)) from e
        return batch, custom

    def poll(self) -> SharedStep | None:
        """The next step if it is published, else ``None`` (no waiting)."""
        self._require_open()
        self._check_mine()
        want = int(self._row[R_POSITION]) + 1
        if int(self._ctl[H_HEAD]) >= want:
            return self._read(want)
        return None

    def next(self, timeout: float | None = None) -> SharedStep | None:
        """Wait for the next step and return it; ``None`` once the publisher has closed the
        run and every step before its close has been read.

        Raises
        ------
        StepTimeoutError
            No step within ``timeout`` seconds (``None``: wait as long as the publisher
            lives).
        ProducerGoneError
            The publisher's process ended without closing the run (after the steps it
            published have been read).
        SubscriberEvictedError
            The publisher dropped this subscriber.
        """
        self._require_open()
        ctl = self._ctl
        want = int(self._row[R_POSITION]) + 1
        start = time.monotonic()
        nap = 50e-6
        while True:
            if int(ctl[H_HEAD]) >= want:
                return self._read(want)
            self._check_mine()
            if ctl[H_CLOSED]:
                if int(ctl[H_HEAD]) >= want:
                    continue
                return None
            now = time.monotonic()
            if timeout is not None and now - start > timeout:
                raise StepTimeoutError(
                    f"step {want}", f"to be published within {timeout} s", "nothing"
                )
            if now - start < self._spin_s:
                os.sched_yield()
                continue
            if not _pid_alive(self._producer_pid) and int(ctl[H_HEAD]) < want:
                raise ProducerGoneError(
                    f"publisher {self._producer_pid} at {self.path}",
                    "a live process or a closed run",
                    f"a process that ended after step {int(ctl[H_HEAD])} without close()",
                )
            fd = self._wake_fd
            if fd < 0:
                time.sleep(nap)
                nap = min(nap * 2, 0.001)
                continue
            row = self._row
            row[R_SLEEPING] = 1
            try:
                _fence()  # the flag's store before the head's load (see _fence)
                if int(ctl[H_HEAD]) >= want or ctl[H_CLOSED]:
                    continue
                wait = _WAKE_CAP_S
                if timeout is not None:
                    wait = max(0.0, min(wait, timeout - (time.monotonic() - start)))
                select.select([fd], [], [], wait)
            finally:
                row[R_SLEEPING] = 0
            with contextlib.suppress(BlockingIOError):
                os.read(fd, 4096)  # drained: wake-ups carry no data

    def __iter__(self) -> Iterator[SharedStep]:
        while True:
            step = self.next()
            if step is None:
                return
            yield step

    def _require_open(self) -> None:
        if self._closed:
            raise SharingError("subscriber", "an open subscriber", "a read after close()")

    def close(self) -> None:
        """Detach: the row is freed for another subscriber. Batches already read stay
        valid (their mappings live while anything uses them)."""
        if self._closed:
            return
        self._closed = True
        row = self._row
        if row[R_TOKEN] == self._token:
            if any(row[ROW_FIXED:]):
                # Batches of this subscriber are still alive here: their slots stay marked
                # (the leases clear them) so the publisher never rewrites them in place.
                row[R_STATE] = DETACHED
            else:
                row[R_TOKEN] = 0
                row[R_STATE] = FREE
        self._maps = [None] * self._slots
        if self._wake_fd >= 0:
            os.close(self._wake_fd)
            self._wake_fd = -1
            with contextlib.suppress(OSError):
                os.unlink(self.path / _wake_name(self._row_index, self._token))

    def __enter__(self) -> StepSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
