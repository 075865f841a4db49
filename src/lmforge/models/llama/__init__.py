"""Llama 2 / 3 / 3.1-3.3 and SmolLM2 (Llama-shaped, tied embeddings): Hugging Face ``model_type`` ``llama``.

The reference family: the shared decoder with no extra switches. Llama 3.1+ RoPE frequency
scaling is a ``ModelArgs.rope_scaling`` setting, read from config.json like any other.
"""

from __future__ import annotations

from typing import Any

from lmforge.models.args import ModelArgs
from lmforge.models.common.gguf_names import LLAMA_GGUF_LAYER_NAMES
from lmforge.models.common.llama_style import LLAMA_LAYOUT, LlamaStyleConfig
from lmforge.models.spec import GGUFFormat


def _export_keys(args: ModelArgs) -> dict[str, Any]:
    return {"attention_bias": False, "mlp_bias": False}


LLAMA_CONFIG = LlamaStyleConfig(
    model_type="llama",
    architecture="LlamaForCausalLM",
    defaults={"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048},
    refused_flags=("attention_bias", "mlp_bias"),
    export_keys=_export_keys,
)

LLAMA_GGUF = GGUFFormat("llama", LLAMA_GGUF_LAYER_NAMES, permuted_qk=True)
"""llama.cpp's ``llama`` architecture: the Llama names, q/k rows permuted by its converter."""

LLAMA = LLAMA_CONFIG.register(LLAMA_LAYOUT, fused_decode=True, gguf=LLAMA_GGUF, sizes={
    # HuggingFaceTB/SmolLM2-135M, meta-llama/Llama-3.2-1B (published config.json values)
    "smollm2-135m": dict(
        dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_hidden_dim=1536, norm_eps=1e-5,
        rope_theta=100000.0, max_seq_len=8192, tie_embeddings=True),
    "llama-3.2-1b": dict(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden_dim=8192, norm_eps=1e-5,
        rope_theta=500000.0, max_seq_len=131072, tie_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)),
})
