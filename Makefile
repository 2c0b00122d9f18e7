# Two commands do everything: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# Exact versions of everything `make test` installs (the suite's last pass); see the file's header.
CONSTRAINTS := .ci/constraints.txt
SOURCES := pyproject.toml setup.py $(CONSTRAINTS) $(wildcard aio_csrc/*.c aio_csrc/*.h optim_csrc/*.c optim_csrc/*.h)
# `make test-latest`: a venv of its own where every dependency but torch takes its newest release.
LATEST_VENV := .venv-latest
LATEST_PY := $(LATEST_VENV)/bin/python
HF_PACKAGES := transformers|accelerate|peft|trl|huggingface.hub|tokenizers|safetensors|kernels

.PHONY: test test-latest constraints demo install clean bench-nvme fuzz

install: $(STAMP)

# torch 2.13.0 (the CPU build on these machines) is installed first when the venv has
# no torch, so that resolving `torch` later never pulls a CUDA build.
$(STAMP): $(SOURCES)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	@$(PY) -m pip install -q -c $(CONSTRAINTS) --upgrade "setuptools>=64" wheel
	@$(PY) -m pip install -q -c $(CONSTRAINTS) --no-build-isolation -e '.[test]'
	@touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider --durations=25 tests

# The Hugging Face, accelerate and peft tests against the newest releases (torch stays 2.13.0): run it before
# starting new work; when it passes, `make constraints` moves the pins forward (then `make test`).
test-latest:
	@test -x $(LATEST_PY) || $(PYTHON) -m venv $(LATEST_VENV)
	@$(LATEST_PY) -c "import torch" 2>/dev/null || $(LATEST_PY) -m pip install -q torch==2.13.0
	@$(LATEST_PY) -m pip install -q --upgrade "setuptools>=64" wheel
	@$(LATEST_PY) -m pip install -q --upgrade --upgrade-strategy eager --no-build-isolation \
		-c .ci/latest.txt -e '.[test]'
	@$(LATEST_PY) -m pip list 2>/dev/null | grep -iE '^($(HF_PACKAGES)) ' | tr -s ' ' | sed 's/^/newest: /'
	$(LATEST_PY) -m pytest -q -p no:cacheprovider -m hf tests

# Writes what .venv-latest holds into $(CONSTRAINTS), keeping its header.
constraints:
	@test -x $(LATEST_PY) || { echo "run 'make test-latest' first: it builds $(LATEST_VENV)"; exit 2; }
	@{ grep '^#' $(CONSTRAINTS); $(LATEST_PY) -m pip freeze --all --exclude-editable 2>/dev/null \
		| grep -viE '^(pip|torch|infinity-offload)=='; } > $(CONSTRAINTS).new && mv $(CONSTRAINTS).new $(CONSTRAINTS)
	@git diff --stat -- $(CONSTRAINTS) 2>/dev/null || true

demo: $(STAMP)
	$(PY) -m infinity.examples.demo

# The random-sequence tests at length: `make test` runs a few seconds of each; this runs thousands of
# cases (INFINITY_FUZZ_CASES; INFINITY_FUZZ_SEED moves to fresh seeds). A failure names its seed.
FUZZ_CASES ?= 5000
fuzz: $(STAMP)
	INFINITY_FUZZ_CASES=$(FUZZ_CASES) $(PY) -m pytest -q -p no:cacheprovider \
		$(wildcard tests/unit/test_aio_fuzz.py tests/unit/test_checkpoint_fuzz.py)

bench-nvme: $(STAMP)
	$(VENV)/bin/infinity-bench nvme --path $${TMPDIR:-/tmp}

clean:
	rm -rf $(VENV) $(LATEST_VENV) build *.egg-info tiers/*.so infinity/optim/*.so
