# One entry point for people and CI. `make test` and `make demo` set everything up first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch, pinned for development and tests (an unpinned torch pulls CUDA).
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: install test lint typecheck unit docs notebooks bench demo clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" --extra-index-url https://download.pytorch.org/whl/cpu
	$(PY) -m pip install -q -e ".[test,docs,notebooks]"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check arrow_outputs tests benchmarks
	$(VENV)/bin/ruff format --check arrow_outputs tests benchmarks

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(PY) -m pytest

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

notebooks: $(STAMP)
	$(PY) -m arrow_outputs._notebooks notebooks

test: lint typecheck unit docs notebooks

bench: $(STAMP)
	$(PY) benchmarks/bench_encode.py

demo: $(STAMP)
	$(PY) -m arrow_outputs.demo

clean:
	rm -rf $(VENV) site .pytest_cache .mypy_cache .ruff_cache .hypothesis
