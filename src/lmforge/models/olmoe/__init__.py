"""OLMoE (``model_type`` ``olmoe``): q/k RMSNorm over the whole projection (not per head), every layer a
mixture of experts, top-k not renormalised (``norm_topk_prob`` false by default). ``clip_qkv`` is refused.
"""

from __future__ import annotations

from typing import Any

from lmforge.models.args import ModelArgs
from lmforge.models.common.llama_style import LlamaStyleConfig
from lmforge.models.common.moe_keys import DENSE_MLP, EXPERTS, ROUTED, all_layers_sparse, expert_reader
from lmforge.models.qwen import QWEN3_LAYOUT


def _olmoe_keys(args: ModelArgs) -> dict[str, Any]:
    return {"num_experts": args.n_experts, "num_experts_per_tok": args.n_experts_per_token,
            "intermediate_size": args.expert_ffn_dim, "norm_topk_prob": args.moe_norm_topk,
            "router_aux_loss_coef": args.router_aux_loss_coef, "clip_qkv": None, "attention_bias": False}


OLMOE_CONFIG = LlamaStyleConfig(
    model_type="olmoe", architecture="OlmoeForCausalLM",
    defaults={"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 4096},
    refused_flags=("attention_bias",), moe=True, switches={"qk_norm": True, "qk_norm_per_head": False},
    read_extra=expert_reader("num_experts", "intermediate_size", None, 0.01), export_keys=_olmoe_keys,
    export_check=all_layers_sparse,
)

OLMOE_LAYOUT = QWEN3_LAYOUT.extend(layer_names=ROUTED, expert_names=EXPERTS, drop=DENSE_MLP)

# The fused decode step has a dense MLP only.
OLMOE = OLMOE_CONFIG.register(OLMOE_LAYOUT, fused_decode=False, sizes={
    # allenai/OLMoE-1B-7B-0924
    "olmoe-1b-7b": dict(
        dim=2048, n_layers=16, n_heads=16, n_kv_heads=16, ffn_hidden_dim=1024, norm_eps=1e-5, rope_theta=10000.0,
        max_seq_len=4096, tie_embeddings=False, qk_norm=True, qk_norm_per_head=False, n_experts=64,
        n_experts_per_token=8, moe_norm_topk=False, router_aux_loss_coef=0.01),
})
