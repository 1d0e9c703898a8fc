# `make demo` and `make test` each create .venv on a fresh machine and install what they need.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test bench clean

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

test: $(VENV)/.test
	$(PY) -m pytest -q

bench: $(VENV)/.test
	$(PY) benchmarks/bench_core.py

clean:
	rm -rf $(VENV) build *.egg-info
