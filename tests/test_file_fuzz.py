"""Mutated and truncated run files: only arrow_outputs errors, no crash, no hang.

The suite runs a bounded number of cases; run this file as a script for a longer campaign::

    python tests/test_file_fuzz.py --cases 100000 --seed 1
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pytest

import arrow_outputs as ao

CASES = int(1200 * float(os.environ.get("ARROW_OUTPUTS_FUZZ_SCALE", "1")))


def _step(step: int, n: int) -> ao.ModelRunnerOutput:
    rng = np.random.default_rng(step)
    ids = [f"r{step}.{i}" for i in range(n)]
    counts = rng.integers(0, 3, n)
    cu = [0, *np.cumsum(counts).tolist()]
    k = cu[-1]
    return ao.ModelRunnerOutput(
        ids,
        {r: i for i, r in enumerate(ids)},
        [rng.integers(0, 50, c).tolist() for c in counts],
        ao.LogprobsLists(
            rng.integers(0, 50, (k, 2)),
            rng.random((k, 2), dtype=np.float32),
            rng.integers(1, 5, k),
            cu,
        ),
        prompt_logprobs_dict={ids[0]: None} if n else {},
        num_nans_in_logits={r: 1 for r in ids},
        sampling_masks=ao.SamplingMaskLists(
            np.arange(k, dtype=np.int32), np.arange(k + 1, dtype=np.int64), cu
        ),
        kv_connector_output=ao.KVConnectorOutput(finished_sending={"x"}),
    )


def seeds() -> list[bytes]:
    """Small valid runs in each format the writer makes."""
    out = []
    for fmt, compression in (("stream", None), ("file", None), ("stream", "lz4")):
        sink = io.BytesIO()
        with ao.OutputWriter(sink, format=fmt, compression=compression) as writer:
            for s, n in enumerate((2, 0, 3)):
                writer.write(_step(s, n))
        out.append(sink.getvalue())
    return out


def mutate(data: bytes, rng: np.random.Generator) -> bytes:
    buf = bytearray(data)
    kind = rng.integers(0, 6)
    if kind == 0:  # truncate anywhere
        return bytes(buf[: rng.integers(0, len(buf))])
    if kind == 1:  # flip a few bytes
        for _ in range(rng.integers(1, 8)):
            buf[rng.integers(0, len(buf))] ^= 1 << int(rng.integers(0, 8))
        return bytes(buf)
    if kind == 2:  # an extreme 32/64-bit value where lengths and offsets live
        at = int(rng.integers(0, len(buf) - 8))
        value = int(rng.choice([0, 1, 7, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1, 2**31]))
        width = int(rng.choice([4, 8]))
        buf[at : at + width] = (value % 2 ** (8 * width)).to_bytes(width, "little")
        return bytes(buf)
    if kind == 3:  # delete a span
        a = int(rng.integers(0, len(buf)))
        del buf[a : a + int(rng.integers(1, 64))]
        return bytes(buf)
    if kind == 4:  # duplicate a span (repeated messages)
        a = int(rng.integers(0, len(buf)))
        span = buf[a : a + int(rng.integers(1, 400))]
        buf[a:a] = span
        return bytes(buf)
    # random bytes over a span
    a = int(rng.integers(0, len(buf)))
    n = int(rng.integers(1, 32))
    buf[a : a + n] = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    return bytes(buf)


def agrees_with_pyarrow(out: ao.ModelRunnerOutput, batch: pa.RecordBatch) -> None:
    """What decoded must be what pyarrow reads in the same columns."""
    ids = batch.column("req_id").to_pylist()
    assert out.req_ids == ids, (out.req_ids, ids)
    assert out.req_id_to_index == {r: i for i, r in enumerate(ids)}
    if len(out.sampled_token_ids) == batch.num_rows:
        assert out.sampled_token_ids == batch.column("sampled_token_ids").to_pylist()
    lp = out.logprobs
    if lp is not None:
        rows = batch.column("logprobs").to_pylist()
        flat = [p for row in rows if row is not None for p in row]
        assert [p["token_ids"] for p in flat] == np.asarray(lp.logprob_token_ids).tolist()
        assert [p["rank"] for p in flat] == np.asarray(lp.sampled_token_ranks).tolist()


def exercise(data: bytes, tmpdir: str, with_recover: bool) -> str:
    """Read a (mutated) run every way a user would; returns what happened."""
    outcome = "ok"
    try:
        run = ao.open_run(data)
        for step in run:
            agrees_with_pyarrow(step.output(), step.batch)
        run.read_all()
    except ao.ArrowOutputsError as e:
        outcome = type(e).__name__
    if with_recover:
        src = os.path.join(tmpdir, "src.arrows")
        with open(src, "wb") as f:
            f.write(data)
        try:
            report = ao.recover(src, os.path.join(tmpdir, "out.arrows"))
            for step in ao.open_run(os.path.join(tmpdir, "out.arrows")):
                step.output()
            assert report.steps <= 3
        except ao.ArrowOutputsError as e:
            outcome += "/" + type(e).__name__
    return outcome


@pytest.fixture(scope="module")
def seed_runs() -> list[bytes]:
    return seeds()


def test_seeds_are_valid(seed_runs):
    for data in seed_runs:
        run = ao.open_run(data)
        assert run.complete
        assert len(run) == 3


def test_mutated_files_give_only_arrow_outputs_errors(seed_runs, tmp_path):
    rng = np.random.default_rng(20261201)
    outcomes: dict[str, int] = {}
    for i in range(CASES):
        data = mutate(seed_runs[i % len(seed_runs)], rng)
        start = time.monotonic()
        outcome = exercise(data, str(tmp_path), with_recover=i % 8 == 0)
        assert time.monotonic() - start < 10, f"case {i} took too long"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    # Most mutations are caught, and some still read (flips in padding, in float values).
    assert sum(v for k, v in outcomes.items() if k.startswith("ok")) > 0
    assert sum(v for k, v in outcomes.items() if not k.startswith("ok")) > CASES // 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    runs = seeds()
    outcomes: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmpdir:
        for i in range(args.cases):
            data = mutate(runs[i % len(runs)], rng)
            try:
                outcome = exercise(data, tmpdir, with_recover=i % 8 == 0)
            except Exception:
                path = os.path.join(os.getcwd(), f"fuzz-case-{args.seed}-{i}.arrows")
                with open(path, "wb") as f:
                    f.write(data)
                print(f"case {i}: unexpected exception; input saved to {path}", file=sys.stderr)
                raise
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            if (i + 1) % 10_000 == 0:
                print(f"{i + 1} cases: {dict(sorted(outcomes.items()))}", flush=True)
    print(dict(sorted(outcomes.items())))


if __name__ == "__main__":
    main()
