"""Run files open in the tools users analyse them with: pyarrow, Polars, DuckDB."""

from __future__ import annotations

import pyarrow as pa
import pytest
from conftest import decode_step

import arrow_outputs as ao

pl = pytest.importorskip("polars")
duckdb = pytest.importorskip("duckdb")


@pytest.fixture
def run_file(tmp_path):
    steps = [decode_step(s, n) for s, n in enumerate((3, 5, 0, 4))]
    schema = ao.infer_schema(steps[0], metadata={"model": "toy"})
    path = tmp_path / "run.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for s, out in enumerate(steps):
            batch = ao.to_record_batch(out, step=s, schema=schema)
            writer.write_batch(batch, custom_metadata=ao.step_custom_metadata(batch))
    return path, steps


def _expected_sum_logprob(steps) -> dict[tuple[int, str], float]:
    # The sampled token's logprob is column 0 of each position's row.
    out = {}
    for s, o in enumerate(steps):
        cu = o.logprobs.cu_num_generated_tokens
        for i, rid in enumerate(o.req_ids):
            out[(s, rid)] = float(o.logprobs.logprobs[cu[i] : cu[i + 1], 0].sum())
    return out


def test_run_file_reads_in_polars(run_file):
    path, steps = run_file
    table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    df = pl.from_arrow(table)
    assert df.height == sum(len(o.req_ids) for o in steps)
    assert df["sampled_token_ids"].to_list() == [t for o in steps for t in o.sampled_token_ids]
    sums = df.select(
        "step",
        "req_id",
        pl.col("logprobs")
        .list.eval(pl.element().struct.field("logprobs").list.first())
        .list.sum()
        .alias("s"),
    ).rows()
    expected = _expected_sum_logprob(steps)
    assert {(s, r): pytest.approx(v, abs=1e-5) for s, r, v in sums} == expected
    # Polars reads the IPC file itself too (no ListView arrays in the format).
    direct = pl.read_ipc(str(path))
    assert direct["req_id"].to_list() == df["req_id"].to_list()
    assert direct["sampling_mask"].to_list() == df["sampling_mask"].to_list()


def test_run_file_queries_in_duckdb(run_file):
    path, steps = run_file
    table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    con = duckdb.connect()
    con.register("run", table)
    rows = con.sql(
        "select step, req_id, len(sampled_token_ids), len(logprobs), len(sampling_mask) "
        "from run order by step, req_index"
    ).fetchall()
    expected = [
        (s, rid, len(o.sampled_token_ids[i]), cu1 - cu0, cu1 - cu0)
        for s, o in enumerate(steps)
        for i, rid in enumerate(o.req_ids)
        for cu0, cu1 in [o.logprobs.cu_num_generated_tokens[i : i + 2]]
    ]
    assert rows == expected
    ((total,),) = con.sql("select count(*) from run where num_nans_in_logits = 0").fetchall()
    assert total == sum(1 for o in steps if o.req_ids)
