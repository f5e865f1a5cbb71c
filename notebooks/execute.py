"""Execute every notebook under a folder, in memory, with this interpreter as the kernel.

Usage::

    python notebooks/execute.py notebooks

Each ``*.ipynb`` (``.ipynb_checkpoints`` excluded) runs top to bottom with nbclient, one
fresh kernel per notebook, in the notebook's own folder, with a 300 s limit per cell. The
outputs stay in memory: nothing is written back, so the repository stays clean. One line
per notebook reports its wall time; the exit status is 1 when any notebook fails (its
failing cell and error are printed), 2 when there is nothing to run.

A notebook fails when a cell raises or writes to stderr (a warning), when it has no code
cells, or when it was committed with outputs (clear them before committing: the stored
notebooks are sources).
"""

from __future__ import annotations

import argparse
import re
import sys
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
    """Why a stored notebook cannot be run as it is, or None."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    if not any(c.source.strip() for c in code):
        return "no code cells"
    stored = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.get("outputs")]
    if stored:
        return f"stored with outputs (cells {stored}); clear them before committing"
    return None


def execute(path: Path) -> str | None:
    """Run one notebook in memory; return the error text, or None when every cell passed."""
    nb = nbformat.read(path, as_version=4)
    try:
        nbformat.validate(nb)
    except nbformat.ValidationError as e:
        return f"not a valid nbformat 4 notebook: {e.message}"
    problem = check_source(nb)
    if problem is not None:
        return problem
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
        resources={"metadata": {"path": str(path.parent.resolve())}},
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="folder searched for *.ipynb (or one notebook)")
    args = parser.parse_args(argv)
    notebooks = find_notebooks(args.folder)
    if not notebooks:
        print(f"no notebooks under {args.folder}", file=sys.stderr)
        return 2
    print(f"kernel: {KERNEL_NAME} on {sys.executable}")
    failures = 0
    for path in notebooks:
        start = time.perf_counter()
        error = execute(path)
        wall = time.perf_counter() - start
        print(f"{'FAIL' if error else 'ok  '} {path}  {wall:.1f} s", flush=True)
        if error:
            failures += 1
            print(error, file=sys.stderr, flush=True)
    if failures:
        print(f"{failures} of {len(notebooks)} notebooks failed", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
