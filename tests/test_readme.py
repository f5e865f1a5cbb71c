"""The README works as written: its Python runs, its make targets and links exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_python_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"^```python\n(.*?)^```", README, re.M | re.S)
    assert blocks
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md block {i + 1}", "exec"), {})
    assert (tmp_path / "run.arrows").exists()


def test_readme_make_targets_exist():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([a-z]+):", makefile, re.M))
    for target in set(re.findall(r"\bmake ([a-z]+)", README)):
        assert target in targets, target


def test_readme_links_exist():
    for link in re.findall(r"\]\(([^)#]+)\)", README):
        if not link.startswith("http"):
            assert (ROOT / link).exists(), link
    for path in re.findall(r"`((?:notebooks|docs|benchmarks)/[\w./-]+)`", README):
        assert (ROOT / path).exists(), path
