# Lockstep: `make up` runs the platform locally, `make test` runs the suite (fresh clone OK).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: up test lint format venv clean test-ci image

# Where podman is installed, jobs run in the trainer's image (built here, offline, if it is
# missing or stale); elsewhere as plain processes, which the banner says are not isolated.
up: $(STAMP)
	@$(VENV)/bin/lockstep up --check  # a second make up stops here, before any build
	@if command -v podman >/dev/null 2>&1; then \
	  PY=$(PY) trainer/image/build.sh podman || echo "make up: the trainer image did not build; jobs will run as plain processes"; \
	fi
	$(VENV)/bin/lockstep up

# localhost/lockstep/trainer:<version> (docs/runtime.md); ENGINE=docker for Docker.
image: $(STAMP)
	PY=$(PY) trainer/image/build.sh $(or $(ENGINE),podman)

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
