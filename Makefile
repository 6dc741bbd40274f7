# One task runner. `make demo` and `make test` each build their own virtualenv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-fast lint typecheck bench chaos compose-check services clean

$(VENV)/.installed-base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(VENV)/.installed-base $@

## Run the demo on embedded defaults: no servers needed.
demo: $(VENV)/.installed-base
	$(PY) examples/demo.py

## Install everything, start the services the tests need if they are down, run every test.
test: $(VENV)/.installed-dev services
	$(PY) -m pytest

## Tests without the slow crash/restart ones.
test-fast: $(VENV)/.installed-dev services
	$(PY) -m pytest -m "not slow"

lint: $(VENV)/.installed-dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: $(VENV)/.installed-dev
	$(PY) -m mypy

## Throughput against plain Celery and celery-once, then the dead-letter sweep on PostgreSQL.
bench: $(VENV)/.installed-dev services
	$(PY) -m benchmarks.run
	$(PY) -m benchmarks.dlq_sweep

## Crashes, restarts and redelivery under load, then an audit: nothing runs twice, nothing is lost.
chaos: $(VENV)/.installed-dev services
	$(PY) -m chaos.run

## Validate docker-compose.yml with a real Compose implementation (no engine needed).
compose-check:
	bash scripts/check-compose.sh

services:
	bash scripts/ensure-services.sh

clean:
	rm -rf $(VENV) .demo .pytest_cache .mypy_cache .ruff_cache
