"""Tiny random Hugging Face models of each supported family, saved with the family's real tokenizer
files and generation config (``tests/fixtures/tokenizers``): what a user's ``model.from_hf``
directory looks like, at a size the tests can train."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from _chat_fixtures import REAL_TOKENIZERS

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512)
FAMILIES = {  # name -> (tokenizer fixture, transformers config class, family-specific settings)
    "qwen2.5": ("qwen2.5-instruct", "Qwen2Config", dict(tie_word_embeddings=True, use_sliding_window=False)),
    "qwen3": ("qwen2.5-instruct", "Qwen3Config", dict(head_dim=24, tie_word_embeddings=True)),
    "smollm2": ("smollm2-135m-instruct", "LlamaConfig", dict(tie_word_embeddings=True)),
    "mistral": ("mistral-7b-instruct-v0.1", "MistralConfig", dict(sliding_window=4096)),
    "gemma3": ("gemma3-it", "Gemma3TextConfig", dict(head_dim=16, sliding_window=16, sliding_window_pattern=2,
                                                     pad_token_id=0)),
    "qwen3_moe": ("qwen2.5-instruct", "Qwen3MoeConfig", dict(head_dim=24, num_experts=4, num_experts_per_tok=2,
                                                             moe_intermediate_size=64, norm_topk_prob=True)),
    "mixtral": ("mistral-7b-instruct-v0.1", "MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
}
MORE_FAMILIES = {  # trained by tests/test_family_recipes.py only (test_real_models.py runs FAMILIES)
    "olmoe": ("smollm2-135m-instruct", "OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2)),
    # no gpt-oss (harmony) tokenizer among the fixtures: Qwen2.5's stands in
    "gpt_oss": ("qwen2.5-instruct", "GptOssConfig", dict(
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], rope_parameters=dict(
            rope_type="yarn", factor=4.0, rope_theta=1e4, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=128))),
}


def hf_start(family: str, out: Path) -> Path:
    """A tiny random model of ``family`` saved with its real tokenizer and generation config."""
    import transformers

    tok_dir, config_cls, extra = {**FAMILIES, **MORE_FAMILIES}[family]
    real = json.loads((REAL_TOKENIZERS / tok_dir / "config.json").read_text())
    config = getattr(transformers, config_cls)(vocab_size=real["vocab_size"], bos_token_id=real.get("bos_token_id"),
                                               eos_token_id=real.get("eos_token_id"), **SHAPE, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # non-trivial norms so a wrong mapping shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    model.save_pretrained(out)
    for f in (REAL_TOKENIZERS / tok_dir).iterdir():
        if f.name != "config.json":
            shutil.copy(f, out / f.name)
    return out
