"""The ``demo`` command's arguments and entry point (argparse; torch loads only to run)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from ..errors import ArrowOutputsError

__all__ = ["add_arguments", "main", "run_from_args"]

DEFAULT_OUT = "demo-run.arrow"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the demo's options to ``parser`` (a CLI's ``demo`` subcommand parser)."""
    from .config import DemoConfig

    d = DemoConfig()
    parser.add_argument(
        "--requests",
        type=int,
        default=d.num_requests,
        metavar="N",
        help=f"requests in the workload (default {d.num_requests})",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=d.max_steps,
        metavar="N",
        help=f"engine steps at most (default {d.max_steps})",
    )
    parser.add_argument(
        "--device",
        default=d.device,
        help="'cpu' (default) or 'cuda[:N]' (outputs cross through pinned staging)",
    )
    parser.add_argument(
        "--seed", type=int, default=d.seed, help="seed of weights, workload, sampler"
    )
    parser.add_argument(
        "--out",
        "-o",
        default=DEFAULT_OUT,
        metavar="PATH",
        help=f"the run file to write (default {DEFAULT_OUT})",
    )
    parser.add_argument(
        "--compression", choices=("lz4", "zstd"), default=None, help="IPC buffer compression"
    )
    parser.add_argument(
        "--spec-tokens",
        type=int,
        default=d.num_speculative_tokens,
        metavar="K",
        help=f"speculative draft tokens per step, 0 for none (default {d.num_speculative_tokens})",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    return parser


def run_from_args(args: argparse.Namespace) -> int:
    """Run the demo for parsed arguments; prints the summary. Returns the exit code (an
    ``ArrowOutputsError`` or an unwritable path gives one line on stderr and 2)."""
    try:
        from .engine import run_demo

        summary = run_demo(
            args.out,
            num_requests=args.requests,
            max_steps=args.steps,
            device=args.device,
            seed=args.seed,
            progress=not args.no_progress,
            compression=args.compression,
            num_speculative_tokens=args.spec_tokens,
        )
    except (ArrowOutputsError, OSError) as e:
        print(f"arrow-outputs demo: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary.to_dict(), indent=2) if args.json else summary.format())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``arrow-outputs demo [options]``: run the demo, print its summary; the exit code.

    Examples
    --------
    >>> import contextlib, io
    >>> with contextlib.redirect_stderr(io.StringIO()) as err:
    ...     main(["--requests", "0", "--no-progress"])
    2
    >>> err.getvalue().strip()
    'arrow-outputs demo: error: DemoConfig.num_requests: expected an int >= 1, got 0'
    """
    parser = add_arguments(
        argparse.ArgumentParser(
            prog="arrow-outputs demo",
            description="Run the embedded demo engine into an Arrow IPC file and summarise it.",
        )
    )
    return run_from_args(parser.parse_args(argv))
