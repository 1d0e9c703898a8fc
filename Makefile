# `make demo` and `make test` each create .venv on a fresh machine and install what they need.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-fast zoo bench clean

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.base
	$(VENV)/bin/dlo-fx demo

# The whole suite, the diffusers zoo included (its spawns run in the background while the
# in-process tests run: tests/conftest.py).
test: $(VENV)/.test
	$(PY) -m pytest -q

# Before each commit: the in-process tests of the contract files, about 2.5 minutes on 2 cores
# (FAST_FILES in tests/conftest.py); `make test` before the change lands.
test-fast: $(VENV)/.test
	$(PY) -m pytest -q -m fast

# The diffusers zoo alone (tests/test_zoo.py), at dp 1 and 2, both modes: the 30 classes
# `make test` runs and the rest of the release's transformer classes with their variants
# (tests/zoo_more.py); about 20 minutes on 2 idle cores.
# `DLO_FX_ZOO_TABLE=docs/zoo.md make zoo` rewrites its table.
zoo: $(VENV)/.test
	DLO_FX_ZOO=all $(PY) -m pytest -q tests/test_zoo.py

bench: $(VENV)/.test
	$(PY) benchmarks/bench_core.py

clean:
	rm -rf $(VENV) build *.egg-info
