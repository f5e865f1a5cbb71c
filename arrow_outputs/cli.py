"""``arrow-outputs``: the command line (``demo``, ``inspect``, ``convert``, ``recover``,
``follow``, ``serve``, ``bench``).

Bad arguments and bad files give one line on stderr and a non-zero exit code (2 for usage,
1 for a file or a run that cannot be read), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from .errors import ArrowOutputsError

__all__ = ["main"]

PROG = "arrow-outputs"
BENCHMARKS = ("encode", "device", "masks", "handoff")
PARQUET_CODECS = ("none", "zstd", "snappy", "gzip", "lz4")


class _Failed(Exception):
    """A command's failure: printed as one line, exit code 1."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``arrow-outputs`` with ``argv`` (default: the process's); returns the exit code.

    Examples
    --------
    >>> import contextlib, io
    >>> with contextlib.redirect_stderr(io.StringIO()) as err:
    ...     main(["inspect", "no-such-run.arrows"])
    1
    >>> print(err.getvalue().split(", got")[0])
    arrow-outputs inspect: error: no-such-run.arrows: expected a readable run file
    """
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except BrokenPipeError:
        # The reader went away (`arrow-outputs inspect run.arrow | head`): stop quietly, as
        # the Python docs advise, without a second error when stdout is flushed at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except (ArrowOutputsError, OSError, _Failed) as e:
        print(f"{PROG} {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors as one line (and ``--help`` to say more)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(
        prog=PROG,
        description="vLLM model-runner outputs as Apache Arrow: run the demo engine, "
        "inspect, convert, recover and follow run files, serve them over Arrow Flight.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")

    p = command("demo", "run the embedded demo engine into a run file")
    _add_demo(p)

    p = command("inspect", "schema, steps, rows, completeness and a few rows")
    p.add_argument("file", help="a run file")
    p.add_argument("--rows", type=_count, default=5, metavar="N", help="rows to show (5)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--no-validate", action="store_true", help="trust the file (no validation)")
    p.set_defaults(run=_inspect)

    p = command("convert", "a run to IPC (re-written), Parquet or a dataset")
    p.add_argument("file", help="a run file")
    p.add_argument("--to", required=True, choices=("ipc", "parquet", "dataset"))
    p.add_argument("-o", "--out", required=True, help="output file (directory for dataset)")
    p.add_argument(
        "--compression",
        default=None,
        help="ipc: none|lz4|zstd (none); parquet/dataset: none|zstd|snappy|gzip|lz4 (zstd)",
    )
    p.add_argument("--format", choices=("stream", "file"), default="stream", help="ipc only")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=_convert)

    p = command("recover", "save every whole step of a run whose writer died")
    p.add_argument("file", help="the damaged run file")
    p.add_argument("-o", "--out", required=True, help="the recovered run file")
    p.add_argument("--format", choices=("stream", "file"), default="stream")
    p.set_defaults(run=_recover)

    p = command("follow", "print each step of a run while it is written")
    p.add_argument("file", help="a run file (it may not exist yet)")
    p.add_argument(
        "--idle-timeout", type=float, default=None, metavar="S",
        help="give up when the run stops growing for S seconds (default: wait)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="one JSON object per step")
    p.set_defaults(run=_follow)

    p = command("serve", "serve runs over Arrow Flight (DoPut, DoGet, live tail)")
    p.add_argument("--root", default="runs", help="directory of stored runs (./runs)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (loopback)")
    p.add_argument("--port", type=int, default=None, help="port (the server's default)")
    p.add_argument(
        "--token-env", default=None, metavar="VAR",
        help="require the bearer token held in environment variable VAR",
    )  # fmt: skip
    p.add_argument("--tls-cert", default=None, help="PEM certificate file (TLS)")
    p.add_argument("--tls-key", default=None, help="PEM private key file (TLS)")
    p.set_defaults(run=_serve)

    p = command("bench", "run the benchmarks (from a source checkout)")
    p.add_argument("which", nargs="*", help=f"any of {', '.join(BENCHMARKS)} (default: encode)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and rounds")
    p.set_defaults(run=_bench)
    return parser


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a count >= 0, got {value}")
    return value


# -- demo ------------------------------------------------------------------------------


def _add_demo(p: argparse.ArgumentParser) -> None:
    from .demo import add_arguments

    add_arguments(p)
    p.set_defaults(run=_demo)


def _demo(args: argparse.Namespace) -> int:
    from .demo.cli import run_from_args

    try:
        return run_from_args(args)
    except ImportError as e:
        # The demo is a torch model; `pip install arrow-outputs` alone does not bring torch.
        if (e.name or "").split(".")[0] != "torch":
            raise
        raise _Failed(
            "torch: expected torch installed to run the demo engine "
            f"(pip install 'arrow-outputs[torch]'), got {_one_line(e)}"
        ) from e


# -- inspect ---------------------------------------------------------------------------


def _inspect(args: argparse.Namespace) -> int:
    from .reader import open_run
    from .schema import run_metadata

    run = open_run(args.file, validate=not args.no_validate)
    shown: list[dict[str, Any]] = []
    for step in run:  # validates every step; shows the first rows
        if len(shown) < args.rows:
            shown.extend(_rows(step.batch, args.rows - len(shown)))
    steps = [s.step for s in (run[0], run[len(run) - 1])] if len(run) else []
    meta = run.schema.metadata or {}
    info: dict[str, Any] = {
        "file": args.file,
        "format": f"Arrow IPC {run.format}",
        "bytes": os.path.getsize(args.file),
        "complete": run.complete,
        "format_version": meta.get(b"arrow_outputs.version", b"?").decode("utf-8", "replace"),
        "producer": json.loads(meta.get(b"arrow_outputs.producer", b"{}") or b"{}"),
        "run_metadata": run_metadata(run.schema),
        "steps": len(run),
        "step_range": steps,
        "rows": run.num_rows,
        "dropped": run.end.dropped if run.end else None,
        "columns": {f.name: str(f.type) for f in run.schema},
        "first_rows": shown,
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    state = "complete" if run.complete else "INCOMPLETE (no end marker: see `recover`)"
    print(f"{args.file}: {info['format']}, {info['bytes']:,} bytes, {state}")
    print(f"format version {info['format_version']}, producer {info['producer']}")
    if info["run_metadata"]:
        print(f"run metadata: {json.dumps(info['run_metadata'])}")
    span = f" (step {steps[0]}..{steps[1]})" if steps else ""
    dropped = "" if run.end is None else f", dropped by the writer: {run.end.dropped}"
    print(f"steps: {len(run)}{span}, rows: {run.num_rows}{dropped}")
    print("columns:")
    for name, type_ in info["columns"].items():
        print(f"  {name}: {type_}")
    if shown:
        print(f"first {len(shown)} rows:")
        for row in shown:
            print("  " + "  ".join(f"{k}={v}" for k, v in row.items()))
    return 0


def _rows(batch: Any, n: int) -> list[dict[str, Any]]:
    """A few rows, shortened: ids and counts rather than whole logprob matrices."""
    import pyarrow.compute as pc

    part = batch.slice(0, n)
    lengths = {
        name: pc.list_value_length(part.column(name)).to_pylist()
        for name in ("logprobs", "sampling_mask")
    }
    out = []
    for i in range(part.num_rows):
        out.append(
            {
                "step": part.column("step")[i].as_py(),
                "req_id": part.column("req_id")[i].as_py(),
                "sampled_token_ids": part.column("sampled_token_ids")[i].as_py(),
                "logprob_positions": lengths["logprobs"][i],
                "mask_positions": lengths["sampling_mask"][i],
                "num_nans": part.column("num_nans_in_logits")[i].as_py(),
            }
        )
    return out


# -- convert / recover / follow ----------------------------------------------------------


def _convert(args: argparse.Namespace) -> int:
    from .reader import open_run, same_file

    compression = None if args.compression in (None, "none") else args.compression
    if args.to == "dataset":
        from .export import export_dataset

        if args.compression is None:
            (done,) = export_dataset([args.file], args.out)
        else:
            (done,) = export_dataset([args.file], args.out, compression=compression)
        print(f"{args.out}: run {done.name!r}, {done.steps} steps, {done.rows} rows (dataset)")
        return 0
    if same_file(args.file, args.out):
        # Writing truncates OUT while FILE is memory-mapped: the run would be lost (SIGBUS).
        raise _Failed(f"--out: expected a file other than {args.file}, got {args.out}, the same")
    run = open_run(args.file)
    bar = _progress(len(run), "convert", not args.no_progress)
    if args.to == "ipc":
        from .writer import OutputWriter

        if compression not in (None, "lz4", "zstd"):
            raise _Failed(f"--compression for ipc: expected none, lz4 or zstd, got {compression}")
        with OutputWriter(args.out, format=args.format, compression=compression) as writer:
            for step in run:
                writer.write(step.batch, custom_metadata=step.custom_metadata)
                bar.update(1)
    else:
        import pyarrow.parquet as pq

        # One Parquet file of the per-request rows; step-level metadata (connector outputs,
        # layouts) stays in the run file or a dataset export, which keep it losslessly.
        from .export import _relaxed, _relaxed_batch

        codec = "zstd" if args.compression is None else (compression or "none")
        if codec not in PARQUET_CODECS:
            raise _Failed(
                f"--compression for parquet: expected {', '.join(PARQUET_CODECS)}, got {codec}"
            )
        schema = _relaxed(run.schema, parquet=True)  # types any Parquet reader reads back
        with pq.ParquetWriter(args.out, schema, compression=codec) as writer:
            for step in run:
                writer.write_batch(_relaxed_batch(step.batch, schema))
                bar.update(1)
    bar.close()
    print(f"{args.out}: {len(run)} steps, {run.num_rows} rows ({args.to})")
    if args.to == "parquet":
        print("note: Parquet holds the per-request rows; use --to dataset or ipc to keep the "
              "step-level metadata too", file=sys.stderr)  # fmt: skip
    return 0


def _recover(args: argparse.Namespace) -> int:
    from .reader import recover

    report = recover(args.file, args.out, format=args.format)
    if report.complete:
        print(f"{args.out}: {report.steps} steps, {report.rows} rows; the run was complete")
        return 0
    print(
        f"{args.out}: recovered {report.steps} steps, {report.rows} rows; "
        f"lost {report.lost_bytes} bytes after the last whole step ({report.reason})"
    )
    return 0


def _follow(args: argparse.Namespace) -> int:
    import pyarrow.compute as pc

    from .reader import follow

    steps = rows = 0
    for step in follow(args.file, idle_timeout=args.idle_timeout):
        batch = step.batch
        tokens = pc.sum(pc.list_value_length(batch.column("sampled_token_ids"))).as_py() or 0
        steps, rows = steps + 1, rows + batch.num_rows
        record = {"step": step.step, "rows": batch.num_rows, "tokens": tokens}
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            print(f"step {record['step']}: {batch.num_rows} rows, {tokens} tokens", flush=True)
    if not args.json:
        print(f"run closed: {steps} steps, {rows} rows")
    return 0


# -- serve / bench ---------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    from .flight import serve

    token = None
    if args.token_env is not None:
        token = os.environ.get(args.token_env)
        if not token:
            raise _Failed(
                f"--token-env {args.token_env}: expected the token in environment variable "
                f"{args.token_env}, got {'an empty value' if token == '' else 'no such variable'}"
            )
    kw: dict[str, Any] = {}
    if args.port is not None:
        kw["port"] = args.port

    def ready(server: Any) -> None:
        auth = "token required" if token else "no token"
        print(f"serving {args.root} at {server.location} ({auth}); Ctrl-C stops", flush=True)

    serve(
        args.root,
        host=args.host,
        token=token,
        tls_cert=_read_file(args.tls_cert),
        tls_key=_read_file(args.tls_key),
        ready=ready,
        **kw,
    )
    return 0


def _read_file(path: str | None) -> bytes | None:
    if path is None:
        return None
    return Path(path).read_bytes()


def _bench(args: argparse.Namespace) -> int:
    default = Path(__file__).resolve().parent.parent / "benchmarks"
    root = Path(os.environ.get("ARROW_OUTPUTS_BENCHMARKS", default))
    which = args.which or ["encode"]
    unknown = [w for w in which if w not in BENCHMARKS]
    if unknown:
        raise _Failed(f"unknown benchmark {unknown[0]!r}: expected one of {', '.join(BENCHMARKS)}")
    for name in which:
        script = root / f"bench_{name}.py"
        if not script.is_file():
            raise _Failed(
                f"{script}: not found (the benchmarks ship with the source checkout; "
                "set ARROW_OUTPUTS_BENCHMARKS to their directory)"
            )
        cmd = [sys.executable, str(script), *(["--quick"] if args.quick else [])]
        print(f"$ {' '.join(cmd)}", flush=True)
        code = subprocess.call(cmd)
        if code:
            return code
    return 0


def _progress(total: int, desc: str, enabled: bool) -> Any:
    from .progress import progress_bar

    return progress_bar(total, desc, enabled=enabled and sys.stderr.isatty())


if __name__ == "__main__":
    sys.exit(main())
