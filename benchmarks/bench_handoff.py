"""Process-to-process handoff on one machine: arrow_outputs.sharing against vLLM's own way.

What is timed: one engine step, from the moment the producer process starts handing it
over to the moment a consumer process "has it", as latency per step (producer and consumer
are separate processes; ``time.perf_counter_ns`` is CLOCK_MONOTONIC, one clock for the
whole machine). The producer waits for the consumer's acknowledgement before the next step
(outside the timed span), so no step queues behind another.

Baseline (``vLLM``): vLLM's ``MessageQueue`` over its ``ShmRingBuffer``, re-implemented here
from ``vllm/distributed/device_communicators/shm_broadcast.py`` (vLLM 0.2x-0.33, the
path that moves ``ModelRunnerOutput`` from a worker to the engine core in
``MultiprocExecutor``): ``pickle.dumps(obj, protocol=HIGHEST_PROTOCOL,
buffer_callback=oob_callback)`` where buffers of 1 MiB or more go out of band, written into
a ring chunk as ``[overflow byte][2-byte buffer count][4-byte length, bytes]...``, one
written flag and one read flag per reader per chunk, readers spinning with
``os.sched_yield()``; the reader calls ``pickle.loads(buf0, buffers=rest)`` on slices of
the shared chunk and then sets its read flag. Readers are always in the busy mode of vLLM's
``SpinCondition`` (``sched_yield()`` while the last read is under ``busy_loop_s`` = 1 s old,
which every timed step is). Left out, each of which could only add to vLLM's time: the
ZeroMQ overflow path (for messages larger than a chunk: none here), ``SpinCondition``'s
writer-side notification over a ZeroMQ socket and its idle mode, and the torch tensor
reducer (these outputs hold numpy arrays and lists, as the worker's ``ModelRunnerOutput``
does after ``tolist()``).
Its consumer "has it" when ``dequeue`` returns the ``ModelRunnerOutput``; that object
serves both kinds of consumer.

Ours: ``StepPublisher.publish(batch)`` (which also takes the batch's step custom metadata)
and a ``StepSubscriber`` (full validation on, the default), two consumers:

* ``columnar`` (analytics): has it when ``sub.next()`` returns the validated record batch
  (zero-copy: its buffers lie in the consumer's mapping of the slot file);
* ``objects`` (a scheduler): has it when ``step.output()`` has rebuilt the
  ``ModelRunnerOutput`` (``from_record_batch``; no second validation).

Each runs twice: from a record batch in hand (what ``AsyncArrowOutput`` gives an engine
that produces Arrow), and ``+enc``: from the ``ModelRunnerOutput`` (``to_record_batch``
inside the timed span). Targets (issue 8) are judged on the batch-in-hand figures; the
``+enc`` ratios are printed alongside.

For information (no target), ``vLLM`` and ``objects`` also run at 1024 requests on
``bench_encode.churn_steps``: 1 row in 64 gets a new request each step, the others keep
theirs (the decoder reuses their request-id strs).

Method: one consumer process per transport and kind, started once (spawn) and kept for the
whole run; per size, rounds of blocks of ``--steps`` steps, one block per configuration in a
fresh random order per round; idle consumers sleep on a control word, not on their
transport, so they do not steal the CPU of the pair being timed. Figures are the median
latency over all steps, ``±`` half the interquartile range in %, ratios vLLM / ours from
the medians, with the spread of the per-round ratios. Before timing, every consumer checks
what it received against the producer's output (``arrow_outputs.first_difference``,
strict) and, for ours, that every buffer of the batch lies inside its mapping.

Usage::

    python benchmarks/bench_handoff.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pickle
import platform
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any
from unittest.mock import patch

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_encode import CHURN_EVERY, churn_steps, decode_step

import arrow_outputs as ao
from arrow_outputs.sharing import StepPublisher, StepSubscriber

SIZES = (1, 64, 256, 1024)
VARIANTS = 4
# For information (no target): the object consumer on steps in which 1 row in CHURN_EVERY
# gets a new request (bench_encode.churn_steps), as a scheduler receives most steps.
CHURN_SIZES = (1024,)
CHURN_CONFIGS = ("vllm", "objects")
TARGETS = {"columnar": {1: 1.0, 1024: 4.0}, "objects": {1: 1.0, 1024: 2.0}}

# ----------------------------------------------------------------------------- vLLM's ring


def _memory_fence_lock() -> Callable[[], None]:
    lock = threading.Lock()

    def fence() -> None:
        # vLLM's memory_fence(): a lock round trip, a full barrier on every platform.
        with lock:
            pass

    return fence


memory_fence = _memory_fence_lock()


class ShmRingBuffer:
    """vLLM's ``ShmRingBuffer``: ``max_chunks`` chunks of ``max_chunk_bytes``, then per
    chunk one written flag and one read flag per reader."""

    def __init__(
        self, n_reader: int, max_chunk_bytes: int, max_chunks: int, name: str | None = None
    ) -> None:
        self.n_reader = n_reader
        self.metadata_size = 1 + n_reader
        self.max_chunk_bytes = max_chunk_bytes
        self.max_chunks = max_chunks
        self.total_bytes_of_buffer = (max_chunk_bytes + self.metadata_size) * max_chunks
        self.data_offset = 0
        self.metadata_offset = max_chunk_bytes * max_chunks
        if name is None:
            self.is_creator = True
            self.shared_memory = shared_memory.SharedMemory(
                create=True, size=self.total_bytes_of_buffer
            )
            self.shared_memory.buf[self.metadata_offset :] = bytes(  # type: ignore[index]
                self.total_bytes_of_buffer - self.metadata_offset
            )
        else:
            self.is_creator = False
            # As vLLM does: the resource tracker must not unlink a segment it did not make.
            with patch("multiprocessing.resource_tracker.register", lambda *a, **k: None):
                self.shared_memory = shared_memory.SharedMemory(name=name)

    def handle(self) -> tuple[int, int, int, str]:
        return (self.n_reader, self.max_chunk_bytes, self.max_chunks, self.shared_memory.name)

    @contextmanager
    def get_data(self, current_idx: int) -> Iterator[memoryview]:
        start = self.data_offset + current_idx * self.max_chunk_bytes
        # As vLLM has it (typeshed's buf is Optional: it is not None while the segment is open).
        chunk = self.shared_memory.buf[start : start + self.max_chunk_bytes]  # type: ignore[index]
        with memoryview(chunk) as buf:
            yield buf

    @contextmanager
    def get_metadata(self, current_idx: int) -> Iterator[memoryview]:
        start = self.metadata_offset + current_idx * self.metadata_size
        meta = self.shared_memory.buf[start : start + self.metadata_size]  # type: ignore[index]
        with memoryview(meta) as buf:
            yield buf

    def close(self) -> None:
        self.shared_memory.close()
        if self.is_creator:
            self.shared_memory.unlink()


class MessageQueue:
    """The local-reader path of vLLM's ``MessageQueue`` (enqueue / dequeue)."""

    def __init__(self, buffer: ShmRingBuffer, reader_rank: int = -1) -> None:
        self.buffer = buffer
        self.current_idx = 0
        self.local_reader_rank = reader_rank

    @contextmanager
    def acquire_write(self) -> Iterator[memoryview]:
        while True:
            with self.buffer.get_metadata(self.current_idx) as metadata_buffer:
                read_count = sum(metadata_buffer[1:])
                written_flag = metadata_buffer[0]
                if written_flag and read_count != self.buffer.n_reader:
                    os.sched_yield()
                    continue
                metadata_buffer[0] = 0
                with self.buffer.get_data(self.current_idx) as buf:
                    yield buf
                for i in range(1, self.buffer.n_reader + 1):
                    metadata_buffer[i] = 0
                metadata_buffer[0] = 1
                memory_fence()
                self.current_idx = (self.current_idx + 1) % self.buffer.max_chunks
                break

    @contextmanager
    def acquire_read(self) -> Iterator[memoryview]:
        while True:
            with self.buffer.get_metadata(self.current_idx) as metadata_buffer:
                read_flag = metadata_buffer[self.local_reader_rank + 1]
                written_flag = metadata_buffer[0]
                if not written_flag or read_flag:
                    os.sched_yield()  # vLLM's SpinTimer: sched_yield while recently active
                    continue
                with self.buffer.get_data(self.current_idx) as buf:
                    yield buf
                metadata_buffer[self.local_reader_rank + 1] = 1
                memory_fence()
                self.current_idx = (self.current_idx + 1) % self.buffer.max_chunks
                break

    def enqueue(self, obj: Any) -> None:
        all_buffers: list[Any] = [b""]
        total_bytes = 6  # 2 bytes for the oob buffer count, 4 for the main buffer's size

        def oob_callback(buf: pickle.PickleBuffer) -> bool:
            raw_buf = buf.raw()
            if len(raw_buf) < 1024 * 1024:
                return True  # in band: buffers under 1 MiB
            all_buffers.append(raw_buf)
            nonlocal total_bytes
            total_bytes += len(raw_buf) + 4
            return False

        all_buffers[0] = pickle.dumps(
            obj, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=oob_callback
        )
        if total_bytes + len(all_buffers[0]) >= self.buffer.max_chunk_bytes:
            raise RuntimeError("message larger than a chunk (vLLM's ZeroMQ path: not here)")
        with self.acquire_write() as buf:
            buf[0] = 0  # not overflow
            offset = 3
            buf[1:offset] = len(all_buffers).to_bytes(2, "big")
            for buffer in all_buffers:
                buf_len = len(buffer)
                buf_offset = offset + 4
                buf[offset:buf_offset] = buf_len.to_bytes(4, "big")
                buf[buf_offset : (offset := buf_offset + buf_len)] = buffer

    def dequeue(self) -> Any:
        with self.acquire_read() as buf:
            offset = 3
            buf_count = int.from_bytes(buf[1:offset], "big")
            all_buffers = []
            for _ in range(buf_count):
                buf_offset = offset + 4
                buf_len = int.from_bytes(buf[offset:buf_offset], "big")
                offset = buf_offset + buf_len
                all_buffers.append(buf[buf_offset:offset])
            obj = pickle.loads(all_buffers[0], buffers=all_buffers[1:])
            del all_buffers  # the slices must go before the chunk's view is released
        return obj


# ----------------------------------------------------------------------------- control

# Words of a consumer's control segment (int64).
C_CMD, C_DONE, C_KIND, C_STEPS, C_ACK, C_T0, C_N, C_SEED, C_OK, C_READY, C_CHURN = range(11)
C_LAT = 16  # latencies of the current block start here
MAX_STEPS = 4096
IDLE, RUN, CHECK, STOP = 0, 1, 2, 3


def _control(name: str | None = None) -> tuple[shared_memory.SharedMemory, np.ndarray]:
    size = (C_LAT + MAX_STEPS) * 8
    if name is None:
        shm = shared_memory.SharedMemory(create=True, size=size)
    else:
        with patch("multiprocessing.resource_tracker.register", lambda *a, **k: None):
            shm = shared_memory.SharedMemory(name=name)
    arr = np.ndarray((C_LAT + MAX_STEPS,), dtype=np.int64, buffer=shm.buf)
    if name is None:
        arr[:] = 0
    return shm, arr


def _inside(batch: pa.RecordBatch, sub: StepSubscriber, seq: int) -> bool:
    m = sub._maps[(seq - 1) % sub._slots]
    if m is None:
        return False
    lo, hi = m.address, m.address + m.size
    bufs = [b for c in batch.columns for b in c.buffers() if b is not None and b.size]
    return all(lo <= b.address and b.address + b.size <= hi for b in bufs)


def consumer_main(kind: str, ctl_name: str, transport: Any) -> None:
    """A consumer process: waits (sleeping) for a block command, then receives the block's
    steps through its transport, stamping each step's arrival."""
    shm, ctl = _control(ctl_name)
    if kind == "vllm":
        ring = ShmRingBuffer(*transport)
        mq = MessageQueue(ring, reader_rank=0)
        recv: Callable[[], Any] = mq.dequeue
    else:
        sub = StepSubscriber(transport, spin_s=0.05)

        def recv() -> Any:
            step = sub.next(timeout=60)
            if step is None:
                raise RuntimeError("the run ended early")
            return step if kind == "columnar" else step.output()

    ctl[C_READY] = 1
    last = 0
    while True:
        while ctl[C_CMD] == last:
            time.sleep(0.0002)
        cmd = int(ctl[C_CMD])
        last = cmd
        what = int(ctl[C_KIND])
        if what == STOP:
            break
        for i in range(int(ctl[C_STEPS])):
            got = recv()
            t1 = time.perf_counter_ns()
            if what == CHECK:
                ok = True
                n, seed = int(ctl[C_N]), int(ctl[C_SEED])
                expected = churn_steps(n)[seed] if ctl[C_CHURN] else decode_step(n, seed)
                if kind == "columnar":
                    ok = _inside(got.batch, sub, got.seq)
                    got = got.output()
                ok = ok and ao.first_difference(got, expected) is None
                if not ok:
                    ctl[C_OK] = -1
            else:
                ctl[C_LAT + i] = t1 - ctl[C_T0]
            del got
            ctl[C_ACK] = i + 1
        ctl[C_DONE] = cmd
    if kind != "vllm":
        sub.close()
    shm.close()


# ----------------------------------------------------------------------------- producer


class Consumer:
    def __init__(self, kind: str, transport: Any, ctx: Any) -> None:
        self.kind = kind
        self.shm, self.ctl = _control()
        self.proc = ctx.Process(target=consumer_main, args=(kind, self.shm.name, transport))
        self.proc.start()
        self.cmd = 0

    def wait_ready(self) -> None:
        while not self.ctl[C_READY]:
            if not self.proc.is_alive():
                raise RuntimeError(f"consumer {self.kind} died")
            time.sleep(0.001)

    def block(
        self,
        what: int,
        steps: int,
        send: Callable[[int], None],
        n: int = 0,
        seed: int = 0,
        churn: bool = False,
    ) -> np.ndarray:
        ctl = self.ctl
        ctl[C_CHURN] = churn
        ctl[C_KIND] = what
        ctl[C_STEPS] = steps
        ctl[C_ACK] = 0
        ctl[C_N] = n
        ctl[C_SEED] = seed
        self.cmd += 1
        ctl[C_CMD] = self.cmd
        for i in range(steps):
            ctl[C_T0] = time.perf_counter_ns()
            send(i)
            while ctl[C_ACK] != i + 1:
                os.sched_yield()
                if not self.proc.is_alive():
                    raise RuntimeError(f"consumer {self.kind} died")
        while ctl[C_DONE] != self.cmd:
            os.sched_yield()
        return ctl[C_LAT : C_LAT + steps].copy()

    def stop(self) -> None:
        self.ctl[C_KIND] = STOP
        self.cmd += 1
        self.ctl[C_CMD] = self.cmd
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
        del self.ctl
        self.shm.close()
        self.shm.unlink()


def _spread(xs: list[float]) -> float:
    q1, _, q3 = statistics.quantiles(xs, n=4)
    return 100 * (q3 - q1) / 2 / statistics.median(xs)


def environment() -> dict[str, Any]:
    return {
        "arrow_outputs": ao.__version__,
        "pyarrow": pa.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.machine()}",
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "load": os.getloadavg()[0],
    }


CONFIGS = ("vllm", "columnar", "objects", "columnar+enc", "objects+enc")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run (a few seconds)")
    ap.add_argument("--json", type=Path, help="write every figure to this file")
    ap.add_argument("--steps", type=int, default=40, help="steps per block")
    ap.add_argument("--rounds", type=int, default=0, help="rounds per size (default 12; 3)")
    args = ap.parse_args()
    rounds = args.rounds or (3 if args.quick else 12)
    steps = min(args.steps if not args.quick else 20, MAX_STEPS)
    env = environment()
    print(
        f"arrow_outputs {env['arrow_outputs']} | pyarrow {env['pyarrow']} | numpy "
        f"{env['numpy']} | Python {env['python']} | {env['os']}, {env['cpus']} cores "
        f"({env['cpus_usable']} usable), load {env['load']:.2f}"
    )
    print("latency per step: producer starts the handoff -> consumer process has it")
    print(f"microseconds, median of {rounds} rounds x {steps} steps, ±half-IQR; x: vLLM / ours")
    started = time.monotonic()
    ctx = multiprocessing.get_context("spawn")
    ring = ShmRingBuffer(1, 10 * 1024 * 1024, 10)  # vLLM's defaults: 10 chunks of 10 MiB
    mq = MessageQueue(ring)
    # One run per arrow consumer, so each timed pair is alone, as vLLM's is.
    pubs = {k: StepPublisher(slots=8, lag_timeout_s=30) for k in ("columnar", "objects")}
    consumers = {
        "vllm": Consumer("vllm", ring.handle(), ctx),
        "columnar": Consumer("columnar", str(pubs["columnar"].path), ctx),
        "objects": Consumer("objects", str(pubs["objects"].path), ctx),
    }
    results: dict[str, Any] = {"environment": env, "rounds": rounds, "steps": steps, "sizes": {}}
    try:
        for c in consumers.values():
            c.wait_ready()
        for pub in pubs.values():
            pub.wait_for_subscribers(1, timeout=60)
        schema = ao.run_schema(ao.to_record_batch(decode_step(1, 0), step=0))
        rows = []
        for n in SIZES:
            outs = [decode_step(n, seed) for seed in range(VARIANTS)]
            batches = [ao.to_record_batch(o, step=i, schema=schema) for i, o in enumerate(outs)]

            senders = _senders(mq, pubs, outs, batches, schema)
            row = _measure(consumers, senders, CONFIGS, n, rounds, steps)
            row["payload_bytes"] = {
                "pickle": len(pickle.dumps(outs[0], protocol=5)),
                "arrow_ipc": _ipc_size(batches[0]),
            }
            results["sizes"][str(n)] = row
            rows.append((n, row))
        _print(rows)
        churn: dict[str, Any] = {}
        for n in CHURN_SIZES:
            outs = churn_steps(n)
            if len(outs) != VARIANTS:  # the senders and the check cycle through VARIANTS
                raise RuntimeError(f"churn_steps gave {len(outs)} steps, not {VARIANTS}")
            batches = [ao.to_record_batch(o, step=i, schema=schema) for i, o in enumerate(outs)]
            senders = _senders(mq, pubs, outs, batches, schema)
            churn[str(n)] = _measure(
                consumers, senders, CHURN_CONFIGS, n, rounds, steps, churn=True, targets=False
            )
        results["churn"] = churn
        _print_churn(churn)
        cpu = cpu_per_step(SIZES, rounds)
        results["cpu_per_step"] = cpu
        _print_cpu(cpu)
    finally:
        for c in consumers.values():
            c.stop()
        for pub in pubs.values():
            pub.close(drain_timeout_s=0)
        ring.close()
    met = sum(
        1
        for _, row in rows
        for cfg in ("columnar", "objects")
        if row[cfg]["verdict"].startswith("PASS")
    )
    total = sum(1 for _, row in rows for cfg in ("columnar", "objects") if row[cfg]["target"])
    took = time.monotonic() - started
    print(f"\ntargets met: {met}/{total} | {took:.1f} s")
    results["targets_met"] = met
    results["targets"] = total
    results["seconds"] = took
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def _measure(
    consumers: dict[str, Consumer],
    senders: dict[str, tuple[str, Callable[[int], None]]],
    configs: tuple[str, ...],
    n: int,
    rounds: int,
    steps: int,
    *,
    churn: bool = False,
    targets: bool = True,
) -> dict[str, Any]:
    """One size's figures for ``configs`` (the first is vLLM's, the others' baseline): each
    variant checked by its consumer first (against ``decode_step(n, seed)``, or
    ``churn_steps(n)[seed]``), then ``rounds`` rounds of a block of ``steps`` steps per
    configuration in a random order."""
    for cfg in configs:
        kind, send = senders[cfg]
        for seed in range(VARIANTS):

            def check(_i: int, s: int = seed, f: Callable[[int], None] = send) -> None:
                f(s)

            consumers[kind].block(CHECK, 1, check, n, seed, churn)
    for kind, c in consumers.items():
        if c.ctl[C_OK] != 0:
            raise RuntimeError(f"{kind} consumer received a wrong step at n={n}")
    lat: dict[str, list[float]] = {k: [] for k in configs}
    per_round: dict[str, list[float]] = {k: [] for k in configs}
    rng = random.Random(n)
    for _ in range(rounds):
        order = list(configs)
        rng.shuffle(order)
        for cfg in order:
            kind, send = senders[cfg]
            got = consumers[kind].block(RUN, steps, send)
            lat[cfg].extend(got.tolist())
            per_round[cfg].append(float(np.median(got)))
    row: dict[str, Any] = {}
    for cfg in configs:
        row[cfg] = {
            "median_ns": statistics.median(lat[cfg]),
            "spread_pct": _spread(lat[cfg]),
            "samples": len(lat[cfg]),
        }
    for cfg in configs[1:]:
        ratios = [v / a for v, a in zip(per_round["vllm"], per_round[cfg])]
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (0, 0, 0)
        ratio = row["vllm"]["median_ns"] / row[cfg]["median_ns"]
        target = TARGETS[cfg].get(n) if targets and cfg in TARGETS else None
        verdict = "-"
        if target is not None:
            verdict = "PASS" if ratio >= target else "MISS"
            if q1 <= target <= q3:
                verdict += "?"
        row[cfg].update(ratio=ratio, ratio_q1=q1, ratio_q3=q3, target=target, verdict=verdict)
    return row


def _senders(
    mq: MessageQueue,
    pubs: dict[str, StepPublisher],
    outs: list[Any],
    batches: list[pa.RecordBatch],
    schema: pa.Schema,
) -> dict[str, tuple[str, Callable[[int], None]]]:
    """Per configuration: (consumer, the producer's handoff of step i)."""
    step_no = [0]

    def send_vllm(i: int) -> None:
        mq.enqueue(outs[i % VARIANTS])  # the ModelRunnerOutput, pickled in enqueue

    def send_batch(pub: StepPublisher) -> Callable[[int], None]:
        def send(i: int) -> None:
            pub.publish(batches[i % VARIANTS])  # step custom metadata taken in publish

        return send

    def send_output(pub: StepPublisher) -> Callable[[int], None]:
        def send(i: int) -> None:
            step_no[0] += 1
            out = outs[i % VARIANTS]
            pub.publish(ao.to_record_batch(out, step=step_no[0], schema=schema))

        return send

    return {
        "vllm": ("vllm", send_vllm),
        "columnar": ("columnar", send_batch(pubs["columnar"])),
        "objects": ("objects", send_batch(pubs["objects"])),
        "columnar+enc": ("columnar", send_output(pubs["columnar"])),
        "objects+enc": ("objects", send_output(pubs["objects"])),
    }


def cpu_per_step(sizes: tuple[int, ...], rounds: int) -> dict[str, Any]:
    """The same handoffs with producer and consumer in one process, one after the other:
    the CPU work of a step on both sides, without waiting or waking up. Samples of 20
    steps, the configurations interleaved in a random order per round."""
    ring = ShmRingBuffer(1, 10 * 1024 * 1024, 10)
    w, r = MessageQueue(ring), MessageQueue(ring, reader_rank=0)
    pub = StepPublisher(slots=8)
    sub = StepSubscriber(pub.path)
    schema = ao.run_schema(ao.to_record_batch(decode_step(1, 0), step=0))
    out: dict[str, Any] = {}
    try:
        for n in sizes:
            outs = [decode_step(n, seed) for seed in range(VARIANTS)]
            batches = [ao.to_record_batch(o, step=i, schema=schema) for i, o in enumerate(outs)]

            def vllm(i: int, outs: list[Any] = outs) -> None:
                w.enqueue(outs[i % VARIANTS])
                r.dequeue()

            def columnar(i: int, batches: list[Any] = batches) -> None:
                pub.publish(batches[i % VARIANTS])
                sub.next()

            def objects(i: int, batches: list[Any] = batches) -> None:
                pub.publish(batches[i % VARIANTS])
                step = sub.next()
                assert step is not None
                step.output()

            figs: dict[str, Callable[[int], None]] = {
                "vllm": vllm,
                "columnar": columnar,
                "objects": objects,
            }
            for f in figs.values():
                for i in range(VARIANTS):
                    f(i)
            samples: dict[str, list[float]] = {k: [] for k in figs}
            rng = random.Random(n)
            for _ in range(rounds * 3):
                order = list(figs)
                rng.shuffle(order)
                for k in order:
                    t0 = time.perf_counter_ns()
                    for i in range(20):
                        figs[k](i)
                    samples[k].append((time.perf_counter_ns() - t0) / 20)
            out[str(n)] = {
                k: {"median_ns": statistics.median(v), "spread_pct": _spread(v)}
                for k, v in samples.items()
            }
    finally:
        sub.close()
        pub.close(drain_timeout_s=0)
        ring.close()
    return out


def _print_cpu(cpu: dict[str, Any]) -> None:
    print("\nCPU per step, producer and consumer in one process (no waiting), microseconds:")
    head = f"{'n':>5} | {'vLLM':>13} {'columnar':>13} {'objects':>13} | {'x col':>6} {'x obj':>6}"
    print(head)
    print("-" * len(head))
    for n, row in cpu.items():
        v, c, o = row["vllm"], row["columnar"], row["objects"]

        def t(x: dict[str, Any]) -> str:
            return f"{x['median_ns'] / 1e3:8.1f} ±{x['spread_pct']:.0f}%"

        print(
            f"{n:>5} | {t(v):>13} {t(c):>13} {t(o):>13} | "
            f"{v['median_ns'] / c['median_ns']:5.2f}x {v['median_ns'] / o['median_ns']:5.2f}x"
        )


def _ipc_size(batch: pa.RecordBatch) -> int:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, ao.run_schema(batch)) as w:
        w.write_batch(batch, custom_metadata=ao.step_custom_metadata(batch))
    return sink.getvalue().size


def _print(rows: list[tuple[int, dict[str, Any]]]) -> None:
    head = (
        f"{'n':>5} | {'vLLM':>13} {'columnar':>13} {'objects':>13} | "
        f"{'x columnar':>17} {'x objects':>17} | {'+enc col':>13} {'+enc obj':>13} "
        f"{'x':>6} {'x':>6}"
    )
    print()
    print(head)
    print("-" * len(head))

    def t(c: dict[str, Any]) -> str:
        return f"{c['median_ns'] / 1e3:8.1f} ±{c['spread_pct']:.0f}%"

    def r(c: dict[str, Any]) -> str:
        tgt = f">={c['target']:g}x " if c["target"] else ""
        return f"{c['ratio']:5.2f}x {tgt}{c['verdict']}"

    for n, row in rows:
        print(
            f"{n:>5} | {t(row['vllm']):>13} {t(row['columnar']):>13} {t(row['objects']):>13} | "
            f"{r(row['columnar']):>17} {r(row['objects']):>17} | "
            f"{t(row['columnar+enc']):>13} {t(row['objects+enc']):>13} "
            f"{row['columnar+enc']['ratio']:5.2f}x {row['objects+enc']['ratio']:5.2f}x"
        )
    print("\npayload bytes per step (pickle in band | Arrow IPC message):")
    for n, row in rows:
        p = row["payload_bytes"]
        print(f"{n:>5} | {p['pickle']:>9} | {p['arrow_ipc']:>9}")


def _print_churn(churn: dict[str, Any]) -> None:
    print(
        f"\nchurn lp20: 1 row in {CHURN_EVERY} gets a new request each step (for information, "
        "no target):"
    )
    for n, row in churn.items():
        v, o = row["vllm"], row["objects"]
        print(
            f"{n:>5} | vLLM {v['median_ns'] / 1e3:8.1f} ±{v['spread_pct']:.0f}% | objects "
            f"{o['median_ns'] / 1e3:8.1f} ±{o['spread_pct']:.0f}% | x objects {o['ratio']:5.2f}x"
        )


if __name__ == "__main__":
    sys.exit(main())
