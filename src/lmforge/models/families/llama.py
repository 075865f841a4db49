"""Llama 2 / 3 / 3.1-3.3 and SmolLM2 (Llama-shaped, tied embeddings): Hugging Face ``model_type`` ``llama``.

The reference family: the shared decoder with no extra switches. Llama 3.1+ RoPE frequency
scaling is a ``ModelArgs.rope_scaling`` setting, read from config.json like any other.
"""

from __future__ import annotations

from typing import Any

from lmforge.models.args import ModelArgs
from lmforge.models.families.llama_style import LLAMA_LAYOUT, LlamaStyleConfig


def _export_keys(args: ModelArgs) -> dict[str, Any]:
    return {"attention_bias": False, "mlp_bias": False}


LLAMA_CONFIG = LlamaStyleConfig(
    model_type="llama",
    architecture="LlamaForCausalLM",
    defaults={"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048},
    refused_flags=("attention_bias", "mlp_bias"),
    export_keys=_export_keys,
)

LLAMA = LLAMA_CONFIG.register(LLAMA_LAYOUT, fused_decode=True)
