"""Phi-3 / Phi-3.5-mini (``model_type`` ``phi3``): the shared decoder with fused projections.

The architecture is Llama's; only the checkpoint differs: q, k and v live in one ``qkv_proj`` and
the MLP's gate and up in one ``gate_up_proj`` (gate first), which the state-dict adapter splits on
loading (views, no copy) and concatenates on export. ``sliding_window`` is read as Mistral's (the
4k models set 2047). Refused in one line: the long-context ``longrope``/``su`` RoPE scaling (the
128k models: lmforge does not implement its per-frequency factors), ``partial_rotary_factor`` (Phi-4-mini)
and attention biases. Phi-3's ``resid_pdrop``/``embd_pdrop`` dropouts are not applied: lmforge trains
without dropout.
"""

from __future__ import annotations

from typing import Any

from lmforge.models.args import ModelArgs
from lmforge.models.common.llama_style import LLAMA_LAYOUT, LlamaStyleConfig


def _export_keys(args: ModelArgs) -> dict[str, Any]:
    return {"sliding_window": args.sliding_window, "original_max_position_embeddings": args.max_seq_len,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_bias": False}


PHI3_CONFIG = LlamaStyleConfig(
    model_type="phi3",
    architecture="Phi3ForCausalLM",
    defaults={"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 4096, "sliding_window": None},
    refused_flags=("attention_bias",),
    sliding_window=True,
    export_keys=_export_keys,
)

PHI3_LAYOUT = LLAMA_LAYOUT.fuse({
    "self_attn.qkv_proj.weight": ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight"),
    "mlp.gate_up_proj.weight": ("feed_forward.w1.weight", "feed_forward.w3.weight"),
})

# microsoft/Phi-3-mini-4k-instruct
PHI3 = PHI3_CONFIG.register(PHI3_LAYOUT, fused_decode=True, sizes={"phi3-mini": dict(
    dim=3072, n_layers=32, n_heads=32, n_kv_heads=32, ffn_hidden_dim=8192, norm_eps=1e-5, rope_theta=10000.0,
    max_seq_len=4096, tie_embeddings=False, sliding_window=2047)})
