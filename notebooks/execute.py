"""Execute every notebook under a folder, with this interpreter as the kernel.

Usage::

    python notebooks/execute.py notebooks            # check: run each one, write nothing
    python notebooks/execute.py --write notebooks    # run each one, save its outputs

The notebooks are stored *with* their outputs, so they read well on a code host. Each
``*.ipynb`` (``.ipynb_checkpoints`` excluded) runs top to bottom with nbclient, one fresh
kernel per notebook, with a 300 s limit per cell. What runs is an in-memory copy of the
notebook, with a fresh temporary folder as its working directory: whatever it writes lands
there and is deleted afterwards.

Check mode (the test run) never touches the stored file. A notebook fails when a cell raises
or writes to stderr (a warning), when it has no code cells, when the stored file is larger
than 1 MB, or when it was not stored as a top-to-bottom run (a code cell without an
execution count, or counts out of order): run ``--write`` and commit the result.

``--write`` replaces each stored file with the executed one, only when every cell passed.
Cell timing metadata is not recorded, so a rerun changes only what the code prints.

One line per notebook reports its wall time; the exit status is 1 when any notebook fails
(its failing cell and error are printed), 2 when there is nothing to run.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nbformat
import zmq
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager, NoSuchKernel
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

KERNEL_NAME = "python3"
CELL_TIMEOUT_S = 300
MAX_BYTES = 1_000_000  # stored notebooks stay readable on a code host
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class ThisInterpreterKernelSpecs(KernelSpecManager):
    """Resolve the ``python3`` kernel to ipykernel running under ``sys.executable``.

    Jupyter's own lookup prefers a ``python3`` kernelspec found in the user's data folder
    (``~/.local/share/jupyter/kernels``) over the one of the running environment, and such a
    spec may start another Python. Building the spec from ipykernel here makes the kernel
    the interpreter that runs this script, and registers nothing anywhere.
    """

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        if kernel_name != KERNEL_NAME:
            raise NoSuchKernel(kernel_name)
        from ipykernel.kernelspec import RESOURCES, get_kernel_dict

        spec = get_kernel_dict()  # argv starts with sys.executable
        return KernelSpec(
            resource_dir=RESOURCES,
            argv=spec["argv"],
            display_name=spec["display_name"],
            language=spec["language"],
            metadata=spec.get("metadata", {}),
        )


def find_notebooks(root: Path) -> list[Path]:
    """The notebooks to run: ``root`` itself when it is a file, else every one below it."""
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def check_source(nb: Any) -> str | None:
    """Why a notebook cannot be run at all, or None."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    if not any(c.source.strip() for c in code):
        return "no code cells"
    return None


def check_stored(nb: Any, size: int) -> str | None:
    """Why a stored notebook is not a saved top-to-bottom run, or None."""
    if size > MAX_BYTES:
        return f"stored file is {size:,} bytes, over {MAX_BYTES:,}: make its outputs smaller"
    # nbclient skips empty code cells: they keep no execution count.
    code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    counts = [c.get("execution_count") for c in code]
    if counts != list(range(1, len(counts) + 1)):
        return (
            f"not stored as one top-to-bottom run (execution counts {counts}); "
            "run `python notebooks/execute.py --write <notebook>` and commit it"
        )
    return None


def execute(nb: Any, workdir: Path) -> str | None:
    """Run a notebook in place (its outputs replaced); return the error text, or None."""
    options: dict[str, Any] = {}
    if "transport_encryption" in KernelManager.class_trait_names() and zmq.has("curve"):
        # Encrypt the local sockets when libzmq can (ipykernel warns about plain TCP).
        options["transport_encryption"] = "auto"
    km = KernelManager(
        kernel_name=KERNEL_NAME, kernel_spec_manager=ThisInterpreterKernelSpecs(), **options
    )
    client = NotebookClient(
        nb,
        km=km,
        timeout=CELL_TIMEOUT_S,
        record_timing=False,  # timestamps in the stored file would change on every run
        resources={"metadata": {"path": str(workdir)}},
    )
    try:
        # cleanup_kc: nbclient shuts down only kernels it created itself, not one passed in.
        client.execute(cleanup_kc=True)
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as e:
        # nbclient's message holds the failing cell's source and its traceback.
        return _ANSI.sub("", str(e))
    return check_stderr(nb)


def check_stderr(nb: Any) -> str | None:
    """The first cell that wrote to stderr (a warning, usually), as an error, or None.

    Warnings fail the tests of this project; a notebook that warns today breaks tomorrow.
    """
    for i, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream" and output.get("name") == "stderr":
                return f"cell {i} wrote to stderr:\n{cell.source}\n------\n{output.text}"
    return None


def run_one(path: Path, *, write: bool) -> str | None:
    """Execute one notebook as a copy in a temporary folder; with ``write``, save it back."""
    stored_bytes = path.read_bytes()
    nb = nbformat.reads(stored_bytes.decode("utf-8"), as_version=4)
    try:
        nbformat.validate(nb)
    except nbformat.ValidationError as e:
        return f"not a valid nbformat 4 notebook: {e.message}"
    problem = check_source(nb)
    if problem is None and not write:
        problem = check_stored(nb, len(stored_bytes))
    if problem is not None:
        return problem
    run = copy.deepcopy(nb)
    with tempfile.TemporaryDirectory(prefix="nb-") as tmp:
        error = execute(run, Path(tmp))  # an in-memory copy, in a scratch working directory
    if error is not None:
        return error
    if write:
        text = nbformat.writes(run)
        if len(text.encode("utf-8")) > MAX_BYTES:
            return f"outputs take {len(text):,} bytes, over {MAX_BYTES:,}: not written"
        tmp_path = path.with_name(f".{path.name}.tmp")
        tmp_path.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
        os.replace(tmp_path, path)  # all or nothing: a failed write leaves the old file
    elif path.read_bytes() != stored_bytes:
        return "the stored notebook changed while it ran (nothing may write to it)"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="folder searched for *.ipynb (or one notebook)")
    parser.add_argument(
        "--write", action="store_true", help="save each executed notebook over its stored file"
    )
    args = parser.parse_args(argv)
    notebooks = find_notebooks(args.folder)
    if not notebooks:
        print(f"no notebooks under {args.folder}", file=sys.stderr)
        return 2
    print(f"kernel: {KERNEL_NAME} on {sys.executable}")
    failures = 0
    for path in notebooks:
        start = time.perf_counter()
        error = run_one(path, write=args.write)
        wall = time.perf_counter() - start
        status = "FAIL" if error else ("saved" if args.write else "ok   ")
        print(f"{status} {path}  {wall:.1f} s", flush=True)
        if error:
            failures += 1
            print(error, file=sys.stderr, flush=True)
    if failures:
        print(f"{failures} of {len(notebooks)} notebooks failed", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
