"""arrow_outputs.export: runs to a partitioned Parquet / IPC dataset, read by DuckDB and Polars,
and back to the exact outputs."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.dataset as ds
import pytest
from conftest import write_stream_lying_about_rows
from test_batch import (
    CASES,
    _decode_int32,
    _decode_requests,
    _decode_step,
    _empty,
    _speculative,
)

import arrow_outputs as ao
from arrow_outputs.export import (
    ExportedRun,
    check_run_name,
    export_dataset,
    iter_exported_outputs,
    open_exported,
)
from arrow_outputs.reader import open_run
from arrow_outputs.writer import OutputWriter

FORMATS = ["parquet", "ipc"]
EXT = {"parquet": "parquet", "ipc": "arrow"}


def _write_run(path: Path, outputs: list[ao.ModelRunnerOutput], **kw) -> Path:
    with OutputWriter(path, **kw) as writer:
        for out in outputs:
            writer.write(out)
    return path


def _decode(n_req: int, seed: int) -> ao.ModelRunnerOutput:
    return _decode_requests(n_req, seed, width=3)


@pytest.fixture
def two_runs(tmp_path):
    a = [_decode(3, 0), _speculative(), _empty(), _decode(2, 3)]
    b = [_decode(4, 5), _decode(1, 6)]
    return {
        "a": (_write_run(tmp_path / "a.arrows", a), a),
        "b": (_write_run(tmp_path / "b.arrows", b), b),
    }


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("make", CASES, ids=lambda f: f.__name__.strip("_"))
def test_export_dataset_round_trips_every_case(make, fmt, tmp_path):
    outputs = [make(), make()]
    src = _write_run(tmp_path / "case.arrows", outputs)
    (done,) = export_dataset([src], tmp_path / "out", format=fmt)
    assert done == ExportedRun("case", str(src.resolve()), 2, 2 * len(outputs[0].req_ids), True)
    back = list(iter_exported_outputs(tmp_path / "out", "case", format=fmt))
    assert len(back) == 2
    for want, got in zip(outputs, back):
        ao.assert_outputs_equal(want, got)


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_dataset_layout_is_hive_partitioned_by_run(two_runs, fmt, tmp_path):
    out = tmp_path / "out"
    done = export_dataset({n: p for n, (p, _) in two_runs.items()}, out, format=fmt)
    assert [(r.name, r.steps, r.rows, r.complete) for r in done] == [
        ("a", 4, 9, True),
        ("b", 2, 5, True),
    ]
    for table in ("rows", "steps", "runs"):
        assert sorted(p.name for p in (out / table).iterdir()) == ["run=a", "run=b"]
        assert all(f.suffix == f".{EXT[fmt]}" for f in (out / table).rglob("*") if f.is_file())
    assert not [p for p in out.iterdir() if p.name.startswith("_staging")]
    # The partition column comes from the directories; the files do not repeat it.
    rows = open_exported(out, format=fmt).to_table()
    assert rows.num_rows == 14
    assert rows.schema.names[-2:] == ["step_index", "run"]
    for name, (path, _) in two_runs.items():
        ours = rows.filter(pa.compute.equal(rows["run"], name)).sort_by(
            [("step_index", "ascending"), ("req_index", "ascending")]
        )
        source = open_run(path).read_all()
        for column in ("step", "req_id", "sampled_token_ids", "logprobs", "sampling_mask"):
            assert ours[column].to_pylist() == source[column].to_pylist(), column


def test_export_dataset_duckdb_queries_rows_steps_and_runs(two_runs, tmp_path):
    out = tmp_path / "out"
    export_dataset([p for p, _ in two_runs.values()], out)
    con = duckdb.connect()
    glob = f"read_parquet('{out}/{{}}/**/*.parquet', hive_partitioning = true)"
    per_run = con.sql(
        f"""select run, count(*) as n, sum(len(sampled_token_ids)) as tokens,
                   sum(logprobs[1].rank) as rank_sum
            from {glob.format("rows")} group by run order by run"""
    ).fetchall()
    expected = []
    for name, (_, outputs) in sorted(two_runs.items()):
        tokens = sum(len(ids) for o in outputs for ids in o.sampled_token_ids)
        rank_sum = 0
        for o in outputs:
            if o.logprobs is None or not o.req_ids:
                continue
            cu = o.logprobs.cu_num_generated_tokens or list(range(len(o.req_ids) + 1))
            # DuckDB lists are 1-based; a request with no positions has no logprobs[1].
            ranks = o.logprobs.sampled_token_ranks
            rank_sum += sum(int(ranks[cu[i]]) for i in range(len(cu) - 1) if cu[i + 1] > cu[i])
        expected.append((name, sum(len(o.req_ids) for o in outputs), tokens, rank_sum))
    assert per_run == expected
    # Step-level facts: one row per step, the 0-row step included, joined on step_index.
    steps = con.sql(
        f"""select s.run, s.step_index, s.step, s.rows,
                   json_extract(s.step_json, '$.step')::bigint as json_step,
                   (select count(*) from {glob.format("rows")} r
                    where r.run = s.run and r.step_index = s.step_index) as counted
            from {glob.format("steps")} s order by s.run, s.step_index"""
    ).fetchall()
    assert [(r[0], r[1], r[2], r[3]) for r in steps] == [
        ("a", 0, 0, 3),
        ("a", 1, 1, 4),
        ("a", 2, 2, 0),
        ("a", 3, 3, 2),
        ("b", 0, 0, 4),
        ("b", 1, 1, 1),
    ]
    assert all(r[4] == r[2] and r[5] == r[3] for r in steps)
    runs = con.sql(
        f"select run, steps, rows, complete, schema_metadata from {glob.format('runs')} "
        "order by run"
    ).fetchall()
    assert [r[:4] for r in runs] == [("a", 4, 9, True), ("b", 2, 5, True)]
    assert json.loads(runs[0][4])["arrow_outputs.format"] == ao.FORMAT_NAME


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_dataset_polars_scans_with_hive_partitions(two_runs, fmt, tmp_path):
    out = tmp_path / "out"
    export_dataset([p for p, _ in two_runs.values()], out, format=fmt)
    pattern = f"{out}/rows/**/*.{EXT[fmt]}"
    scan = pl.scan_parquet if fmt == "parquet" else pl.scan_ipc
    frame = (
        scan(pattern, hive_partitioning=True)
        .filter(pl.col("run") == "b")
        .sort("step_index", "req_index")
        .select("step", "req_id", "sampled_token_ids")
        .collect()
    )
    source = open_run(two_runs["b"][0]).read_all()
    assert frame["req_id"].to_list() == source["req_id"].to_pylist()
    assert frame["sampled_token_ids"].to_list() == source["sampled_token_ids"].to_pylist()
    tokens = (
        scan(pattern, hive_partitioning=True)
        .group_by("run")
        .agg(pl.col("sampled_token_ids").list.len().sum().alias("tokens"))
        .sort("run")
        .collect()
    )
    assert tokens.rows() == [("a", 11), ("b", 5)]  # speculative steps sample several


def test_export_dataset_duckdb_reads_ipc_through_pyarrow_dataset(two_runs, tmp_path):
    out = tmp_path / "out"
    export_dataset([p for p, _ in two_runs.values()], out, format="ipc")
    rows = open_exported(out, format="ipc")  # noqa: F841 - DuckDB finds it by name
    got = duckdb.sql("select run, count(*) from rows group by run order by run").fetchall()
    assert got == [("a", 9), ("b", 5)]


def test_export_dataset_step_blocks_split_long_runs(tmp_path):
    outputs = [_decode(2, s) for s in range(7)]
    src = _write_run(tmp_path / "long.arrows", outputs)
    out = tmp_path / "out"
    export_dataset([src], out, partitioning=("run", "step_block"), step_block_size=3)
    blocks = sorted(p.name for p in (out / "rows" / "run=long").iterdir())
    assert blocks == ["step_block=0", "step_block=1", "step_block=2"]
    rows = open_exported(out).to_table(columns=["step_index", "step_block"])
    assert all(
        i // 3 == b for i, b in zip(rows["step_index"].to_pylist(), rows["step_block"].to_pylist())
    )
    back = list(iter_exported_outputs(out, "long"))
    for want, got in zip(outputs, back, strict=True):
        ao.assert_outputs_equal(want, got)


def test_export_dataset_adds_runs_and_refuses_one_already_there(two_runs, tmp_path):
    out = tmp_path / "out"
    export_dataset([two_runs["a"][0]], out)
    export_dataset([two_runs["b"][0]], out)  # adding a run to the directory
    assert open_exported(out, "runs").to_table()["run"].to_pylist() == ["a", "b"]
    with pytest.raises(ao.ConsistencyError, match=r"sources: .*'a', which is there"):
        export_dataset([two_runs["a"][0]], out)
    assert open_exported(out).count_rows() == 14  # nothing written twice


def test_export_dataset_refuses_other_column_types_in_one_directory(tmp_path):
    out = tmp_path / "out"
    export_dataset([_write_run(tmp_path / "i64.arrows", [_decode_step()])], out)
    i32 = _write_run(tmp_path / "i32.arrows", [_decode_int32()])
    with pytest.raises(ao.SchemaMismatchError, match=r"run\[i32\]\.schema"):
        export_dataset([i32], out)
    assert not (out / "runs" / "run=i32").exists()
    export_dataset([i32], tmp_path / "elsewhere")


def test_export_dataset_refuses_a_directory_of_the_other_format(two_runs, tmp_path):
    out = tmp_path / "out"
    export_dataset([two_runs["a"][0]], out, format="parquet")
    with pytest.raises(ao.SchemaMismatchError, match=r"^out_dir: expected ipc files"):
        export_dataset([two_runs["b"][0]], out, format="ipc")
    assert not (out / "runs" / "run=b").exists()


def test_export_dataset_failure_leaves_no_part_of_the_run(tmp_path):
    # A source whose third step lies about its rows: the run is refused whole.
    good = _decode(2, 0)
    batches = [ao.to_record_batch(good, step=s) for s in range(3)]
    path = tmp_path / "bad.arrows"
    write_stream_lying_about_rows(path, batches, at=2)
    out = tmp_path / "out"
    with pytest.raises(ao.ArrowOutputsError, match="rows"):
        export_dataset({"bad": path}, out)
    assert sorted(p.name for p in out.iterdir()) == []


def test_export_dataset_incomplete_run_is_marked(tmp_path):
    # Written without OutputWriter's end marker: a run whose writer died.
    outputs = [_decode(2, s) for s in range(3)]
    batches = [ao.to_record_batch(o, step=s) for s, o in enumerate(outputs)]
    path = tmp_path / "cut.arrows"
    with (
        pa.OSFile(str(path), "wb") as sink,
        pa.ipc.new_stream(sink, ao.run_schema(batches[0])) as w,
    ):
        for b in batches:
            w.write_batch(b, custom_metadata=ao.step_custom_metadata(b))
    (done,) = export_dataset([path], tmp_path / "out")
    assert (done.steps, done.complete) == (3, False)
    runs = open_exported(tmp_path / "out", "runs").to_table()
    assert runs["complete"].to_pylist() == [False]
    for want, got in zip(outputs, iter_exported_outputs(tmp_path / "out", "cut"), strict=True):
        ao.assert_outputs_equal(want, got)


def test_export_dataset_keeps_run_metadata(tmp_path):
    src = _write_run(tmp_path / "m.arrows", [_decode_step()], run_metadata={"model": "tiny"})
    export_dataset([src], tmp_path / "out")
    runs = open_exported(tmp_path / "out", "runs").to_table()
    meta = json.loads(runs["schema_metadata"][0].as_py())
    assert json.loads(meta["arrow_outputs.run"]) == {"model": "tiny"}
    schema = pa.ipc.read_schema(pa.py_buffer(runs["arrow_schema"][0].as_py()))
    assert ao.run_metadata(schema) == {"model": "tiny"}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"format": "csv"}, "format: expected 'parquet' or 'ipc'"),
        ({"partitioning": ("step",)}, "partitioning: expected"),
        ({"partitioning": "run"}, "partitioning: expected a tuple"),
        ({"step_block_size": 0}, "step_block_size"),
        ({"format": "ipc", "compression": "snappy"}, "compression"),
        ({"max_rows_per_file": 0}, "max_rows_per_file"),
    ],
)
def test_export_dataset_refuses_bad_options(kwargs, match, tmp_path):
    src = _write_run(tmp_path / "x.arrows", [_decode_step()])
    with pytest.raises(ao.ArrowOutputsError, match=match):
        export_dataset([src], tmp_path / "out", **kwargs)


@pytest.mark.parametrize("name", ["../up", "a/b", "", ".hidden", "x" * 129, "run=1", "ü"])
def test_export_dataset_refuses_run_names_that_are_not_plain(name, tmp_path):
    src = _write_run(tmp_path / "x.arrows", [_decode_step()])
    with pytest.raises(ao.UnsupportedValueError, match=r"^run: expected a run name"):
        export_dataset({name: src}, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_dataset_refuses_duplicate_names_and_non_paths(tmp_path):
    src = _write_run(tmp_path / "x.arrows", [_decode_step()])
    with pytest.raises(ao.ConsistencyError, match="'x' twice"):
        export_dataset([src, tmp_path / "x.arrows"], tmp_path / "out")
    with pytest.raises(ao.FieldTypeError, match="sources"):
        export_dataset([42], tmp_path / "out")
    with pytest.raises(ao.FieldTypeError, match="sources"):
        export_dataset(3.5, tmp_path / "out")


def test_iter_exported_outputs_refuses_unknown_run_and_tampered_steps(two_runs, tmp_path):
    out = tmp_path / "out"
    export_dataset([two_runs["b"][0]], out)
    with pytest.raises(ao.ConsistencyError, match="'nope'"):
        list(iter_exported_outputs(out, "nope"))
    with pytest.raises(ao.UnsupportedValueError):
        list(iter_exported_outputs(out, "../b"))
    # Swap the step JSON of the two steps: their row counts no longer match their batches.
    steps_file = next((out / "steps" / "run=b").glob("*.parquet"))
    table = ds.dataset(steps_file).to_table()
    swapped = table.set_column(
        table.schema.get_field_index("step_json"),
        "step_json",
        pa.array(table["step_json"].to_pylist()[::-1], pa.string()),
    )
    import pyarrow.parquet as pq

    pq.write_table(swapped, steps_file)
    with pytest.raises(ao.ArrowOutputsError):
        list(iter_exported_outputs(out, "b"))


def test_check_run_name_accepts_plain_names():
    for name in ("a", "run-1", "llama_3.1-8b", "X" * 128):
        assert check_run_name(name) == name
    with pytest.raises(ao.FieldTypeError, match="run: expected a str"):
        check_run_name(b"a")


def test_export_dataset_rows_values_are_the_source_values(tmp_path):
    # Values, not only counts: logprob matrices come back bit for bit through Parquet.
    out_ = _decode(5, 9)
    src = _write_run(tmp_path / "v.arrows", [out_])
    export_dataset([src], tmp_path / "out")
    (back,) = iter_exported_outputs(tmp_path / "out", "v")
    assert np.array_equal(back.logprobs.logprobs, out_.logprobs.logprobs)
    assert np.array_equal(back.logprobs.logprob_token_ids, out_.logprobs.logprob_token_ids)


def _list_rows_under_nulls(arr: pa.Array, hidden: np.ndarray | None = None) -> int:
    """How many list rows that are null (their own or a parent's) still hold values."""
    if pa.types.is_struct(arr.type):
        null = ~arr.is_valid().to_numpy(zero_copy_only=False)
        if hidden is not None:
            null |= hidden
        return sum(_list_rows_under_nulls(arr.field(i), null) for i in range(arr.type.num_fields))
    if pa.types.is_list(arr.type):
        null = ~arr.is_valid().to_numpy(zero_copy_only=False)
        if hidden is not None:
            null |= hidden
        lengths = np.diff(arr.offsets.to_numpy(zero_copy_only=False))
        return int((null & (lengths > 0)).sum())
    return 0


@pytest.mark.parametrize("make", CASES, ids=lambda f: f.__name__.strip("_"))
def test_parquet_export_holds_types_every_pyarrow_reads_back(make, tmp_path):
    # pyarrow 15-25 cannot read a null fixed-size-list row back from Parquet, and their writers
    # refuse a null list row that holds values: the rows are written as plain lists, empty
    # under every null row, and iter_exported_outputs restores the run's types.
    import pyarrow.parquet as pq

    outputs = [make(), make()]
    src = _write_run(tmp_path / "case.arrows", outputs)
    export_dataset([src], tmp_path / "out", format="parquet")
    files = list((tmp_path / "out" / "rows").rglob("*.parquet"))
    if not outputs[0].req_ids:  # steps without rows write no rows file
        assert files == []
        return
    (rows_file,) = files
    table = pq.read_table(rows_file)

    def kinds(t: pa.DataType) -> set[str]:
        if isinstance(t, pa.BaseExtensionType):
            return {"extension"} | kinds(t.storage_type)
        out = {"fixed_size_list"} if pa.types.is_fixed_size_list(t) else set()
        for i in range(t.num_fields):
            out |= kinds(t.field(i).type)
        return out

    assert not set().union(*(kinds(f.type) for f in table.schema))
    for name in table.column_names:
        assert _list_rows_under_nulls(table.column(name).combine_chunks()) == 0, name


def test_parquet_export_refuses_a_tensor_shape_of_the_wrong_size(tmp_path):
    # A list written for a fixed-size list must hold exactly its size in every non-null row.
    from arrow_outputs.export import _restored

    target = pa.list_(pa.int32(), 2)
    good = pa.array([[1, 2], None, [3, 4]], pa.list_(pa.int32()))
    back = _restored(good, target, "run[x].rows.pooler_output.shape")
    assert back.type == target
    assert back.to_pylist() == [[1, 2], None, [3, 4]]
    assert back.values.to_pylist() == [1, 2, 0, 0, 3, 4]  # zeros under the null row
    bad = pa.array([[1, 2], [3]], pa.list_(pa.int32()))
    with pytest.raises(
        ao.SchemaMismatchError, match=r"^run\[x\]\.rows\.pooler_output\.shape: expected 2 values"
    ):
        _restored(bad, target, "run[x].rows.pooler_output.shape")
