"""The record-batch codec against vLLM's pickle-5 handoff, measured in one run.

vLLM moves ``ModelRunnerOutput`` between processes with pickle protocol 5 and out-of-band
buffers (``pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)`` in the sender,
``pickle.loads(data, buffers=buffers)`` in the receiver). This script times, per workload:

* encode: ``arrow_outputs.to_record_batch(out, step=i, schema=run_schema)`` (the run's
  schema fixed by its first batch) against ``pickle.dumps`` as above;
* decode back to objects: ``arrow_outputs.from_record_batch(batch)`` (``validate=True``,
  the default, and ``validate=False`` as an extra column) against ``pickle.loads``.

Neither side's bytes are copied into shared memory here (vLLM's ring buffer copy, an IPC
write for Arrow): both are left out alike, so the ratios compare the codecs themselves.

Ratios are pickle time / arrow time: above 1 means arrow is faster. Each number is the
median over many samples of ``perf_counter_ns`` timings, after a warm-up, with the garbage
collector paused while timing (as ``timeit`` does); the repeat count is scaled so each
measurement takes about 0.3 s (``--quick``: about 0.02 s, for smoke runs). Timed calls
cycle through a few distinct steps of each workload (other request ids, tokens and
logprobs), as an engine would, so no cache keyed on one step's contents can flatter a side.

Usage::

    python benchmarks/bench_encode.py [--quick] [--json PATH]

No assertion depends on timing; the targets are printed with PASS/MISS next to the ratios.
Every step of every workload is checked once for a correct round trip (req_ids, sampled
token ids, logprobs, masks) by both codecs before it is timed, so a broken path cannot be
measured.
"""

from __future__ import annotations

import argparse
import gc
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

import arrow_outputs as ao
from arrow_outputs import LogprobsLists, ModelRunnerOutput, SamplingMaskLists

VOCAB = 128_256  # Llama 3's vocabulary: token ids need more than 16 bits
NUM_LOGPROBS = 20  # width 21: the sampled token plus the top 20
DECODE_SIZES = (1, 64, 256, 1024)
# Timed calls cycle through this many distinct steps of a workload, so a cache keyed on a
# step's contents (its req_ids, say) cannot make every call after the first a hit.
VARIANTS = 4
SPEC_REQUESTS = 1024
MASK_REQUESTS = 1024
MASK_MEAN_IDS = 50

# Targets (docs: design brief). Encode: by number of requests; decode: at every size.
ENCODE_TARGETS = {1: 1.0, 1024: 2.0}
DECODE_TARGET = 1.0

# Timer resolution is ~tens of ns; one sample runs enough calls to last at least this long.
MIN_SAMPLE_NS = 50_000
MIN_SAMPLES = 7


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


def spec_step(n: int = SPEC_REQUESTS, seed: int = 0) -> ModelRunnerOutput:
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


def mask_step(n: int = MASK_REQUESTS, seed: int = 0) -> ModelRunnerOutput:
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


def _workload(name: str, n: int, make: Callable[[int, int], ModelRunnerOutput]) -> Workload:
    return Workload(name, n, [make(n, seed) for seed in range(VARIANTS)])


def workloads() -> list[Workload]:
    return [
        *(_workload("decode lp20", n, decode_step) for n in DECODE_SIZES),
        _workload("spec k<=4 lp20", SPEC_REQUESTS, spec_step),
        _workload(f"mask ~{MASK_MEAN_IDS} ids", MASK_REQUESTS, mask_step),
    ]


# ----------------------------------------------------------------------------- codecs


def pickle_encode(out: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(out, protocol=5, buffer_callback=buffers.append)
    return data, buffers


def pickle_decode(data: bytes, buffers: list[pickle.PickleBuffer]) -> Any:
    return pickle.loads(data, buffers=buffers)


class RoundTripError(RuntimeError):
    """A codec did not give back what it was given: its timings would mean nothing."""


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    return all(
        (x is None and y is None)
        or (isinstance(x, np.ndarray) and np.array_equal(x, y) and x.dtype == y.dtype)
        or (not isinstance(x, np.ndarray) and x == y)
        for x, y in zip(a, b, strict=True)
    )


def check_round_trip(w: Workload, src: Any, back: Any, codec: str) -> None:
    """``back`` must equal ``src`` on req_ids, sampled ids, logprobs and masks."""
    for name in ("req_ids", "req_id_to_index", "sampled_token_ids"):
        if getattr(back, name) != getattr(src, name):
            raise RoundTripError(f"{codec} round trip of {w.name} n={w.n}: {name} differs")
    for name in ("logprobs", "sampling_masks"):
        if not _same(getattr(back, name), getattr(src, name)):
            raise RoundTripError(f"{codec} round trip of {w.name} n={w.n}: {name} differs")


# ----------------------------------------------------------------------------- timing


@dataclass
class Timing:
    median_ns: float
    min_ns: float
    calls_per_sample: int
    samples: int


def measure(fn: Callable[[], Any], target_s: float) -> Timing:
    """Median ns per call of ``fn`` over samples that together take about ``target_s``."""
    for _ in range(3):  # warm up: caches, lazy imports, lru_caches keyed by size
        fn()
    once = min(_time_calls(fn, 1) for _ in range(3))
    number = max(1, math.ceil(MIN_SAMPLE_NS / max(once, 1)))
    samples = max(MIN_SAMPLES, int(target_s * 1e9 / (once * number)))
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()  # as timeit does: a collection falls on one side or the other at random
    try:
        per_call = [_time_calls(fn, number) / number for _ in range(samples)]
    finally:
        if was_enabled:
            gc.enable()
    return Timing(statistics.median(per_call), min(per_call), number, samples)


def _time_calls(fn: Callable[[], Any], number: int) -> int:
    clock = time.perf_counter_ns
    t0 = clock()
    for _ in range(number):
        fn()
    return clock() - t0


# ----------------------------------------------------------------------------- run


@dataclass
class Row:
    workload: str
    n: int
    encode_arrow: Timing
    encode_pickle: Timing
    decode_arrow: Timing
    decode_arrow_novalidate: Timing
    decode_pickle: Timing
    pickle_bytes: int
    pickle_oob_bytes: int
    arrow_bytes: int

    @property
    def encode_ratio(self) -> float:
        return self.encode_pickle.median_ns / self.encode_arrow.median_ns

    @property
    def decode_ratio(self) -> float:
        return self.decode_pickle.median_ns / self.decode_arrow.median_ns

    @property
    def decode_novalidate_ratio(self) -> float:
        return self.decode_pickle.median_ns / self.decode_arrow_novalidate.median_ns

    @property
    def encode_target(self) -> float | None:
        return ENCODE_TARGETS.get(self.n)

    @property
    def decode_target(self) -> float:
        return DECODE_TARGET


def run_workload(w: Workload, target_s: float) -> Row:
    outs = w.outputs
    # The run's schema is fixed by its first step; later steps pass it (same object).
    run_schema = ao.to_record_batch(outs[0], step=0).schema
    batches = [ao.to_record_batch(o, step=i + 1, schema=run_schema) for i, o in enumerate(outs)]
    pickles = [pickle_encode(o) for o in outs]
    for src, batch, (data, buffers) in zip(outs, batches, pickles):
        check_round_trip(w, src, ao.from_record_batch(batch), "arrow")
        check_round_trip(w, src, ao.from_record_batch(batch, validate=False), "arrow (no validate)")
        check_round_trip(w, src, pickle_decode(data, buffers), "pickle")

    steps = itertools.count(len(outs) + 1)
    out_cycle, batch_cycle, pickle_cycle = (itertools.cycle(x) for x in (outs, batches, pickles))
    return Row(
        workload=w.name,
        n=w.n,
        encode_arrow=measure(
            lambda: ao.to_record_batch(next(out_cycle), step=next(steps), schema=run_schema),
            target_s,
        ),
        encode_pickle=measure(lambda: pickle_encode(next(out_cycle)), target_s),
        decode_arrow=measure(lambda: ao.from_record_batch(next(batch_cycle)), target_s),
        decode_arrow_novalidate=measure(
            lambda: ao.from_record_batch(next(batch_cycle), validate=False), target_s
        ),
        decode_pickle=measure(lambda: pickle_decode(*next(pickle_cycle)), target_s),
        pickle_bytes=len(pickles[0][0]),
        pickle_oob_bytes=sum(memoryview(b).nbytes for b in pickles[0][1]),
        arrow_bytes=batches[0].get_total_buffer_size(),
    )


def _verdict(ratio: float, target: float | None) -> str:
    if target is None:
        return "-"
    return f">={target:.1f}x {'PASS' if ratio >= target else 'MISS'}"


def format_table(rows: list[Row]) -> str:
    head = (
        f"{'workload':<16}{'n':>5} |"
        f"{'enc arrow':>10}{'pickle':>9}{'x':>7}  {'target':<12}|"
        f"{'dec arrow':>10}{'pickle':>9}{'x':>7}  {'target':<12}|"
        f"{'dec novalid':>12}{'x':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.workload:<16}{r.n:>5} |"
            f"{r.encode_arrow.median_ns / 1e3:>10.1f}{r.encode_pickle.median_ns / 1e3:>9.1f}"
            f"{r.encode_ratio:>6.2f}x  {_verdict(r.encode_ratio, r.encode_target):<12}|"
            f"{r.decode_arrow.median_ns / 1e3:>10.1f}{r.decode_pickle.median_ns / 1e3:>9.1f}"
            f"{r.decode_ratio:>6.2f}x  {_verdict(r.decode_ratio, r.decode_target):<12}|"
            f"{r.decode_arrow_novalidate.median_ns / 1e3:>12.1f}"
            f"{r.decode_novalidate_ratio:>6.2f}x"
        )
    lines.append(
        "times in us (median per call); x = pickle / arrow, >1 means arrow is faster; "
        "targets: encode >=2x at 1024 and >=1x at 1, decode >=1x everywhere"
    )
    return "\n".join(lines)


def _timing_json(t: Timing) -> dict[str, Any]:
    return {
        "median_ns": t.median_ns,
        "min_ns": t.min_ns,
        "calls_per_sample": t.calls_per_sample,
        "samples": t.samples,
    }


def _side(arrow: Timing, pickle_t: Timing, ratio: float, target: float | None) -> dict[str, Any]:
    return {
        "arrow": _timing_json(arrow),
        "pickle": _timing_json(pickle_t),
        "ratio": ratio,
        "target": target,
        "pass": None if target is None else ratio >= target,
    }


def results_json(rows: list[Row], *, quick: bool, target_s: float) -> dict[str, Any]:
    return {
        "benchmark": "bench_encode",
        "quick": quick,
        "target_s_per_measurement": target_s,
        "environment": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "arrow_outputs": ao.__version__,
            "pyarrow": pa.__version__,
            "numpy": np.__version__,
        },
        "results": [
            {
                "workload": r.workload,
                "n": r.n,
                "encode": _side(r.encode_arrow, r.encode_pickle, r.encode_ratio, r.encode_target),
                "decode": _side(r.decode_arrow, r.decode_pickle, r.decode_ratio, r.decode_target),
                "decode_novalidate": _side(
                    r.decode_arrow_novalidate, r.decode_pickle, r.decode_novalidate_ratio, None
                ),
                "pickle_bytes": r.pickle_bytes,
                "pickle_oob_bytes": r.pickle_oob_bytes,
                "arrow_buffer_bytes": r.arrow_bytes,
            }
            for r in rows
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="short measurements (smoke run)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    target_s = 0.02 if args.quick else 0.3

    rows = []
    for w in workloads():
        rows.append(run_workload(w, target_s))
        print(f"  measured {w.name} n={w.n}", file=sys.stderr, flush=True)
    print(
        f"arrow_outputs {ao.__version__} | pyarrow {pa.__version__} | numpy {np.__version__} | "
        f"Python {sys.version.split()[0]} | {platform.machine()} x{os.cpu_count()}"
        f"{' | --quick' if args.quick else ''}"
    )
    print(format_table(rows))
    if args.json is not None:
        args.json.write_text(
            json.dumps(results_json(rows, quick=args.quick, target_s=target_s), indent=2) + "\n"
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
