"""Mutated and truncated run files: only arrow_outputs errors, no crash, no hang.

The suite runs a bounded number of cases; run this file as a script for a longer campaign::

    python tests/test_file_fuzz.py --cases 100000 --seed 1
"""

from __future__ import annotations

import argparse
import io
import os
import random
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


# ------------------------------------------------------------------ foreign column types

_PRIMITIVES = [
    pa.int8(), pa.int32(), pa.int64(), pa.uint64(), pa.float16(), pa.float32(), pa.bool_(),
    pa.null(), pa.string(), pa.large_string(), pa.binary(), pa.date32(), pa.timestamp("s"),
    pa.decimal128(5, 2),
]  # fmt: skip
_NAMES = ["token_ids", "logprobs", "rank", "data", "shape", "rows", "token_start", "x", ""]


def _random_type(rng: random.Random, depth: int = 0) -> pa.DataType:
    """Any Arrow type a file could declare, nested up to three levels."""
    kind = rng.randrange(12 if depth < 3 else 1)
    if kind == 0:
        return rng.choice(_PRIMITIVES)
    inner = _random_type(rng, depth + 1) if kind in (1, 2, 3, 5, 7) else None
    if kind == 1:
        return pa.list_(inner)
    if kind == 2:
        return pa.large_list(inner)
    if kind == 3:
        return pa.list_(inner, rng.randrange(0, 4))
    if kind == 4:
        names = rng.sample(_NAMES, rng.randrange(0, 4))
        return pa.struct([(name, _random_type(rng, depth + 1)) for name in names])
    if kind == 5:
        return pa.map_(pa.string(), inner)
    if kind == 6:
        return pa.dictionary(pa.int32(), pa.string())
    if kind == 7:
        return pa.list_view(inner)
    if kind == 8:
        return pa.fixed_shape_tensor(pa.float32(), [rng.randrange(0, 3)] * rng.randrange(1, 3))
    if kind == 9:
        return pa.dense_union([pa.field("a", pa.int32()), pa.field("b", pa.string())])
    if kind == 10:
        return pa.run_end_encoded(pa.int32(), pa.int64())
    shape = pa.list_(pa.int32(), rng.randrange(0, 3))
    return pa.struct([("data", pa.list_(rng.choice(_PRIMITIVES))), ("shape", shape)])


def _changed_inside(t: pa.DataType, rng: random.Random) -> pa.DataType:
    """``t`` with one descendant (or itself) replaced by a random type."""
    kids = [t.field(i) for i in range(t.num_fields)]
    if not kids or rng.random() < 0.3:
        return _random_type(rng)
    i = rng.randrange(len(kids))
    kids[i] = kids[i].with_type(_changed_inside(kids[i].type, rng))
    if pa.types.is_struct(t):
        return pa.struct(kids)
    if pa.types.is_large_list(t):
        return pa.large_list(kids[0])
    if pa.types.is_fixed_size_list(t):
        return pa.list_(kids[0], t.list_size)
    if pa.types.is_list(t):
        return pa.list_(kids[0])
    return _random_type(rng)


def test_foreign_column_types_give_only_schema_errors():
    """A run file's schema with one or two columns of another type (anywhere inside them):
    the schema check refuses it with a SchemaMismatchError naming a column, or accepts a
    schema that is a valid run schema, and opening a run with it does the same. Byte
    mutations of whole files reach such schemas rarely (one took a 40x fuzz run to find)."""
    out = ao.ModelRunnerOutput(["a"], {"a": 0}, [[1]])
    base = ao.run_schema(ao.to_record_batch(out, step=0))
    rng = random.Random(20261202)
    refused = 0
    for _ in range(CASES):
        schema = base
        for _ in range(rng.randrange(1, 3)):
            i = rng.randrange(len(schema))
            f = schema.field(i)
            t = _changed_inside(f.type, rng) if rng.random() < 0.7 else _random_type(rng)
            schema = schema.set(i, f.with_type(t))
        error = None
        try:
            ao.schema.column_types(schema)
        except ao.SchemaMismatchError as e:
            error = e
        accepted = error is None
        if error is not None:  # it names a column (or the schema), by its path
            assert error.field.split(".")[0] in [*base.names, "schema"], error.field
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, schema):
            pass
        if accepted:
            assert len(ao.open_run(sink.getvalue())) == 0
        else:
            refused += 1
            with pytest.raises(ao.SchemaMismatchError):
                ao.open_run(sink.getvalue())
    assert refused > CASES * 0.9


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
