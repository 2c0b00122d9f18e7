# Two commands do everything: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
SOURCES := pyproject.toml setup.py $(wildcard aio_csrc/*.c aio_csrc/*.h optim_csrc/*.c optim_csrc/*.h)

.PHONY: test demo install clean bench-nvme

install: $(STAMP)

# torch 2.13.0 (the CPU build on these machines) is installed first when the venv has
# no torch, so that resolving `torch` later never pulls a CUDA build.
$(STAMP): $(SOURCES)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	@$(PY) -m pip install -q --upgrade "setuptools>=64" wheel
	@$(PY) -m pip install -q --no-build-isolation -e '.[test]'
	@touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

demo: $(STAMP)
	$(PY) -m infinity.examples.demo

bench-nvme: $(STAMP)
	$(VENV)/bin/infinity-bench nvme --path $${TMPDIR:-/tmp}

clean:
	rm -rf $(VENV) build *.egg-info tiers/*.so
