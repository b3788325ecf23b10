# Lockstep: `make up` runs the platform locally, `make test` runs the suite (fresh clone OK).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: up test lint format venv clean test-ci

up: $(STAMP)
	$(VENV)/bin/lockstep up

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

venv: $(STAMP)

# torch==2.13.0 first where no torch is present: the CPU wheel on this machine's disk. A plain
# range with no torch installed would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check jobs teams portal nodeagent trainer tests

format: $(STAMP)
	$(PY) -m ruff format jobs teams portal nodeagent trainer tests

clean:
	rm -rf $(VENV) var
