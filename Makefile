# Set-up and entry points. `make test` and `make demo` work on a fresh clone: they create .venv when missing and
# install the package with pinned versions (constraints.txt) before running.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install lint test test-quick demo bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) setup.cfg pyproject.toml constraints.txt
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	-$(PY) tests/support/transformers_tests.py  # transformers' model tests, from its sdist on PyPI (skipped when unreachable)
	touch $(STAMP)

install: $(STAMP)

# transformers' ruff rules (pyproject.toml); `make test` stops on a finding before the tests run.
lint: $(STAMP)
	$(PY) -m ruff check .

test: $(STAMP) lint
	$(PY) -m pytest -n auto

# The loop while changing code: the tests not marked slow (setup.cfg's markers). `make test`, which CI runs, runs all.
test-quick: $(STAMP) lint
	$(PY) -m pytest -n auto -m "not slow"

demo: $(STAMP)
	$(PY) examples/demo.py

bench: $(STAMP)
	$(PY) benchmarks/bench_cpu.py

clean:
	rm -rf $(VENV) build *.egg-info
