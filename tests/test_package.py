"""Packaging promises: no torch at import, typed, one explicit public API."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import arrow_outputs


def test_import_arrow_outputs_does_not_import_torch():
    code = "import sys, arrow_outputs; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_package_ships_py_typed():
    assert (Path(arrow_outputs.__file__).parent / "py.typed").is_file()


def test_all_names_exist_and_are_sorted_public():
    for name in arrow_outputs.__all__:
        assert hasattr(arrow_outputs, name), name
    public = {n for n in dir(arrow_outputs) if not n.startswith("_") and n[0].isupper()}
    assert public <= set(arrow_outputs.__all__)


def test_errors_share_one_base_class():
    for name in arrow_outputs.__all__:
        obj = getattr(arrow_outputs, name)
        if isinstance(obj, type) and issubclass(obj, Exception) and not issubclass(obj, Warning):
            assert issubclass(obj, arrow_outputs.ArrowOutputsError), name
