"""The record-batch codec (C and pure-Python paths) against vLLM's pickle-5 handoff, one run.

vLLM moves ``ModelRunnerOutput`` between processes with pickle protocol 5 and out-of-band
buffers (``pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)`` in the sender,
``pickle.loads(data, buffers=buffers)`` in the receiver). This script times, per workload
and for each path of the codec (the compiled accelerator, "C": the walks over Python
objects in C and each batch assembled in one Arrow C Data Interface import; and the
pure-Python fallback; switched at run time with ``arrow_outputs._accel.set_pure_python``):

* encode: ``arrow_outputs.to_record_batch(out, step=i, schema=run_schema)`` (the run's
  schema fixed by its first batch) against ``pickle.dumps`` as above;
* decode back to objects: ``arrow_outputs.from_record_batch(batch, custom_metadata=custom)``
  (``validate=True``, the default, and ``validate=False`` as an extra column) against
  ``pickle.loads``, of each batch as a receiving process holds it: read back from an Arrow
  IPC stream with its step custom metadata (the read, a zero-copy view of the message's
  buffers, is done before timing). The batch object ``to_record_batch`` returned decodes
  faster still in its own process (its format, types and step JSON are known by identity),
  which is not what a scheduler in another process gets.

* the pyarrow floor ("floor", with the C module): the part of each side that no codec on
  pyarrow can avoid for this step, timed in the same rounds. Encode: the step's finished
  buffers (nodes of the batch the encoder made, built outside the timing) made into a
  ``RecordBatch`` with the step metadata and the all-null columns of absent fields (the
  same every step of a size) as they are, the cheapest way this install has
  (``_arrowbridge.assemble``, else one C Data Interface import plus ``add_column``), and the
  batch released; decode: full validation (untrusted batches must be validated), the
  cheapest way this install has (``_arrowbridge.proven_valid``, else
  ``validate(full=True)``), and the batch's buffers handed over once as the C walk reads
  them (``_arrowbridge``'s view where it is built, else pyarrow's export).
  ``pickle / floor`` is the best ratio any
  encoder or decoder that makes or reads this batch could reach on this machine: a target
  above it cannot be met by more work on the codec.

Neither side's bytes are copied into shared memory here (vLLM's ring buffer copy, an IPC
write for Arrow): both are left out alike, so the ratios compare the codecs themselves.

Method. Every figure of a workload (each path's encode, decode and no-validate decode,
and pickle's encode and decode) is sampled in rounds: one round times one sample of each
figure in a fresh random order, a sample being enough back-to-back calls to last
``Settings.sample_ns`` (the garbage collector paused, as ``timeit`` does). Interleaving the
figures this way makes a slow spell of a shared machine fall on all of them alike, and
pairs the samples: the ratio's spread is that of the per-round ratios pickle/arrow. Rounds
go on until every figure has had its minimum samples and time and the running median of
each has settled (the last ``stable_checks`` medians, taken every ``check_every`` rounds,
within ``stable_tol``: 2%), or until the workload's time budget is spent; a figure whose
median did not settle is marked ``*``. See ``FULL`` and ``QUICK`` for the settings.

Each figure is reported as its median and its spread: half the interquartile range as a
percentage of the median (``127.7 ±4%``: the middle half of the samples lies within about
4% of the median). Ratios are pickle time / arrow time (medians): above 1 means arrow is
faster. Timed calls cycle through a few distinct steps of each workload (other request
ids, tokens and logprobs), so no cache keyed on one step's contents can flatter a side.
One workload, ``steady lp20`` (256 and 1024 requests, no target), shows the other case, the
common one in a real run: decode steps that keep their requests, whose request ids both
codecs reuse from the step before (the encoder's req_id column, the decoder's strs and dict;
each still checked against the step's own data). Another, ``churn lp20`` (256 and 1024
requests, no target), lies between: 1 row in 64 gets a new request each step, and the
decoder reuses the strs of the rows whose id is unchanged.

Usage::

    python benchmarks/bench_encode.py [--quick] [--json PATH] [--path {both,c,python}]

No assertion depends on timing; the targets are printed with PASS/MISS next to the ratios.
Before anything is timed, every step of every workload is encoded by each measured path,
decoded by each (validated and not, in memory and after an IPC round trip) and compared
with its input (``arrow_outputs.first_difference``, strict), and the batches the paths
make are compared with each other, so a broken path cannot be measured.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import itertools
import json
import math
import os
import pickle
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pyarrow as pa

import arrow_outputs as ao
from arrow_outputs import LogprobsLists, ModelRunnerOutput, SamplingMaskLists

VOCAB = 128_256  # Llama 3's vocabulary: token ids need more than 16 bits
NUM_LOGPROBS = 20  # width 21: the sampled token plus the top 20
DECODE_SIZES = (1, 64, 256, 1024)
# Every workload at every size: the targets' ends (1 and 1024) and where the fixed cost per
# step stops dominating (64, 256).
SPEC_SIZES = DECODE_SIZES
MASK_SIZES = DECODE_SIZES
MASK_MEAN_IDS = 50
# Timed calls cycle through this many distinct steps of a workload, so a cache keyed on a
# step's contents (its req_ids, say) cannot make every call after the first a hit.
VARIANTS = 4

# "steady": decode steps that keep their requests (most of a real run); no target, since
# every other workload changes its request ids every step.
STEADY = "steady lp20"
STEADY_SIZES = (256, 1024)
# "churn": decode steps in which 1 row in CHURN_EVERY gets a new request (requests finishing
# and joining in their rows, as in vLLM's persistent batch); no target either.
CHURN = "churn lp20"
CHURN_SIZES = (256, 1024)
CHURN_EVERY = 64

# Targets (docs: design brief). Encode: by number of requests; decode: at every size.
ENCODE_TARGETS = {1: 1.0, 1024: 2.0}
DECODE_TARGET = 1.0

PATHS = ("c", "python")
PATH_LABELS = {"c": "C", "python": "python", "pickle": "pickle"}
ACCEL_MODULE = "arrow_outputs._accel"


@dataclass(frozen=True)
class Settings:
    """How long to sample. Full runs take about a minute or two; ``--quick`` a few seconds."""

    sample_ns: int  # one sample runs enough calls to last at least this long
    min_rounds: int  # at least this many samples of every figure
    min_s: float  # at least this much sampling time per figure
    budget_s: float  # at most about this much per figure (the workload's budget / figures)
    check_every: int = 10  # rounds between two medians of the stability check
    stable_checks: int = 3  # this many consecutive medians ...
    stable_tol: float = 0.02  # ... within 2% of each other: the median has settled


FULL = Settings(sample_ns=500_000, min_rounds=30, min_s=0.5, budget_s=2.5)
QUICK = Settings(sample_ns=200_000, min_rounds=8, min_s=0.0, budget_s=0.08, check_every=4)


# ----------------------------------------------------------------------------- workloads


@dataclass
class Workload:
    """One kind of step at one size, as ``VARIANTS`` distinct steps (other ids and values)."""

    name: str
    n: int
    outputs: list[ModelRunnerOutput]


def _req_ids(n: int, rng: random.Random) -> list[str]:
    # vLLM's completion request ids: "cmpl-" + uuid4().hex + "-" + index in the prompt batch.
    return [f"cmpl-{rng.getrandbits(128):032x}-0" for _ in range(n)]


def _logprobs(sampled_flat: np.ndarray, ranks_hi: int, rng: np.random.Generator) -> tuple:
    """[P, 21] int64 ids (sampled token first), float32 logprobs, int64 ranks."""
    p = len(sampled_flat)
    width = NUM_LOGPROBS + 1
    ids = rng.integers(0, VOCAB, size=(p, width), dtype=np.int64)
    ids[:, 0] = sampled_flat
    lps = -np.sort(rng.exponential(2.0, size=(p, width)), axis=1).astype(np.float32)
    ranks = rng.integers(1, ranks_hi, size=p, dtype=np.int64)
    return ids, lps, ranks


def decode_step(n: int, seed: int = 0) -> ModelRunnerOutput:
    """A plain decode step: one sampled token per request, 20 logprobs, cu None."""
    rng = np.random.default_rng(seed)
    req_ids = _req_ids(n, random.Random(seed))
    sampled_np = rng.integers(0, VOCAB, size=(n, 1), dtype=np.int64)
    ids, lps, ranks = _logprobs(sampled_np[:, 0], 8, rng)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled_np.tolist(),  # Python list of lists, as vLLM hands it over
        logprobs=LogprobsLists(ids, lps, ranks, None),
    )


def spec_step(n: int, seed: int = 0) -> ModelRunnerOutput:
    """Speculative decoding: 1..4 accepted tokens per request, one logprob row each."""
    rng = np.random.default_rng(seed)
    req_ids = _req_ids(n, random.Random(seed))
    accepted = rng.integers(1, 5, size=n)
    flat = rng.integers(0, VOCAB, size=int(accepted.sum()), dtype=np.int64)
    cu = [0, *np.cumsum(accepted).tolist()]
    sampled = [flat[a:b].tolist() for a, b in itertools.pairwise(cu)]
    ids, lps, ranks = _logprobs(flat, 8, rng)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=LogprobsLists(ids, lps, ranks, cu),
    )


def mask_step(n: int, seed: int = 0) -> ModelRunnerOutput:
    """One position per request with a CSR sampling mask of ~50 ascending int32 ids."""
    rng = np.random.default_rng(seed)
    req_ids = _req_ids(n, random.Random(seed))
    rows = [
        np.unique(rng.integers(0, VOCAB, size=int(k))).astype(np.int32)
        for k in rng.integers(MASK_MEAN_IDS - 20, MASK_MEAN_IDS + 21, size=n)
    ]
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    # The sampled token is one the mask allowed.
    sampled = [[int(r[rng.integers(len(r))])] for r in rows]
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        sampling_masks=SamplingMaskLists(np.concatenate(rows), offsets, None),
    )


def steady_steps(n: int) -> list[ModelRunnerOutput]:
    """Consecutive decode steps of one batch of requests, as vLLM makes them while no request
    joins or leaves: new tokens and logprobs every step, the same request ids (the same str
    objects, in a new list and dict per step)."""
    steps = [decode_step(n, seed) for seed in range(VARIANTS)]
    ids = steps[0].req_ids
    for out in steps[1:]:
        out.req_ids = list(ids)
        out.req_id_to_index = {r: i for i, r in enumerate(ids)}
    return steps


def churn_steps(n: int) -> list[ModelRunnerOutput]:
    """Consecutive decode steps of one batch in which 1 row in ``CHURN_EVERY`` gets another
    request each step while the rest keep theirs in their rows. The rows ``p`` with
    ``p % (2 * CHURN_EVERY) == j`` (j < VARIANTS) switch between two requests at steps j and
    j + VARIANTS / 2, so every step of the cycle, the wrap back to the first included,
    changes the same number of rows; a request that comes back is one the step before did
    not have (the codecs keep one step), so it is new to them."""
    steps = [decode_step(n, seed) for seed in range(VARIANTS)]
    base = steps[0].req_ids
    alt = _req_ids(n, random.Random(-n))
    half = VARIANTS // 2
    for t, out in enumerate(steps):
        ids = [
            alt[p]
            if p % (2 * CHURN_EVERY) < VARIANTS and (t - p % (2 * CHURN_EVERY)) % VARIANTS >= half
            else base[p]
            for p in range(n)
        ]
        out.req_ids = ids
        out.req_id_to_index = {r: i for i, r in enumerate(ids)}
    return steps


def _workload(name: str, n: int, make: Callable[[int, int], ModelRunnerOutput]) -> Workload:
    return Workload(name, n, [make(n, seed) for seed in range(VARIANTS)])


def workloads() -> list[Workload]:
    return [
        *(_workload("decode lp20", n, decode_step) for n in DECODE_SIZES),
        *(_workload("spec k<=4 lp20", n, spec_step) for n in SPEC_SIZES),
        *(_workload(f"mask ~{MASK_MEAN_IDS} ids", n, mask_step) for n in MASK_SIZES),
        # For information (no target): what run-level reuse of request ids gives.
        *(Workload(STEADY, n, steady_steps(n)) for n in STEADY_SIZES),
        *(Workload(CHURN, n, churn_steps(n)) for n in CHURN_SIZES),
    ]


# ----------------------------------------------------------------------------- paths


class PathError(RuntimeError):
    """A codec path cannot be selected, or the selector did not do what it was asked."""


@dataclass
class Accel:
    """The codec's path selector, ``arrow_outputs._accel``, or its absence.

    Without the module only the pure-Python path exists: nothing is switched then.
    """

    module: ModuleType | None
    c_available: bool
    note: str  # why the C path is unavailable ("" when it is available)

    @classmethod
    def detect(cls) -> Accel:
        if importlib.util.find_spec(ACCEL_MODULE) is None:
            return cls(None, False, f"no {ACCEL_MODULE} module yet: pure Python only")
        # A selector that exists but fails to import is a broken codec: let the error out.
        module = importlib.import_module(ACCEL_MODULE)
        missing = [
            a for a in ("AVAILABLE", "set_pure_python", "accelerated") if not hasattr(module, a)
        ]
        if missing:
            raise PathError(f"{ACCEL_MODULE} lacks {', '.join(missing)}: cannot select a path")
        if not module.AVAILABLE:
            return cls(module, False, f"{ACCEL_MODULE}.AVAILABLE is False (no C extension)")
        return cls(module, True, "")

    def available(self, path: str) -> bool:
        return path == "python" or self.c_available

    def use(self, path: str) -> None:
        """Switch the codec to ``path`` and check that the switch took."""
        if self.module is None:
            if path != "python":
                raise PathError(f"the {path} path does not exist: {self.note}")
            return
        self.module.set_pure_python(path == "python")
        if bool(self.module.accelerated()) != (path == "c"):
            raise PathError(
                f"{ACCEL_MODULE}.set_pure_python({path == 'python'}) left accelerated() = "
                f"{self.module.accelerated()}: the figures would be labelled wrongly"
            )

    @contextmanager
    def restored(self) -> Iterator[None]:
        """Put the codec back on the path it was on, whatever was switched inside."""
        if self.module is None:
            yield
            return
        was_c = bool(self.module.accelerated())
        try:
            yield
        finally:
            self.module.set_pure_python(not was_c)


# ----------------------------------------------------------------------------- codecs


def pickle_encode(out: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(out, protocol=5, buffer_callback=buffers.append)
    return data, buffers


def pickle_decode(data: bytes, buffers: list[pickle.PickleBuffer]) -> Any:
    return pickle.loads(data, buffers=buffers)


def floor_figures(batches: list[pa.RecordBatch], fresh: FreshBatches) -> list[Figure]:
    """The pyarrow floor of each side (see the module docstring), or none without the C
    module (its ``build_array`` and ``array_slot`` are the cheapest ways in and out).

    Encode: each batch taken apart as the cheapest assembly takes it (``pyarrow_floor``,
    untimed: nodes over the buffers of the columns that hold data, and the all-null columns
    of absent fields); the timed call makes the batch with its step metadata, as the C
    path's encoder ends (``pyarrow_floor.assemble``), and drops it. Decode: full validation
    as the C path's decoder runs it (the bridge's proof, else pyarrow's) and the hand-over
    of a received batch's buffers (``pyarrow_floor.hand_over``: the view, or pyarrow's
    export where the view is not loaded), a new batch object every call (``fresh``), as our
    decode gets.
    """
    try:  # it needs the C module
        floor = importlib.import_module("pyarrow_floor")  # a sibling script, not a package
    except ImportError:
        return []
    ready = []
    for b in batches:
        split = floor.split_for_floor(b)
        if split is None:  # not expressible as one tree: no floor for this workload
            return []
        ready.append(split)

    def encode_floor(*split: Any) -> pa.RecordBatch:
        return floor.assemble(*split, validate=False)

    bridge = getattr(importlib.import_module(ACCEL_MODULE), "_bridge", None)

    def decode_floor(batch: pa.RecordBatch) -> Any:
        if bridge is None or not bridge.proven_valid(batch):
            batch.validate(full=True)
        return floor.hand_over(batch)  # released (with its tree) when dropped

    for split, b in zip(ready, batches):  # the floor makes the very batch it times
        if not encode_floor(*split).equals(b):
            raise RoundTripError("the encode floor's import differs from the encoder's batch")
    nxt_ready = itertools.cycle(ready).__next__
    return [
        Figure("encode", "floor", lambda: encode_floor(*nxt_ready())),
        Figure("decode", "floor", lambda: decode_floor(fresh.next()[0]), fresh.prepare),
    ]


def ipc_round_trip(batch: pa.RecordBatch) -> tuple[pa.RecordBatch, Any]:
    """The batch through an IPC stream, read back with its step metadata (custom metadata)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, ao.run_schema(batch)) as writer:
        writer.write_batch(batch, custom_metadata=ao.step_custom_metadata(batch))
    return pa.ipc.open_stream(sink.getvalue()).read_next_batch_with_custom_metadata()


class RoundTripError(RuntimeError):
    """A codec did not give back what it was given: its timings would mean nothing."""


class FreshBatches:
    """Received batches, a new batch object for every timed call, as a receiving process
    decodes each batch it reads once: pyarrow keeps per batch object what it builds on first
    use (the columns' array objects, which validation and export build), so cycling a few
    batch objects would let every call after the first find them made.

    ``prepare(k)`` (untimed) reads ``k`` batches from the steps' IPC messages
    (``pyarrow.ipc.read_record_batch`` over the message, zero-copy, with one schema object
    for all, as one stream reader or a ``StepSubscriber`` has it); ``next()`` hands them out
    in turn, each with its step's custom metadata. They are kept until the next
    ``prepare``, so that freeing them is not timed (pickle's input is not freed either).
    The timing loop reads them ``FRESH_CHUNK`` at a time, just before their calls, as a
    receiver decodes a batch it has just read.
    """

    def __init__(self, received: list[tuple[pa.RecordBatch, Any]]) -> None:
        self.schema = received[0][0].schema
        self.messages = []
        for batch, custom in received:
            message = pa.ipc.read_message(batch.serialize())
            if not pa.ipc.read_record_batch(message, self.schema).equals(batch):
                raise RoundTripError("a batch read from its IPC message differs from it")
            self.messages.append((message, custom))
        self.at = 0
        self.ready: list[tuple[pa.RecordBatch, Any]] = []
        self.handed = iter(self.ready)

    def prepare(self, k: int) -> None:
        messages, read = self.messages, pa.ipc.read_record_batch
        self.ready.clear()
        for _ in range(k):
            message, custom = messages[self.at % len(messages)]
            self.at += 1
            self.ready.append((read(message, self.schema), custom))
        self.handed = iter(self.ready)

    def next(self) -> tuple[pa.RecordBatch, Any]:
        return next(self.handed)


def check_round_trip(w: Workload, src: Any, back: Any, codec: str) -> None:
    """``back`` must equal ``src`` (strict: values, kinds and dtypes)."""
    diff = ao.first_difference(src, back)
    if diff is not None:
        raise RoundTripError(f"{codec} round trip of {w.name} n={w.n}: {diff}")


def check_workload(
    w: Workload, schema: pa.Schema, accel: Accel, paths: list[str]
) -> list[pa.RecordBatch]:
    """Every step through every measured path, both ways; the (pure-Python) batches."""
    made: dict[str, list[pa.RecordBatch]] = {}
    for enc in paths:
        accel.use(enc)
        made[enc] = [
            ao.to_record_batch(o, step=i + 1, schema=schema) for i, o in enumerate(w.outputs)
        ]
    for enc, batches in made.items():
        for i, (src, batch) in enumerate(zip(w.outputs, batches)):
            if not batch.equals(made[paths[0]][i]):
                raise RoundTripError(
                    f"{w.name} n={w.n} step {i}: the {enc} path's batch differs from the "
                    f"{paths[0]} path's"
                )
            read, custom = ipc_round_trip(batch)
            for dec in paths:
                accel.use(dec)
                codec = f"arrow ({enc} encode, {dec} decode"
                check_round_trip(w, src, ao.from_record_batch(batch), codec + ")")
                back = ao.from_record_batch(batch, validate=False)
                check_round_trip(w, src, back, codec + ", no validate)")
                back = ao.from_record_batch(read, custom_metadata=custom)
                check_round_trip(w, src, back, codec + ", after IPC)")
    for src in w.outputs:
        check_round_trip(w, src, pickle_decode(*pickle_encode(src)), "pickle")
    return made.get("python", made[paths[0]])


# ----------------------------------------------------------------------------- timing


@dataclass
class Figure:
    """One timed quantity: an operation (encode, decode, ...) on one path."""

    op: str  # "encode", "decode", "decode_novalidate"
    path: str  # "c", "python", "pickle" or "floor"
    fn: Callable[[], Any]
    # Untimed, before each sample: makes the inputs of that many calls (FreshBatches).
    prepare: Callable[[int], None] | None = None
    number: int = 1  # calls per sample
    per_call: list[float] = field(default_factory=list)  # ns, one entry per round
    medians: list[float] = field(default_factory=list)  # running median at each check
    spent_ns: int = 0

    def stable(self, s: Settings) -> bool:
        last = self.medians[-s.stable_checks :]
        return len(last) == s.stable_checks and max(last) <= min(last) * (1 + s.stable_tol)


# Decode calls are timed in runs of this many batches, each run read (untimed) just before
# it: a receiving process decodes a batch right after reading it, while its objects are in
# the CPU's caches, as pickle.loads finds its (cycled) input; batches read a whole sample
# ahead (hundreds) would have left the caches by their turn.
FRESH_CHUNK = 8


def _time_calls(
    fn: Callable[[], Any], number: int, prepare: Callable[[int], None] | None = None
) -> int:
    clock = time.perf_counter_ns
    if prepare is not None:
        took = 0
        for start in range(0, number, FRESH_CHUNK):
            k = min(FRESH_CHUNK, number - start)
            prepare(k)
            t0 = clock()
            for _ in range(k):
                fn()
            took += clock() - t0
        return took
    t0 = clock()
    for _ in range(number):
        fn()
    return clock() - t0


def sample_rounds(figures: list[Figure], accel: Accel, s: Settings) -> int:
    """Interleaved samples of ``figures`` until their medians settle or the budget is out.

    Returns the number of rounds.
    """
    for f in figures:  # warm up: caches, lazy imports, lru_caches keyed by size
        if f.path in PATHS:
            accel.use(f.path)
        if f.prepare is not None:
            f.prepare(3)
        for _ in range(3):
            f.fn()
        once = min(_time_calls(f.fn, 1, f.prepare) for _ in range(3))
        f.number = max(1, math.ceil(s.sample_ns / max(once, 1)))
    # A new order every round: a figure that always ran first after the checkpoint work
    # below, or right after a path switch, would pay for it alone (cold caches) and look
    # noisier than its twin. Seeded, so runs are comparable.
    order, shuffle = list(figures), random.Random(0).shuffle
    budget_ns = s.budget_s * 1e9 * len(figures)
    min_ns = s.min_s * 1e9
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()  # as timeit does: a collection falls on one side or the other at random
    rounds = 0
    try:
        while True:
            shuffle(order)
            for f in order:
                if f.path in PATHS:  # switched outside timing
                    accel.use(f.path)
                took = _time_calls(f.fn, f.number, f.prepare)
                f.per_call.append(took / f.number)
                f.spent_ns += took
            rounds += 1
            if rounds % s.check_every:
                continue
            gc.collect()  # outside timing: what refcounting missed does not pile up
            for f in figures:
                f.medians.append(statistics.median(f.per_call))
            if sum(f.spent_ns for f in figures) >= budget_ns:
                break
            if rounds >= s.min_rounds and all(
                f.spent_ns >= min_ns and f.stable(s) for f in figures
            ):
                break
    finally:
        if was_enabled:
            gc.enable()
    return rounds


@dataclass
class Stats:
    """A figure's samples, summarised: ns per call."""

    median_ns: float
    q1_ns: float
    q3_ns: float
    min_ns: float
    max_ns: float
    samples: int
    calls_per_sample: int
    stable: bool

    @classmethod
    def of(cls, f: Figure, s: Settings) -> Stats:
        q1, q2, q3 = _quartiles(f.per_call)
        return cls(
            q2, q1, q3, min(f.per_call), max(f.per_call), len(f.per_call), f.number, f.stable(s)
        )

    @property
    def spread_pct(self) -> float:
        """Half the interquartile range, as a percentage of the median."""
        return 50.0 * (self.q3_ns - self.q1_ns) / self.median_ns

    def json(self) -> dict[str, Any]:
        return {
            "median_ns": self.median_ns,
            "q1_ns": self.q1_ns,
            "q3_ns": self.q3_ns,
            "min_ns": self.min_ns,
            "max_ns": self.max_ns,
            "spread_pct": self.spread_pct,
            "samples": self.samples,
            "calls_per_sample": self.calls_per_sample,
            "median_settled": self.stable,
        }


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


@dataclass
class Ratio:
    """pickle / arrow: the ratio of the medians; its spread from the per-round ratios."""

    value: float
    q1: float  # quartiles of the per-round (paired) ratios
    median_paired: float
    q3: float
    target: float | None

    @classmethod
    def of(cls, arrow: Figure, pickle_f: Figure, target: float | None) -> Ratio:
        paired = [p / a for p, a in zip(pickle_f.per_call, arrow.per_call)]
        q1, q2, q3 = _quartiles(paired)
        value = statistics.median(pickle_f.per_call) / statistics.median(arrow.per_call)
        return cls(value, q1, q2, q3, target)

    @property
    def spread_pct(self) -> float:
        return 50.0 * (self.q3 - self.q1) / self.median_paired

    @property
    def passed(self) -> bool | None:
        return None if self.target is None else self.value >= self.target

    @property
    def verdict(self) -> str:
        """PASS or MISS; with '?' when the target lies inside the ratio's middle half."""
        if self.target is None:
            return "-"
        word = "PASS" if self.passed else "MISS"
        return word + ("?" if self.q1 < self.target < self.q3 else "")

    def json(self) -> dict[str, Any]:
        return {
            "ratio": self.value,
            "paired_q1": self.q1,
            "paired_median": self.median_paired,
            "paired_q3": self.q3,
            "spread_pct": self.spread_pct,
            "target": self.target,
            "pass": self.passed,
            "verdict": self.verdict,
        }


# ----------------------------------------------------------------------------- run

OPS = ("encode", "decode", "decode_novalidate")
FLOOR_OPS = ("encode", "decode")
PICKLE_OF = {"encode": "encode", "decode": "decode", "decode_novalidate": "decode"}


@dataclass
class Row:
    workload: str
    n: int
    stats: dict[tuple[str, str], Stats]  # (op, path) -> stats; pickle under its own ops
    ratios: dict[tuple[str, str], Ratio]  # (op, path) -> pickle / arrow (or / the floor)
    rounds: int
    seconds: float
    pickle_bytes: int
    pickle_oob_bytes: int
    arrow_bytes: int


def _target(op: str, n: int, workload: str = "") -> float | None:
    if workload in (STEADY, CHURN):
        return None
    if op == "encode":
        return ENCODE_TARGETS.get(n)
    return DECODE_TARGET if op == "decode" else None


def run_workload(w: Workload, accel: Accel, paths: list[str], s: Settings) -> Row:
    started = time.perf_counter()
    outs = w.outputs
    # The run's schema is fixed by its first step; later steps pass it (same object).
    accel.use(paths[-1])
    schema = ao.run_schema(ao.to_record_batch(outs[0], step=0))
    # Both decoders read the same batches: the pure-Python encoder's (the specification), as
    # a receiving process holds them (read from IPC, with their step custom metadata).
    batches = check_workload(w, schema, accel, paths)
    received = [ipc_round_trip(b) for b in batches]
    pickles = [pickle_encode(o) for o in outs]
    steps = itertools.count(len(outs) + 1)

    def cycle(xs: list[Any]) -> Callable[[], Any]:
        return itertools.cycle(xs).__next__  # each figure its own cycle: all variants alike

    figures = []
    for path in paths:
        nxt_out, fresh, fresh2 = cycle(outs), FreshBatches(received), FreshBatches(received)
        figures += [
            Figure(
                "encode",
                path,
                lambda nxt=nxt_out: ao.to_record_batch(nxt(), step=next(steps), schema=schema),
            ),
            Figure(
                "decode",
                path,
                lambda nxt=fresh.next: ao.from_record_batch(
                    (got := nxt())[0], custom_metadata=got[1]
                ),
                fresh.prepare,
            ),
            Figure(
                "decode_novalidate",
                path,
                lambda nxt=fresh2.next: ao.from_record_batch(
                    (got := nxt())[0], custom_metadata=got[1], validate=False
                ),
                fresh2.prepare,
            ),
        ]
    nxt_out, nxt_pickle = cycle(outs), cycle(pickles)
    figures += [
        Figure("encode", "pickle", lambda: pickle_encode(nxt_out())),
        Figure("decode", "pickle", lambda: pickle_decode(*nxt_pickle())),
    ]
    figures += floor_figures(batches, FreshBatches(received))
    with accel.restored():
        rounds = sample_rounds(figures, accel, s)
    by_key = {(f.op, f.path): f for f in figures}
    return Row(
        workload=w.name,
        n=w.n,
        stats={key: Stats.of(f, s) for key, f in by_key.items()},
        ratios={
            (op, path): Ratio.of(
                by_key[op, path], by_key[PICKLE_OF[op], "pickle"], _target(op, w.n, w.name)
            )
            for op in OPS
            for path in paths
        }
        | {
            (op, "floor"): Ratio.of(
                by_key[op, "floor"], by_key[op, "pickle"], _target(op, w.n, w.name)
            )
            for op in FLOOR_OPS
            if (op, "floor") in by_key
        },
        rounds=rounds,
        seconds=time.perf_counter() - started,
        pickle_bytes=len(pickles[0][0]),
        pickle_oob_bytes=sum(memoryview(b).nbytes for b in pickles[0][1]),
        arrow_bytes=batches[0].get_total_buffer_size(),
    )


# ----------------------------------------------------------------------------- report


TIME_W, RATIO_W, VERDICT_W, TARGET_W = 14, 12, 6, 7


def _time_cell(st: Stats | None) -> str:
    if st is None:
        return f"{'n/a':>{TIME_W}}"
    mark = "" if st.stable else "*"
    return f"{f'{st.median_ns / 1e3:.1f} ±{st.spread_pct:.0f}%{mark}':>{TIME_W}}"


def _ratio_cell(r: Ratio | None) -> str:
    if r is None:
        return f"{'n/a':>{RATIO_W}}"
    return f"{f'{r.value:.2f}x ±{r.spread_pct:.0f}%':>{RATIO_W}}"


def _verdict_cell(r: Ratio | None) -> str:
    return f" {'' if r is None else r.verdict:<{VERDICT_W}}"


def _target_cell(op: str, n: int, workload: str) -> str:
    t = _target(op, n, workload)
    return f"{'-' if t is None else f'>={t:g}x':>{TARGET_W}}"


def format_table(rows: list[Row]) -> str:
    head = (
        f"{'workload':<15}{'n':>5} |"
        + "".join(f"{PATH_LABELS[p]:>{TIME_W}}" for p in (*PATHS, "pickle"))
        + f" |{'target':>{TARGET_W}}"
        + "".join(f"{'x ' + PATH_LABELS[p]:>{RATIO_W}}{'':<{VERDICT_W + 1}}" for p in PATHS)
    )
    novalid_head = " |" + "".join(f"{'nv x ' + PATH_LABELS[p]:>{RATIO_W}}" for p in PATHS)
    lines = []
    for op in ("encode", "decode"):
        title = (
            "ENCODE to_record_batch vs pickle.dumps"
            if op == "encode"
            else "DECODE from_record_batch (validate=True; nv: validate=False) vs pickle.loads"
        )
        op_head = head + (novalid_head if op == "decode" else "")
        lines += ["", title, op_head.rstrip(), "-" * len(op_head)]
        for r in rows:
            line = (
                f"{r.workload:<15}{r.n:>5} |"
                + "".join(_time_cell(r.stats.get((op, p))) for p in (*PATHS, "pickle"))
                + f" |{_target_cell(op, r.n, r.workload)}"
                + "".join(
                    _ratio_cell(r.ratios.get((op, p))) + _verdict_cell(r.ratios.get((op, p)))
                    for p in PATHS
                )
            )
            if op == "decode":
                line += " |" + "".join(
                    _ratio_cell(r.ratios.get(("decode_novalidate", p))) for p in PATHS
                )
            lines.append(line.rstrip())
    if any(("encode", "floor") in r.stats for r in rows):
        lines += _floor_table(rows)
    lines += [
        "",
        "times: us per call, median ±half the interquartile range of the samples (% of the "
        "median); * = median not settled within its time budget; n/a = path not measured",
        "x = pickle / arrow (ratio of the medians; >1: arrow is faster) ±half the IQR of the "
        "per-round paired ratios",
        "verdict: PASS/MISS against the target; ? = the target lies within the paired ratios' "
        "interquartile range (too close to call on this machine)",
        "targets: encode >=2x at 1024 and >=1x at 1 request, decode >=1x at every size",
        f"{STEADY}: decode steps that keep their request ids (reused by both codecs), for "
        "information: no target",
        f"{CHURN}: decode steps in which 1 row in {CHURN_EVERY} gets a new request (the "
        "decoder reuses the other rows' ids), for information: no target",
    ]
    return "\n".join(lines)


def _floor_table(rows: list[Row]) -> list[str]:
    """Per side: the floor's time, pickle's, the best ratio it allows (pickle / floor, with
    the verdict it would get: MISS means no codec on pyarrow can meet that target here),
    and the floor's share of the C path's time."""
    head = f"{'workload':<15}{'n':>5}"
    for op in FLOOR_OPS:
        head += (
            f" |{op + ' floor':>{TIME_W}}{'pickle':>{TIME_W}}{'target':>{TARGET_W}}"
            f"{'best x':>{RATIO_W}}{'':<{VERDICT_W + 1}}{'of C':>6}"
        )
    lines = [
        "",
        "PYARROW FLOOR: what no codec on pyarrow avoids (encode: the batch made from the step's",
        "finished buffers, its step metadata and all-null columns, the cheapest way this",
        "install has (pyarrow_floor.py) + release; decode: full validation, the cheapest way",
        "(the bridge's proof, else pyarrow's) + the buffers handed over as the C walk reads",
        "them); best x = pickle / floor, the most any codec could reach here; of C = floor /",
        "C path time",
        head.rstrip(),
        "-" * len(head),
    ]
    for r in rows:
        line = f"{r.workload:<15}{r.n:>5}"
        for op in FLOOR_OPS:
            floor, ours = r.stats.get((op, "floor")), r.stats.get((op, "c"))
            share = (
                "n/a"
                if floor is None or ours is None
                else f"{floor.median_ns / ours.median_ns:.0%}"
            )
            line += (
                f" |{_time_cell(floor)}{_time_cell(r.stats.get((op, 'pickle')))}"
                f"{_target_cell(op, r.n, r.workload)}"
                f"{_ratio_cell(r.ratios.get((op, 'floor')))}"
                f"{_verdict_cell(r.ratios.get((op, 'floor')))}{share:>6}"
            )
        lines.append(line.rstrip())
    return lines


def summary(rows: list[Row], paths: list[str]) -> str:
    """One line per path: how many targets it meets."""
    out = []
    for path in paths:
        verdicts = [
            r.ratios[op, path].verdict
            for r in rows
            for op in ("encode", "decode")
            if r.ratios[op, path].target is not None
        ]
        passed = sum(v.startswith("PASS") for v in verdicts)
        close = sum(v.endswith("?") for v in verdicts)
        out.append(
            f"{PATH_LABELS[path]} path: {passed}/{len(verdicts)} targets met"
            f" ({close} too close to call)"
        )
    beyond = [
        f"{op} {r.workload} n={r.n}"
        for r in rows
        for op in FLOOR_OPS
        if (op, "floor") in r.ratios and r.ratios[op, "floor"].passed is False
    ]
    if beyond:
        out.append(
            f"targets beyond the pyarrow floor (no codec on pyarrow meets them here): "
            f"{len(beyond)}: {', '.join(beyond)}"
        )
    return "\n".join(out)


def environment(accel: Accel, paths: list[str]) -> dict[str, Any]:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count()
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "arrow_outputs": ao.__version__,
        "pyarrow": pa.__version__,
        "numpy": np.__version__,
        "paths_available": {"c": accel.c_available, "python": True},
        "c_unavailable_because": accel.note or None,
        "paths_measured": paths,
    }


def header(env: dict[str, Any], quick: bool) -> str:
    load = env["load_average"]
    c = (
        "available"
        if env["paths_available"]["c"]
        else f"unavailable ({env['c_unavailable_because']})"
    )
    return (
        f"arrow_outputs {env['arrow_outputs']} | pyarrow {env['pyarrow']} | "
        f"numpy {env['numpy']} | Python {env['python']} | {platform.system()} "
        f"{env['machine']}, {env['cpu_count']} cores ({env['cpus_usable']} usable)"
        + (f", load {load[0]:.2f}" if load else "")
        + (" | --quick" if quick else "")
        + f"\npaths: C (accelerated) {c} | pure Python available | measured: "
        + ", ".join(PATH_LABELS[p] for p in env["paths_measured"])
        + " (+ pickle)"
    )


def results_json(
    rows: list[Row], env: dict[str, Any], *, quick: bool, s: Settings, seconds: float
) -> dict[str, Any]:
    def figure(op: str, path: str) -> dict[str, Any] | None:
        st = r.stats.get((op, path))
        return None if st is None else st.json()

    def ratio(op: str, path: str) -> dict[str, Any] | None:
        ra = r.ratios.get((op, path))
        return None if ra is None else ra.json()

    results = []
    for r in rows:
        results.append(
            {
                "workload": r.workload,
                "n": r.n,
                "rounds": r.rounds,
                "seconds": r.seconds,
                **{
                    op: {
                        "times": {
                            **{p: figure(op, p) for p in PATHS},
                            "pickle": figure(PICKLE_OF[op], "pickle"),
                        },
                        "ratio_pickle_over_arrow": {p: ratio(op, p) for p in PATHS},
                    }
                    for op in OPS
                },
                "pyarrow_floor": {
                    op: {
                        "times": figure(op, "floor"),
                        "ratio_pickle_over_floor": ratio(op, "floor"),
                    }
                    for op in FLOOR_OPS
                },
                "pickle_bytes": r.pickle_bytes,
                "pickle_oob_bytes": r.pickle_oob_bytes,
                "arrow_buffer_bytes": r.arrow_bytes,
            }
        )
    return {
        "benchmark": "bench_encode",
        "quick": quick,
        "settings": {
            "sample_ns": s.sample_ns,
            "min_rounds": s.min_rounds,
            "min_s_per_figure": s.min_s,
            "budget_s_per_figure": s.budget_s,
            "check_every_rounds": s.check_every,
            "stable_checks": s.stable_checks,
            "stable_tolerance": s.stable_tol,
        },
        "environment": env,
        "seconds": seconds,
        "targets": {
            "encode": {str(n): t for n, t in ENCODE_TARGETS.items()},
            "decode": DECODE_TARGET,
        },
        "results": results,
    }


# ----------------------------------------------------------------------------- collector on

GC_SIZES = (64, 256, 1024)
GC_CHUNK = 64  # calls per _time_calls (the arrow side's fresh batches: FRESH_CHUNK at a time)


def gc_on_decode(accel: Accel, paths: list[str], quick: bool) -> dict[str, Any]:
    """Decode against ``pickle.loads`` with the garbage collector on, for information.

    The tables above pause the collector, as ``timeit`` does. A scheduler process runs with
    it on, and decoding a step makes one list per request: each side is charged the
    collections its allocations set off. A sample is the mean per call over a block of calls
    (~0.1 s of timed calls, in chunks of ``GC_CHUNK``, each arrow call on a fresh batch read
    just before it, ``FRESH_CHUNK`` at a time; collections are rare and costly, so a median
    per call would leave them out), the two sides' blocks interleaved; figures are medians
    of the blocks, with this process's tracked objects (what a full collection walks)
    printed alongside.
    """
    path = paths[0]  # the C path when it is measured
    accel.use(path)
    blocks = 3 if quick else 10
    rows: dict[str, Any] = {"path": path, "blocks": blocks, "sizes": {}}
    for n in GC_SIZES:
        outs = [decode_step(n, seed) for seed in range(VARIANTS)]
        schema = ao.run_schema(ao.to_record_batch(outs[0], step=0))
        received = [
            ipc_round_trip(ao.to_record_batch(o, step=i, schema=schema)) for i, o in enumerate(outs)
        ]
        pickles = [pickle_encode(o) for o in outs]
        for (b, custom), pickled, o in zip(received, pickles, outs):  # both give it back
            assert ao.first_difference(ao.from_record_batch(b, custom_metadata=custom), o) is None
            assert ao.first_difference(pickle_decode(*pickled), o) is None
        fresh, nxt_pickle = FreshBatches(received), itertools.cycle(pickles).__next__

        def arrow(nxt: Callable[[], Any] = fresh.next) -> Any:
            batch, custom = nxt()
            return ao.from_record_batch(batch, custom_metadata=custom)

        def unpickle(nxt: Callable[[], Any] = nxt_pickle) -> Any:
            return pickle_decode(*nxt())

        sides = {"arrow": (arrow, fresh.prepare), "pickle": (unpickle, None)}
        means: dict[str, list[float]] = {k: [] for k in sides}
        gc.collect()
        for _ in range(blocks):
            for name, (fn, prepare) in sides.items():
                calls = took = 0
                while took < 100_000_000:
                    took += _time_calls(fn, GC_CHUNK, prepare)
                    calls += GC_CHUNK
                means[name].append(took / calls)
        arrow_ns, pickle_ns = (statistics.median(means[k]) for k in ("arrow", "pickle"))
        rows["sizes"][str(n)] = {
            "arrow_ns": arrow_ns,
            "pickle_ns": pickle_ns,
            "ratio": pickle_ns / arrow_ns,
            "tracked_objects": len(gc.get_objects()),
        }
    return rows


def format_gc_on(gc_rows: dict[str, Any]) -> str:
    lines = [
        f"DECODE WITH THE GARBAGE COLLECTOR ON ({gc_rows['path']} path; for information, no "
        "target): mean us per call over blocks of calls, median of "
        f"{gc_rows['blocks']} blocks",
        f"{'workload':<14}{'n':>6} |{'arrow':>10}{'pickle':>10} |{'x':>7} | tracked objects",
    ]
    for n, r in gc_rows["sizes"].items():
        lines.append(
            f"{'decode lp20':<14}{n:>6} |{r['arrow_ns'] / 1e3:>10.1f}{r['pickle_ns'] / 1e3:>10.1f}"
            f" |{r['ratio']:>6.2f}x | {r['tracked_objects']:,}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="short measurements (smoke run)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    parser.add_argument(
        "--path",
        choices=("both", "c", "python"),
        default="both",
        help="codec path(s) to time against pickle (both: C where available, and Python)",
    )
    args = parser.parse_args(argv)
    s = QUICK if args.quick else FULL
    started = time.perf_counter()

    accel = Accel.detect()
    wanted = list(PATHS) if args.path == "both" else [args.path]
    if not all(accel.available(p) for p in wanted) and args.path != "both":
        parser.exit(2, f"--path {args.path}: the C path is unavailable: {accel.note}\n")
    paths = [p for p in wanted if accel.available(p)]
    env = environment(accel, paths)

    rows = []
    with accel.restored():
        for w in workloads():
            rows.append(run_workload(w, accel, paths, s))
            r = rows[-1]
            print(
                f"  measured {w.name} n={w.n}: {r.rounds} rounds, {r.seconds:.1f} s",
                file=sys.stderr,
                flush=True,
            )
        gc_rows = gc_on_decode(accel, paths, args.quick)
    seconds = time.perf_counter() - started
    print(header(env, args.quick))
    print(format_table(rows))
    print()
    print(format_gc_on(gc_rows))
    print()
    print(summary(rows, paths))
    print(f"run time {seconds:.0f} s")
    if args.json is not None:
        doc = results_json(rows, env, quick=args.quick, s=s, seconds=seconds)
        doc["decode_gc_on"] = gc_rows
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
