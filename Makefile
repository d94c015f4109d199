# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CHECKPOINT := build/tiny-qwen3
CORE := build/qwen3-core

.PHONY: demo test venv clean bench gpu-check gpu-wheelhouse

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The local CPU wheel first, so nothing pulls a multi-GB CUDA build of torch.
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check triton==3.9.0 -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) examples/make_tiny_qwen3.py $(CHECKPOINT)
	$(VENV)/bin/ignition export-core $(CHECKPOINT) --recipe qwen3 --out $(CORE) --overwrite --prompt-logprobs
	$(VENV)/bin/ignition validate-core $(CORE)
	$(VENV)/bin/ignition inspect-core $(CORE) --memory
	$(VENV)/bin/ignition run $(CORE) "Hello world" --max-tokens 8 --logprobs 3

# Two workers, one file each at a time: most tests are single-threaded Python (tracing, export),
# so two workers use both cores; each worker runs torch with one thread (tests/conftest.py).
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

bench: $(STAMP)
	$(PY) -m benchmarks.reduction --quick
	$(PY) -m benchmarks.export_time

# On a CUDA machine (the H200 image: torch 2.11, Triton 3.6, cuda-bindings preinstalled): no venv, the checkout on
# PYTHONPATH, build/wheelhouse and build/gpu-check-cores carried in; 560-second deadline (benchmarks/gpu/plan.py);
# results in $OUT or build/gpu-check. The wheelhouse's requirements.txt lists only what the image lacks.
# `make gpu-check DRY=1` is its CPU half, here: wheelhouse, import coverage, carried cores, plan and budgets.
gpu-check: $(if $(DRY),$(STAMP))
	PYTHONPATH=$(CURDIR) PYTHONUNBUFFERED=1 $(if $(DRY),$(PY),$(PYTHON)) -m benchmarks.gpu_check $(if $(DRY),--dry-run)

# Here (PyPI reachable): build/wheelhouse, every wheel the GPU image lacks, CPython 3.10-3.13, manifest.json.
gpu-wheelhouse: $(STAMP)
	PYTHONPATH=$(CURDIR) $(PY) -m benchmarks.gpu.wheelhouse --out build/wheelhouse

clean:
	rm -rf build $(VENV)
