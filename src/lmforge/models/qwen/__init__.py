"""Qwen2 / Qwen2.5 (``model_type`` ``qwen2``) and Qwen3 (``qwen3``).

Both are the shared decoder with one switch each: Qwen2 adds a bias to the q/k/v projections,
Qwen3 normalises q and k per head (RMSNorm over ``head_dim``) before RoPE and sets ``head_dim``
explicitly (128 when config.json leaves it out). Qwen's optional sliding window (per layer, from
``max_window_layers`` on) is not implemented, so configs that switch it on are refused and
exports write it off.
"""

from __future__ import annotations

from typing import Any

from lmforge.models.args import ModelArgs
from lmforge.models.common.gguf_names import LLAMA_GGUF_LAYER_NAMES
from lmforge.models.common.llama_style import LLAMA_LAYOUT, LlamaStyleConfig
from lmforge.models.spec import GGUFFormat


def _full_attention_keys(args: ModelArgs) -> dict[str, Any]:
    """Full attention in every layer, spelt out so transformers never turns a window on."""
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": args.n_layers}


def _qwen3_export_keys(args: ModelArgs) -> dict[str, Any]:
    return {**_full_attention_keys(args), "attention_bias": False}


QWEN2_CONFIG = LlamaStyleConfig(
    model_type="qwen2",
    architecture="Qwen2ForCausalLM",
    defaults={"num_key_value_heads": 32, "head_dim": None, "max_position_embeddings": 32768},
    refused_flags=("use_sliding_window",),
    switches={"qkv_bias": True},
    export_keys=_full_attention_keys,
)

QWEN3_CONFIG = LlamaStyleConfig(
    model_type="qwen3",
    architecture="Qwen3ForCausalLM",
    defaults={"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768},
    refused_flags=("attention_bias", "use_sliding_window"),
    switches={"qk_norm": True},
    export_keys=_qwen3_export_keys,
)

QWEN2_LAYOUT = LLAMA_LAYOUT.extend(layer_names={
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
})
QWEN3_LAYOUT = LLAMA_LAYOUT.extend(layer_names={
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
})

# the fused step adds the q/k/v bias; Qwen/Qwen2.5-0.5B
QWEN2 = QWEN2_CONFIG.register(QWEN2_LAYOUT, fused_decode=True, sizes={"qwen2.5-0.5b": dict(
    dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_hidden_dim=4864, norm_eps=1e-6,
    rope_theta=1000000.0, max_seq_len=32768, tie_embeddings=True, qkv_bias=True)},
    gguf=GGUFFormat("qwen2", LLAMA_GGUF_LAYER_NAMES))

# the fused step applies the q/k norms; Qwen/Qwen3-0.6B
QWEN3 = QWEN3_CONFIG.register(QWEN3_LAYOUT, fused_decode=True, sizes={"qwen3-0.6b": dict(
    dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_hidden_dim=3072, norm_eps=1e-6,
    rope_theta=1000000.0, max_seq_len=40960, tie_embeddings=True, qk_norm=True)},
    gguf=GGUFFormat("qwen3", LLAMA_GGUF_LAYER_NAMES))
