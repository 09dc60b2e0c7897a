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
# `make run` installs only what the main job needs: the tests' extras (dev, s3, ray) took another 33 s of a
# fresh install on a 2-core EPYC (2026-11-29).
RUN_STAMP := $(VENV)/.installed-run

.PHONY: install run test test-fast lint clean install-gpu run-gpu

$(RUN_STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .
	touch $(RUN_STAMP)

$(STAMP): $(RUN_STAMP)
	$(PY) -m pip install -q -e ".[dev,s3,ray]"
	touch $(STAMP)

install: $(STAMP)

run: $(RUN_STAMP)
	$(VENV)/bin/lora-rl train -c $(CONFIG)

test: install
	$(VENV)/bin/pytest -q

test-fast: install
	$(VENV)/bin/pytest -q -m "not slow"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# A GPU machine with internet: SGLang and the CUDA torch it pins (no CPU torch first), then a Qwen2.5-1.5B GSM8K run
# with SGLang launched beside the trainer. GPU_STAMP keeps the CPU and GPU installs of one checkout apart.
GPU_STAMP := $(VENV)/.installed-gpu
GPU_CONFIG ?= configs/qwen2.5-1.5b-gsm8k-gpu.yaml

$(GPU_STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[gpu,s3,ray,dev]"
	touch $(GPU_STAMP)

install-gpu: $(GPU_STAMP)

run-gpu: install-gpu
	$(VENV)/bin/lora-rl train -c $(GPU_CONFIG)

clean:
	rm -rf $(VENV) runs
