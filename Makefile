# persist-pipeline: the two commands a newcomer runs are `make run` and `make test`.
# Both create the virtualenv (.venv) from pyproject.toml themselves.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: run test test-fast test-pandas3 lint typecheck proto ui nemesis simulate quickstart clean help

help:
	@echo "make run        - the whole Dagster pipeline, headless, on the embedded default"
	@echo "                  (SQLite + local files + Spark local[*]); prints a summary table"
	@echo "make test       - create the environment and run the whole test suite (lint, types too)"
	@echo "make test-fast  - the fast tier before every commit: logic on the in-memory and SQLite"
	@echo "                  backends, no PostgreSQL, S3, Spark or Dagster runs (1-2 minutes)"
	@echo "make ui         - the Dagster UI on the same instance (http://127.0.0.1:3000)"
	@echo "make quickstart - the core library alone: writes, placement, compaction, snapshot"
	@echo "make nemesis    - 10 minutes of killed processes and faults on PostgreSQL + S3"
	@echo "make simulate   - the deterministic simulation, 2000 seeds (SIM_SEEDS=N to change), then 200 of the inline profile"
	@echo "make bench / bench-quick - benchmarks against the peers (report in results/bench)"
	@echo "make browser    - install Debian's Chromium if missing (for the UI browser test)"
	@echo "make test-pandas3 - the pandas-facing tests on pandas 3 (make test runs them too)"
	@echo "make lint / typecheck / proto"

$(STAMP): pyproject.toml
	@echo "Creating $(VENV) with persist-pipeline[dev] (a few minutes the first time; pip runs quietly)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	DAGSTER_HOME="$${DAGSTER_HOME:-$(CURDIR)/.dagster_home}" $(PY) -m assets.run_demo

ui: $(STAMP)
	DAGSTER_HOME="$${DAGSTER_HOME:-$(CURDIR)/.dagster_home}" $(VENV)/bin/dg dev \
		-w workspace.yaml -h 127.0.0.1 -p "$${DAGSTER_UI_PORT:-3000}"

quickstart: $(STAMP)
	$(PY) -m persist_pipeline.examples.quickstart

nemesis: $(STAMP)
	$(PY) scripts/nemesis_local.py --seconds "$${NEMESIS_SECONDS:-600}"

simulate: $(STAMP)
	$(PY) -m persist_pipeline simulate --seeds "$${SIM_SEEDS:-2000}"
	$(PY) -m persist_pipeline simulate --seeds 200 --profile inline

# Two workers: tests are isolated (own databases, buckets, folders, ports).
PYTEST_WORKERS ?= 2

test: $(STAMP) browser lint typecheck test-pandas3
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q -n $(PYTEST_WORKERS)

# pandas 3 for the paths that take and return pandas frames (the IO manager, tables,
# inputs). The dev extra keeps pandas < 3, as PySpark 4 says it does not fully support
# pandas 3 yet; this interpreter sees .venv's packages with pandas 3 in front of them
# (a .pth file appends them; the checkout comes first as the working directory). On the
# embedded backends only: the pandas conversions are the same whatever stores the rows.
PANDAS3       := $(VENV)/pandas3
PANDAS3_STAMP := $(PANDAS3)/.installed-stamp
PANDAS3_TESTS := tests/test_io_manager_shards.py tests/test_tables.py tests/test_inputs.py \
                 tests/test_pipeline_io_manager.py

$(PANDAS3_STAMP): $(STAMP)
	rm -rf $(PANDAS3)
	$(PY) -m venv --without-pip $(PANDAS3)
	site="$$($(PANDAS3)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
	&& $(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > "$$site/dev-venv.pth" \
	&& $(PY) -m pip install --quiet --no-deps --target "$$site" 'pandas>=3,<4'
	$(PANDAS3)/bin/python -c 'import pandas; assert pandas.__version__ >= "3", pandas.__version__'
	touch $(PANDAS3_STAMP)

test-pandas3: $(PANDAS3_STAMP)
	HYPOTHESIS_PROFILE=ci $(PANDAS3)/bin/python -m pytest -q -n $(PYTEST_WORKERS) \
		-m "not spark and not postgres and not s3" $(PANDAS3_TESTS)

test-fast: $(STAMP)
	HYPOTHESIS_PROFILE=fast $(PY) -m pytest -q -n $(PYTEST_WORKERS) \
		-m "not postgres and not s3 and not spark and not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

proto: $(STAMP)
	$(PY) -m persist_pipeline.proto.generate

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# Benchmarks: the peers are the optional `bench` extra, installed by its own stamp.
BENCH_STAMP := $(VENV)/.bench-installed-stamp

.PHONY: bench bench-quick

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install --quiet -e '.[bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) -m bench

bench-quick: $(BENCH_STAMP)
	$(PY) -m bench --quick

# Headless Chromium for tests/test_ui_browser.py: Debian's `chromium` package,
# installed with apt-get only if /usr/bin/chromium (or $PERSIST_CHROMIUM) is missing.
.PHONY: browser

browser:
	bash scripts/install_chromium.sh
