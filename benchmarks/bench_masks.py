"""Sampling-mask tensors to the host: vLLM's per-row loop against the vectorised routine.

vLLM 0.33's Model Runner V2 turns its device-side ``SamplingMaskTensors`` (compact ids,
a packed bitmask and counts per row) into the scheduler's CSR ``SamplingMaskLists`` with
``SamplingMaskTensors.tolists`` (``vllm/v1/worker/gpu/sample/output.py``): a Python loop
over the kept rows that slices each compact row or unpacks each wide row's bitmask, then
concatenates. ``vllm_tolists`` below is that loop, re-implemented as it is there. This
script times, on host tensors (as after ``to_cpu_nonblocking()`` and the copy event):

* ``loop``: ``vllm_tolists(masks, num_sampled)``, the baseline;
* ``tolists``: ``arrow_outputs.SamplingMaskTensors.tolists`` (same output, vectorised);
* ``arrow``: ``arrow_outputs.mask_tensors_to_arrow`` (the Arrow array, vectorised);
* ``loop+arrow``: the loop followed by ``sampling_masks_to_arrow``, the old way to the
  same Arrow array (an extra column, for the ``arrow`` ratio against it).

Ratios are baseline time / our time (medians): ``x tolists`` = loop / tolists,
``x arrow`` = loop / arrow, ``x arrow2`` = (loop+arrow) / arrow. Targets (from the
project): masks alone >= 20x at 512 rows; with wide rows >= 5x (taken at 512 rows too).
They apply to ``x tolists`` and ``x arrow``; other sizes, and the speculative workload (no
target was set for it), print ``-``.

Workloads (each as ``VARIANTS`` distinct steps, cycled by the timed calls):

* ``~50 ids``: one row per request, vocabulary 128,256, compact width 64 (a batch whose
  largest top-k is 64), 35..64 kept ids per row (mean ~50), no wide row;
* ``wide 1/16``: vocabulary 32,768, compact width 1024; 1 row in 16 keeps 2,000..4,000
  ids (past the width, so read from the bitmask), the rest ~50;
* ``spec 4 slots``: 4 slots per request (speculative decoding, 3 draft tokens), each
  request sampled 1..4 of them, ~50 ids per sampled slot, vocabulary 128,256, width 64.

Method: as in ``bench_encode.py``; ``--cpu-time`` times each sample with the calling thread's
CPU time instead of wall time (on a machine other processes load, it leaves out the time they
hold the cores). Each sample is enough back-to-back calls to last
``sample_ns`` (the garbage collector paused); one round times one sample of every figure
of a workload in a fresh random order; rounds go on until each figure's running median has
settled (three checks within 2%) or the time budget is spent (``*`` marks a median that had
not settled). Times print as ``median ±spread``, the spread being half the interquartile
range as a percentage of the median; a ratio's spread is that of the per-round ratios.
Before timing, each workload's outputs are checked: ``tolists`` must equal the loop's lists
(values and dtypes) and ``mask_tensors_to_arrow`` must equal ``sampling_masks_to_arrow``
of them.

Usage::

    python benchmarks/bench_masks.py [--quick] [--cpu-time] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

import arrow_outputs as ao
from arrow_outputs import SamplingMaskLists, SamplingMaskTensors

SIZES = (64, 512, 1024)  # rows
VARIANTS = 3
TARGET_ROWS = 512
TARGETS: dict[str, float | None] = {"~50 ids": 20.0, "wide 1/16": 5.0, "spec 4 slots": None}


@dataclass(frozen=True)
class Settings:
    sample_ns: int
    min_rounds: int
    budget_s: float  # per figure
    check_every: int = 10
    stable_checks: int = 3
    stable_tol: float = 0.02


FULL = Settings(sample_ns=2_000_000, min_rounds=30, budget_s=1.5)
QUICK = Settings(sample_ns=500_000, min_rounds=6, budget_s=0.08, check_every=3)


# ----------------------------------------------------------------------------- baseline


def vllm_tolists(masks: Any, num_sampled_tokens: np.ndarray | None = None) -> SamplingMaskLists:
    """vLLM 0.33's ``SamplingMaskTensors.tolists`` (``vllm/v1/worker/gpu/sample/output.py``),
    its per-row loop kept as it is there, returning our ``SamplingMaskLists``."""
    counts = masks.counts.cpu().numpy()
    token_ids = masks.token_ids.cpu().numpy()
    packed_mask = masks.packed_mask.cpu().numpy()
    width = token_ids.shape[1]

    cu_num_generated_tokens = None
    if masks.rows_per_request == 1:
        sampled_rows = np.arange(len(counts))
    else:
        assert num_sampled_tokens is not None
        active_slots = np.arange(masks.rows_per_request)[None, :] < num_sampled_tokens[:, None]
        sampled_rows = np.flatnonzero(active_slots)
        cu_num_generated_tokens = np.cumsum(np.concatenate(([0], num_sampled_tokens))).tolist()

    def support(row: int) -> np.ndarray:
        if counts[row] <= width:
            return token_ids[row, : counts[row]]
        bits = np.unpackbits(packed_mask[row], count=masks.vocab_size, bitorder="little")
        return np.flatnonzero(bits).astype(np.int32, copy=False)

    supports = [support(row) for row in sampled_rows]
    offsets = np.zeros(len(supports) + 1, dtype=np.int64)
    np.cumsum([len(s) for s in supports], out=offsets[1:])
    flat = np.concatenate([np.empty(0, dtype=np.int32), *supports])
    return SamplingMaskLists(flat, offsets, cu_num_generated_tokens)


# ----------------------------------------------------------------------------- workloads


@dataclass
class Step:
    masks: SamplingMaskTensors
    num_sampled: np.ndarray


@dataclass
class Workload:
    name: str
    rows: int
    vocab: int
    width: int
    steps: list[Step]
    kept_ids: int = 0  # mean per step
    wide_rows: int = 0  # mean per step


def make_step(
    rng: np.random.Generator,
    *,
    rows: int,
    vocab: int,
    width: int,
    rpr: int,
    wide_every: int = 0,
) -> Step:
    """Tensors as the kernel leaves them: ids ascending, bitmask of the whole support,
    count 0 for unsampled slots (whose ids and bits are left as garbage, like torch.empty)."""
    num_reqs = rows // rpr
    num_sampled = (
        np.ones(num_reqs, np.int32) if rpr == 1 else rng.integers(1, rpr + 1, num_reqs, np.int32)
    )
    nbytes = (vocab + 7) // 8
    token_ids = rng.integers(0, vocab, (rows, width), dtype=np.int32)
    packed = rng.integers(0, 256, (rows, nbytes), dtype=np.uint8)
    counts = np.zeros(rows, np.int32)
    member = np.zeros(nbytes * 8, np.uint8)
    for r in range(rows):
        if r % rpr >= num_sampled[r // rpr]:
            continue
        if wide_every and r % wide_every == wide_every // 2:
            k = int(rng.integers(2000, 4001))
        else:
            k = int(rng.integers(35, min(64, width) + 1))
        ids = np.sort(rng.choice(vocab, size=k, replace=False)).astype(np.int32)
        member[:] = 0
        member[ids] = 1
        packed[r] = np.packbits(member, bitorder="little")
        counts[r] = k
        token_ids[r, : min(k, width)] = ids[:width]
    masks = SamplingMaskTensors(
        torch.from_numpy(token_ids), torch.from_numpy(packed), torch.from_numpy(counts), vocab, rpr
    )
    return Step(masks, num_sampled)


def workloads(sizes: tuple[int, ...]) -> list[Workload]:
    out = []
    kinds = [
        ("~50 ids", 128_256, 64, 1, 0),
        ("wide 1/16", 32_768, 1024, 1, 16),
        ("spec 4 slots", 128_256, 64, 4, 0),
    ]
    for name, vocab, width, rpr, wide_every in kinds:
        for rows in sizes:
            rng = np.random.default_rng(rows)
            steps = [
                make_step(rng, rows=rows, vocab=vocab, width=width, rpr=rpr, wide_every=wide_every)
                for _ in range(VARIANTS)
            ]
            kept = statistics.mean(int(s.masks.counts.sum()) for s in steps)
            wide = statistics.mean(int((s.masks.counts > width).sum()) for s in steps)
            out.append(Workload(name, rows, vocab, width, steps, int(kept), int(wide)))
    return out


class MismatchError(RuntimeError):
    """The vectorised routine disagrees with vLLM's loop: timing it would mean nothing."""


def check(w: Workload) -> None:
    for i, s in enumerate(w.steps):
        want = vllm_tolists(s.masks, s.num_sampled)
        got = s.masks.tolists(s.num_sampled)
        same = (
            got.token_ids.dtype == want.token_ids.dtype
            and got.offsets.dtype == want.offsets.dtype
            and np.array_equal(got.token_ids, want.token_ids)
            and np.array_equal(got.offsets, want.offsets)
            and got.cu_num_generated_tokens == want.cu_num_generated_tokens
        )
        if not same:
            raise MismatchError(f"{w.name} rows={w.rows} step {i}: tolists != vLLM's loop")
        arr = ao.mask_tensors_to_arrow(s.masks, s.num_sampled)
        if not arr.equals(ao.sampling_masks_to_arrow(want)):
            raise MismatchError(f"{w.name} rows={w.rows} step {i}: arrow != loop's arrow")


# ----------------------------------------------------------------------------- timing


@dataclass
class Figure:
    name: str
    fn: Callable[[], Any]
    number: int = 1
    # fn times itself: it returns the nanoseconds (on clock()) of the part of the call that
    # counts, so per-call setup that is not part of the figure (a staging) stays out of it.
    self_timed: bool = False
    per_call: list[float] = field(default_factory=list)
    medians: list[float] = field(default_factory=list)
    spent_ns: int = 0

    def stable(self, s: Settings) -> bool:
        last = self.medians[-s.stable_checks :]
        return len(last) == s.stable_checks and max(last) <= min(last) * (1 + s.stable_tol)


def cycling(fn: Callable[[Step], Any], steps: list[Step]) -> Callable[[], Any]:
    """Each call works on the next step, so no cache keyed on one step flatters a side."""
    i = 0

    def call() -> Any:
        nonlocal i
        i = (i + 1) % len(steps)
        return fn(steps[i])

    return call


# The clock of every sample: wall time by default; --cpu-time takes the calling thread's CPU
# time, which leaves out the time other processes hold the cores (on a shared machine the
# biggest source of spread; every timed call runs on the calling thread).
CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}
CLOCK = ["wall"]


def clock() -> int:
    """The current sample clock's reading (ns)."""
    return CLOCKS[CLOCK[0]]()


def _time_calls(f: Figure, number: int) -> int:
    fn = f.fn
    if f.self_timed:
        return sum(fn() for _ in range(number))
    now = CLOCKS[CLOCK[0]]
    t0 = now()
    for _ in range(number):
        fn()
    return now() - t0


def sample_rounds(figures: list[Figure], s: Settings) -> int:
    for f in figures:
        for _ in range(3):
            f.fn()
        once = min(_time_calls(f, 1) for _ in range(3))
        f.number = max(1, math.ceil(s.sample_ns / max(once, 1)))
    order, shuffle = list(figures), random.Random(0).shuffle
    budget_ns = s.budget_s * 1e9 * len(figures)
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    rounds = 0
    try:
        while True:
            shuffle(order)
            for f in order:
                took = _time_calls(f, f.number)
                f.per_call.append(took / f.number)
                f.spent_ns += took
            rounds += 1
            if rounds % s.check_every:
                continue
            gc.collect()
            for f in figures:
                f.medians.append(statistics.median(f.per_call))
            if sum(f.spent_ns for f in figures) >= budget_ns:
                break
            if rounds >= s.min_rounds and all(f.stable(s) for f in figures):
                break
    finally:
        if was_enabled:
            gc.enable()
    return rounds


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def stats(f: Figure, s: Settings) -> dict[str, Any]:
    q1, q2, q3 = _quartiles(f.per_call)
    return {
        "median_ns": q2,
        "q1_ns": q1,
        "q3_ns": q3,
        "min_ns": min(f.per_call),
        "max_ns": max(f.per_call),
        "spread_pct": 100 * (q3 - q1) / 2 / q2,
        "samples": len(f.per_call),
        "calls_per_sample": f.number,
        "median_settled": f.stable(s),
    }


def ratio(base: Figure, ours: Figure, target: float | None) -> dict[str, Any]:
    per_round = [b / o for b, o in zip(base.per_call, ours.per_call)]
    q1, _, q3 = _quartiles(per_round)
    value = statistics.median(base.per_call) / statistics.median(ours.per_call)
    out: dict[str, Any] = {
        "ratio": value,
        "q1": q1,
        "q3": q3,
        "spread_pct": 100 * (q3 - q1) / 2 / value,
        "target": target,
        "pass": None if target is None else value >= target,
    }
    if target is None:
        out["verdict"] = "-"
    else:
        out["verdict"] = ("PASS" if value >= target else "MISS") + ("?" if q1 < target < q3 else "")
    return out


# ----------------------------------------------------------------------------- report


def environment() -> dict[str, Any]:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 0
    return {
        "arrow_outputs": ao.__version__,
        "pyarrow": pa.__version__,
        "numpy": np.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "cpus": os.cpu_count(),
        "cpus_usable": usable,
        "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def _t(st: dict[str, Any]) -> str:
    star = "" if st["median_settled"] else "*"
    return f"{st['median_ns'] / 1e3:9.1f}{star} ±{st['spread_pct']:.0f}%"


def _r(r: dict[str, Any]) -> str:
    return f"{r['ratio']:6.1f}x ±{r['spread_pct']:.0f}% {r['verdict']:<5}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds, rough figures")
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    parser.add_argument(
        "--cpu-time", action="store_true", help="time with the thread's CPU time, not wall time"
    )
    args = parser.parse_args(argv)
    s = QUICK if args.quick else FULL
    CLOCK[0] = "cpu" if args.cpu_time else "wall"
    env = environment()
    env["clock"] = CLOCK[0]
    print(
        f"arrow_outputs {env['arrow_outputs']} | pyarrow {env['pyarrow']} | numpy "
        f"{env['numpy']} | torch {env['torch']} | Python {env['python']} | "
        f"{env['platform']}, {env['cpus']} cores ({env['cpus_usable']} usable), "
        f"load {env['load']:.2f}"
    )
    print(
        f"times: microseconds per call ({CLOCK[0]} clock), median ±half-IQR; "
        "ratios: loop time / ours"
    )
    t_start = time.perf_counter()
    results = []
    header = (
        f"{'workload':<13}{'rows':>5}{'ids':>8}{'wide':>5} |{'loop':>15}{'loop+arrow':>15}"
        f"{'tolists':>15}{'arrow':>15} | {'target':>6} {'x tolists':<19}{'x arrow':<19}"
        f"{'x arrow2':<10}"
    )
    print(header)
    print("-" * len(header))
    for w in workloads(SIZES):
        check(w)
        figs = {
            "loop": Figure(
                "loop", cycling(lambda st: vllm_tolists(st.masks, st.num_sampled), w.steps)
            ),
            "loop+arrow": Figure(
                "loop+arrow",
                cycling(
                    lambda st: ao.sampling_masks_to_arrow(vllm_tolists(st.masks, st.num_sampled)),
                    w.steps,
                ),
            ),
            "tolists": Figure(
                "tolists", cycling(lambda st: st.masks.tolists(st.num_sampled), w.steps)
            ),
            "arrow": Figure(
                "arrow",
                cycling(lambda st: ao.mask_tensors_to_arrow(st.masks, st.num_sampled), w.steps),
            ),
        }
        rounds = sample_rounds(list(figs.values()), s)
        target = TARGETS[w.name] if w.rows == TARGET_ROWS else None
        st = {k: stats(f, s) for k, f in figs.items()}
        ratios = {
            "x_tolists": ratio(figs["loop"], figs["tolists"], target),
            "x_arrow": ratio(figs["loop"], figs["arrow"], target),
            "x_arrow2": ratio(figs["loop+arrow"], figs["arrow"], None),
        }
        tgt = f">={target:.0f}x" if target else "-"
        print(
            f"{w.name:<13}{w.rows:>5}{w.kept_ids:>8}{w.wide_rows:>5} |"
            f"{_t(st['loop']):>15}{_t(st['loop+arrow']):>15}{_t(st['tolists']):>15}"
            f"{_t(st['arrow']):>15} | {tgt:>6} {_r(ratios['x_tolists']):<19}"
            f"{_r(ratios['x_arrow']):<19}{ratios['x_arrow2']['ratio']:6.1f}x"
        )
        results.append(
            {
                "workload": w.name,
                "rows": w.rows,
                "vocab_size": w.vocab,
                "width": w.width,
                "rows_per_request": w.steps[0].masks.rows_per_request,
                "mean_kept_ids": w.kept_ids,
                "mean_wide_rows": w.wide_rows,
                "rounds": rounds,
                "times": st,
                "ratios": ratios,
            }
        )
    wall = time.perf_counter() - t_start
    judged = [r for r in results if r["ratios"]["x_arrow"]["target"] is not None]
    met = sum(r["ratios"][k]["pass"] for r in judged for k in ("x_tolists", "x_arrow"))
    print(f"\ntargets met: {met}/{2 * len(judged)} | {wall:.1f} s")
    if args.json:
        payload = {
            "settings": s.__dict__,
            "quick": args.quick,
            "environment": env,
            "wall_s": wall,
            "targets": {"rows": TARGET_ROWS, **TARGETS},
            "workloads": results,
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
