# persist-pipeline: the two commands a newcomer runs are `make run` and `make test`.
# Both create the virtualenv (.venv) from pyproject.toml themselves.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: run test lint typecheck proto proto-check ui clean help

help:
	@echo "make run    - run the end-to-end example on the embedded default (SQLite + local files)"
	@echo "make test   - create the environment and run the whole test suite (lint and types too)"
	@echo "make lint / typecheck / proto"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	DAGSTER_HOME="$${DAGSTER_HOME:-$(CURDIR)/.dagster_home}" $(PY) -m assets.run_demo

ui: $(STAMP)
	DAGSTER_HOME="$${DAGSTER_HOME:-$(CURDIR)/.dagster_home}" $(VENV)/bin/dagster dev \
		-w workspace.yaml -h 127.0.0.1 -p "$${DAGSTER_UI_PORT:-3000}"

test: $(STAMP) lint typecheck
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

proto: $(STAMP)
	$(PY) -m persist_pipeline.proto.generate

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
