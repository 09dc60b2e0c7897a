# `make run`: install, fetch the model, train on the embedded default config.
# `make test`: install, run the tests. Both are idempotent on a fresh machine.
# `make test-fast`: the tests not marked slow (no subprocesses, servers, spawn workers or Prefect).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU torch first (a plain `torch` pulls GBs of CUDA wheels); override for a GPU build.
TORCH_SPEC ?= torch==2.13.0
CONFIG ?= configs/smollm2-arith-grpo.yaml
STAMP := $(VENV)/.installed

.PHONY: install run test test-fast lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,s3,ray]"
	touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/lora-rl train -c $(CONFIG)

test: install
	$(VENV)/bin/pytest -q

test-fast: install
	$(VENV)/bin/pytest -q -m "not slow"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) runs
