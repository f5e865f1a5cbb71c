# One entry point for people and CI. `make test` and `make demo` set everything up first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch, pinned for development and tests (an unpinned torch pulls CUDA).
TORCH  := torch==2.13.0
# Extra pip arguments for that install, e.g. a CPU wheel index where pip does not find one.
TORCH_PIP_ARGS ?=
STAMP  := $(VENV)/.installed
# The C accelerator must build here (a failed compile fails the install instead of falling back
# to pure Python quietly); tests/test_speedups.py checks it imported. Override with =0.
export ARROW_OUTPUTS_REQUIRE_SPEEDUPS ?= 1

.PHONY: install demo test lint typecheck unit docs notebooks notebooks-write bench bench-all clean

# setup.py and the compiled sources too: `pip install -e .` is what recompiles them.
# arrow_outputs._arrowbridge compiles against pyarrow's C++ library and loads only into that
# very version: pyarrow goes in first and the build uses it (no build isolation).
$(STAMP): pyproject.toml setup.py arrow_outputs/_speedups.c arrow_outputs/_arrowbridge.cc
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" $(TORCH_PIP_ARGS)
	$(PY) -m pip install -q "setuptools>=77" "pyarrow>=19"
	$(PY) -m pip install -q --no-build-isolation -e ".[test,docs,notebooks]"
	touch $(STAMP)

install: $(STAMP)

# The main job: the embedded demo engine streams a run into an Arrow file, then summarises it.
demo: $(STAMP)
	$(VENV)/bin/arrow-outputs demo $(DEMO_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check arrow_outputs tests benchmarks notebooks/execute.py setup.py
	$(VENV)/bin/ruff format --check arrow_outputs tests benchmarks notebooks/execute.py setup.py

typecheck: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(PY) -m pytest

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

notebooks: $(STAMP)
	$(PY) notebooks/execute.py notebooks

# Re-run the notebooks and save their outputs into the stored files (they are kept with outputs).
notebooks-write: $(STAMP)
	$(PY) notebooks/execute.py --write notebooks

test: lint typecheck unit docs notebooks

# The codec's C and pure-Python paths against pickle, in one run (~1-2 min); every figure
# goes to bench-encode.json too. Narrow it with BENCH_ARGS="--quick" or "--path python".
bench: $(STAMP)
	$(PY) benchmarks/bench_encode.py --json bench-encode.json $(BENCH_ARGS)

# Every benchmark into bench-out/, then the plot of docs/performance.md (about 10 min on 2 cores).
bench-all: $(STAMP)
	mkdir -p bench-out
	$(PY) benchmarks/bench_encode.py --json bench-out/encode.json
	$(PY) benchmarks/bench_device.py --json bench-out/device.json
	$(PY) benchmarks/bench_masks.py --json bench-out/masks.json
	$(PY) benchmarks/bench_handoff.py --json bench-out/handoff.json
	$(PY) benchmarks/plot_performance.py bench-out docs/performance.png

clean:
	rm -rf $(VENV) site build .pytest_cache .mypy_cache .ruff_cache .hypothesis arrow_outputs/*.so
