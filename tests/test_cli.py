"""The ``arrow-outputs`` command line: every command, and one clear line for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_streaming import STEPS, assert_steps, write_run

import arrow_outputs as ao
from arrow_outputs.cli import main


@pytest.fixture
def run_path(tmp_path) -> Path:
    path = tmp_path / "run.arrows"
    write_run(path, run_metadata={"model": "toy"})
    return path


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "arrow_outputs", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_inspect_human_and_json(run_path, capsys):
    assert main(["inspect", str(run_path), "--rows", "2"]) == 0
    out = capsys.readouterr().out
    assert "complete" in out
    assert "steps: 5 (step 0..4), rows: 13" in out
    assert 'run metadata: {"model": "toy"}' in out
    assert "req_id=req-0-0" in out
    assert main(["inspect", str(run_path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["steps"] == 5
    assert info["rows"] == 13
    assert info["complete"] is True
    assert info["columns"]["req_id"] == "string"
    assert [r["req_id"] for r in info["first_rows"]] == [
        "req-0-0",
        "req-0-1",
        "req-0-2",
        "req-1-0",
        "req-1-1",
    ]


def test_inspect_reports_an_incomplete_run(run_path, tmp_path, capsys):
    data = run_path.read_bytes()
    cut = tmp_path / "cut.arrows"
    stream = pa.BufferReader(data)
    reader = pa.ipc.open_stream(stream)
    reader.read_next_batch()
    cut.write_bytes(data[: stream.tell()])  # one whole step, no end marker
    assert main(["inspect", str(cut)]) == 0
    assert "INCOMPLETE" in capsys.readouterr().out


def test_bad_files_and_arguments_give_one_line_and_no_traceback(run_path, tmp_path):
    garbage = tmp_path / "garbage.arrows"
    garbage.write_bytes(run_path.read_bytes()[:300])
    pq_out = str(tmp_path / "x.parquet")
    cases = [
        (["inspect", str(tmp_path / "missing.arrows")], 1),
        (["inspect", str(garbage)], 1),
        (["convert", str(garbage), "--to", "ipc", "-o", str(tmp_path / "x")], 1),
        (["convert", str(run_path), "--to", "ipc", "--compression", "gzip", "-o", "x"], 1),
        (["convert", str(run_path), "--to", "parquet", "--compression", "bogus", "-o", pq_out], 1),
        (["recover", str(tmp_path / "missing"), "-o", str(tmp_path / "x")], 1),
        (["bench", "nope"], 1),
        (["inspect", str(run_path), "--rows", "-1"], 2),
        (["convert", str(run_path), "--to", "csv", "-o", "x"], 2),
        (["no-such-command"], 2),
    ]
    for args, code in cases:
        result = cli(*args)
        assert result.returncode == code, (args, result.stderr)
        assert "Traceback" not in result.stderr, args
        assert result.stderr.strip(), args
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        if code == 1:
            assert result.stderr.startswith(f"arrow-outputs {args[0]}: error: ")
        else:
            assert "error:" in result.stderr
            assert "--help" in result.stderr
    assert not Path(pq_out).exists()  # a bad codec is refused before anything is written


def test_demo_without_torch_says_what_to_install(tmp_path):
    code = (
        "import sys; sys.modules['torch'] = None\n"  # as if torch were not installed
        "from arrow_outputs.cli import main\n"
        "sys.exit(main(sys.argv[1:]))"
    )
    out = tmp_path / "demo.arrow"
    result = subprocess.run(
        [sys.executable, "-c", code, "demo", "--no-progress", "--requests", "2", "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("arrow-outputs demo: error: torch: expected torch installed")
    assert "arrow-outputs[torch]" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_convert_and_recover_refuse_to_overwrite_their_input(run_path, capsys):
    data = run_path.read_bytes()
    for args in (
        ["convert", str(run_path), "--to", "ipc", "-o", str(run_path), "--no-progress"],
        ["convert", str(run_path), "--to", "parquet", "-o", str(run_path), "--no-progress"],
        ["recover", str(run_path), "-o", str(run_path)],
    ):
        assert main(args) == 1, args
        err = capsys.readouterr().err
        assert err.startswith(f"arrow-outputs {args[0]}: error: "), err
        assert "other than" in err, err
        assert "the same" in err, err
    assert run_path.read_bytes() == data


def test_convert_ipc_is_lossless(run_path, tmp_path, capsys):
    out = tmp_path / "out.arrow"
    args = ["convert", str(run_path), "--to", "ipc", "--format", "file", "--compression", "zstd"]
    assert main([*args, "-o", str(out), "--no-progress"]) == 0
    run = ao.open_run(out)
    assert run.format == "file"
    assert run.complete
    assert_steps(run.outputs())


def test_convert_parquet_holds_the_rows(run_path, tmp_path, capsys):
    out = tmp_path / "out.parquet"
    assert main(["convert", str(run_path), "--to", "parquet", "-o", str(out)]) == 0
    table = pq.read_table(out)
    want = ao.read_table(run_path)
    assert table.num_rows == want.num_rows == 13
    for name in ("req_id", "sampled_token_ids", "logprobs", "sampling_mask"):
        assert table.column(name).to_pylist() == want.column(name).to_pylist()
    assert "step-level metadata" in capsys.readouterr().err


def test_convert_dataset(run_path, tmp_path, capsys):
    duckdb = pytest.importorskip("duckdb")
    out = tmp_path / "ds"
    assert main(["convert", str(run_path), "--to", "dataset", "-o", str(out)]) == 0
    rows = duckdb.sql(
        f"select count(*) from read_parquet('{out}/rows/**/*.parquet', hive_partitioning=true)"
    ).fetchall()
    assert rows == [(13,)]


def test_recover(run_path, tmp_path, capsys):
    cut = tmp_path / "cut.arrows"
    cut.write_bytes(run_path.read_bytes()[:-500])
    out = tmp_path / "rec.arrows"
    assert main(["recover", str(cut), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "recovered" in printed
    assert "lost" in printed
    run = ao.open_run(out)
    assert run.complete
    assert_steps(run.outputs(), STEPS[: len(run)])


def test_follow_prints_each_step(run_path, capsys):
    assert main(["follow", str(run_path), "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 3, 4]
    assert [x["rows"] for x in lines] == [3, 5, 0, 4, 1]
    assert [x["tokens"] for x in lines] == [
        sum(len(t) for t in out.sampled_token_ids) for out in STEPS
    ]
    assert main(["follow", str(run_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "run closed: 5 steps, 13 rows"


def test_bench_needs_the_benchmarks(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ARROW_OUTPUTS_BENCHMARKS", str(tmp_path))
    assert main(["bench"]) == 1
    assert "ship with the source checkout" in capsys.readouterr().err
    (tmp_path / "bench_encode.py").write_text("import sys; print('ran', sys.argv[1:])\n")
    assert main(["bench", "encode", "--quick"]) == 0


def test_serve_requires_its_token_variable(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("AO_TEST_TOKEN", raising=False)
    assert main(["serve", "--root", str(tmp_path), "--token-env", "AO_TEST_TOKEN"]) == 1
    assert "AO_TEST_TOKEN" in capsys.readouterr().err


def test_help_for_every_command():
    for command in ("demo", "inspect", "convert", "recover", "follow", "serve", "bench"):
        result = cli(command, "--help")
        assert result.returncode == 0, command
        assert f"arrow-outputs {command}" in result.stdout


def test_cli_doc_lists_every_command_and_option():
    from arrow_outputs.cli import _parser

    doc = (Path(__file__).parent.parent / "docs" / "cli.md").read_text()
    sub = next(a for a in _parser()._actions if a.dest == "command")
    for name, parser in sub.choices.items():
        assert f"## {name}\n" in doc, name
        section = doc.split(f"## {name}\n")[1].split("\n## ")[0]
        for action in parser._actions:
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    assert option in section, (name, option)


def test_serve_runs_a_flight_server_that_takes_and_serves_runs(tmp_path):
    import signal

    from arrow_outputs.flight import FlightRunClient

    env = {**os.environ, "AO_TEST_TOKEN": "s3cret"}
    serve = ["serve", "--root", str(tmp_path), "--port", "0", "--token-env", "AO_TEST_TOKEN"]
    with subprocess.Popen(
        [sys.executable, "-m", "arrow_outputs", *serve],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as proc:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "token required" in line, line
        location = line.split(" at ")[1].split(" ")[0]
        with FlightRunClient(location, token="s3cret") as client:
            client.put("cli-run", STEPS)
            assert_steps(client.outputs("cli-run"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert_steps(ao.iter_outputs(tmp_path / "cli-run.arrows"))
