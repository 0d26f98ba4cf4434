# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the suite).
# Each creates .venv and installs what it needs on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint typecheck clean postgres-binaries

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,spark,postgres,sqlite]'
	touch $(STAMP)

# PostgreSQL server binaries from the machine; installed from Debian's packages when missing.
postgres-binaries:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 || \
	  { echo "installing PostgreSQL server binaries"; \
	    (apt-get update -qq && apt-get install -y -qq postgresql >/dev/null) || \
	    { echo "PostgreSQL binaries missing and apt-get failed" >&2; exit 1; }; }

demo: $(STAMP)
	$(PY) -m millpond.demo

test: $(STAMP) postgres-binaries
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

bench: $(STAMP) postgres-binaries
	$(PY) -m bench $(BENCH_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy cannot follow setuptools package-dir renames in an editable install: type-check a
# plain install of the package instead.
typecheck: $(STAMP)
	rm -rf build/typecheck
	$(PY) -m pip install --quiet --no-deps --target build/typecheck .
	MYPYPATH=build/typecheck $(VENV)/bin/mypy -p millpond

clean:
	rm -rf $(VENV) build *.egg-info bench/results
