# phalanx: `make demo` and `make test` each create .venv if missing and install the project.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.phalanx-installed
# pytest workers of make test (the machine CI runs on has 2 cores)
JOBS ?= 2

.PHONY: demo test test-fast test-integration test-torch test-cuda lint format bench drill drill-exit clean install

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev,viz]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/phalanx train configs/digits_cnn.toml --nproc 2

test: $(STAMP)
	$(BIN)/ruff check src tests examples tools
	$(BIN)/ruff format --check src tests examples tools
	$(BIN)/mypy
	$(BIN)/python -m pytest -q --durations=20 -n $(JOBS) --dist worksteal tests

test-fast: $(STAMP)
	$(BIN)/ruff check src tests examples tools
	$(BIN)/python -m pytest -q -n $(JOBS) -m "unit and not slow" tests

test-integration: $(STAMP)
	$(BIN)/python -m pytest -q -m integration tests/integration

# The unit and integration tiers under another supported torch, in a venv of its own:
# make test-torch TORCH_ALT=torch==2.14.1 (the whole suite: make test VENV=... TORCH=...)
TORCH_ALT ?= torch==2.11.0
ALT_VENV ?= .venv-$(subst ==,-,$(TORCH_ALT))
test-torch:
	$(MAKE) install VENV=$(ALT_VENV) TORCH="$(TORCH_ALT)"
	$(ALT_VENV)/bin/python -m pytest -q -n $(JOBS) --dist worksteal -m "unit or integration" tests

# On a machine with a GPU, in an environment that has torch (no venv is made: GPU machines often
# cannot download): the CUDA-only tests and the benchmarks' GPU parts, report in cuda-report.md.
test-cuda:
	$(PYTHON) tools/test_cuda.py --out cuda-report.md

lint: $(STAMP)
	$(BIN)/ruff check src tests examples tools
	$(BIN)/ruff format --check src tests examples tools
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format src tests examples tools
	$(BIN)/ruff check --fix src tests examples tools

bench: $(STAMP)
	$(BIN)/phalanx bench exchange --nproc 2

drill: $(STAMP)
	$(BIN)/python tools/fault_drill.py --repeats 3

# clean exits over many short jobs: make drill-exit EXIT_JOBS=200
EXIT_JOBS ?= 50
drill-exit: $(STAMP)
	$(BIN)/python tools/exit_drill.py --jobs $(EXIT_JOBS) --concurrent 2

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache .mypy_cache
