# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CORE := build/toy-core

.PHONY: demo test venv clean bench

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The local CPU wheel first, so nothing pulls a multi-GB CUDA build of torch.
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check triton==3.9.0 -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ignition export-core --recipe toy --out $(CORE) --overwrite
	$(VENV)/bin/ignition validate-core $(CORE)
	$(VENV)/bin/ignition inspect-core $(CORE) --memory

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m benchmarks.reduction --quick

clean:
	rm -rf build $(VENV)
