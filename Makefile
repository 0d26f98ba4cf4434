# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Each creates .venv and installs what it needs on first use (make test also installs
# Azurite from npm into .venv/npm, and PostgreSQL's server binaries when the machine has none).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

AZURITE := $(VENV)/npm/node_modules/.bin/azurite-blob

.PHONY: demo test docs walkthrough soak bench lint typecheck clean postgres-binaries postgres-jdbc azurite spark-archive

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,spark,postgres,sqlite,local,docs]'
	touch $(STAMP)

# PostgreSQL server binaries from the machine; installed from Debian's packages when missing.
postgres-binaries:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 || \
	  { echo "installing PostgreSQL server binaries"; \
	    (apt-get update -qq && apt-get install -y -qq postgresql >/dev/null) || \
	    { echo "PostgreSQL binaries missing and apt-get failed" >&2; exit 1; }; }

# PostgreSQL's JDBC driver, for the baseline of the Spark -> PostgreSQL benchmark (Spark's own
# JDBC writer), from Debian's packages when missing; without it that benchmark alone fails.
postgres-jdbc:
	@test -f /usr/share/java/postgresql.jar || test -n "$$MILLPOND_BENCH_JDBC_JAR" || \
	  { echo "installing PostgreSQL's JDBC driver"; \
	    (apt-get update -qq && apt-get install -y -qq libpostgresql-jdbc-java >/dev/null) || \
	    echo "PostgreSQL's JDBC driver missing and apt-get failed" >&2; }

# Azurite (the Azure Blob emulator the tests run against) from npm, at the version
# localstack/package-lock.json pins, into .venv/npm where millpond.localstack finds it.
azurite: $(AZURITE)

$(AZURITE): localstack/package.json localstack/package-lock.json
	@command -v npm >/dev/null 2>&1 || { echo "npm not found: install Node.js 20 (with npm)" >&2; exit 1; }
	mkdir -p $(VENV)/npm
	cp localstack/package.json localstack/package-lock.json $(VENV)/npm/
	cd $(VENV)/npm && npm ci --no-audit --no-fund --loglevel=error
	touch $(AZURITE)

# Bytecode for the project's own modules: the editable install leaves them uncompiled, and with
# PYTHONDONTWRITEBYTECODE set (as on CI machines) every process compiled them again at import
# (0.3 s of CPU per consumer service or Spark Python worker). Python checks each file's source
# before using its bytecode, so a stale one is never run.
COMPILE := $(PY) -m compileall -q -j 0 buffer producer consumer gc localstack tests >/dev/null

# docs/walkthrough.md followed from a fresh clone of HEAD, installed as docs/index.md says
# (not part of `make test`: it installs a virtualenv of its own).
walkthrough: postgres-binaries
	tests/docs/walkthrough_from_clone.sh

demo: $(STAMP)
	$(COMPILE)
	$(PY) -m millpond.localstack.demo

# Three workers, a test file per worker at a time (its session servers start once per worker):
# most tests wait on servers and processes, so three share two cores well (the whole suite on
# two cores: 383 s with three, 423 s with two, 2026-11-28). TEST_WORKERS=0 runs everything in
# one process.
# Before them: bytecode, and (once per machine and virtualenv) the class archive the Spark tests'
# JVMs map: about 50 s of one core, against 7 s of class loading saved at each of their dozen
# drivers (tests/spark/class_archive.py).
# On a fresh machine, after pip's install (about 100 s), npm's install of Azurite (about 35 s,
# mostly waiting on the registry) runs beside the archive (about 50 s of one core).
TEST_WORKERS ?= 3
test: $(STAMP) postgres-binaries
	$(MAKE) --no-print-directory --output-sync=target -j2 spark-archive $(AZURITE)
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The documentation site (docs/, mkdocs.yml) into build/site. --strict: any warning fails the
# build (a broken link or anchor, a page missing from the navigation). tests/docs builds it too,
# and runs every code block of every page (docs/contributing.md).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# Every benchmark on loopback, then those that use the object store again with 50 ms injected
# per request (the latency proxy; results named <name>@50ms). BENCH_LATENCY_MS=0 skips that pass.
BENCH_LATENCY_MS ?= 50
# The whole-system checker's long run: many more seeded fault schedules than CI runs
# (SOAK_SCHEDULES, from SOAK_FIRST_SEED). A failing seed replays with MILLPOND_CHECKER_SEED.
SOAK_SCHEDULES ?= 2000
SOAK_FIRST_SEED ?= 1000
soak: $(STAMP)
	MILLPOND_CHECKER_SCHEDULES=$(SOAK_SCHEDULES) MILLPOND_CHECKER_FIRST_SEED=$(SOAK_FIRST_SEED) \
	  $(PY) -m pytest -q -p no:cacheprovider tests/system $(PYTEST_ARGS)

bench: $(STAMP) postgres-binaries postgres-jdbc
	$(PY) -m bench $(BENCH_ARGS); plain=$$?; \
	if [ "$(BENCH_LATENCY_MS)" != 0 ]; then \
	  $(PY) -m bench --latency-ms $(BENCH_LATENCY_MS) $(BENCH_ARGS) || exit 1; fi; exit $$plain

spark-archive: $(STAMP)
	$(COMPILE)
	$(PY) -m tests.spark.class_archive

# mypy and import-linter cannot follow setuptools package-dir renames in an editable install:
# they read a plain install of the package instead.
PLAIN := build/plain

$(PLAIN): $(STAMP) $(shell find buffer producer consumer gc localstack -name '*.py' -o -name '*.yml')
	rm -rf $(PLAIN) build/lib build/bdist.*  # setuptools reuses build/lib: a moved module would linger
	$(PY) -m pip install --quiet --no-deps --target $(PLAIN) .
	touch $(PLAIN)

lint: $(STAMP) $(PLAIN)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	cd $(PLAIN) && ../../$(VENV)/bin/lint-imports --config ../../pyproject.toml --no-cache --no-logo

typecheck: $(STAMP) $(PLAIN)
	MYPYPATH=$(PLAIN) $(VENV)/bin/mypy -p millpond

clean:
	rm -rf $(VENV) build *.egg-info bench/results
