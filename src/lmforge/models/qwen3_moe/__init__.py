"""Qwen3-MoE (``model_type`` ``qwen3_moe``): Qwen3's attention (per-head q/k norms, explicit ``head_dim``)
with ``num_experts`` experts of ``moe_intermediate_size``, ``num_experts_per_tok`` per token, top-k
renormalised when ``norm_topk_prob``; layers in ``mlp_only_layers`` or off the ``decoder_sparse_step``
keep a dense MLP of ``intermediate_size``. Shared experts (Qwen2-MoE's) are a different ``model_type``.
"""

from __future__ import annotations

from typing import Any, Mapping

from lmforge.models.args import ModelArgs
from lmforge.models.common.llama_style import LlamaStyleConfig
from lmforge.models.common.moe_keys import EXPERTS, ROUTED, expert_reader
from lmforge.models.qwen import QWEN3_LAYOUT


def _qwen3_moe_extra(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    extra = expert_reader("num_experts", "moe_intermediate_size", None, 0.001)(cfg, where)
    dense = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step", 1))
    n = int(cfg["num_hidden_layers"])
    sparse = [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    extra["moe_layers"] = None if len(sparse) == n else sparse
    return extra


def _qwen3_moe_keys(args: ModelArgs) -> dict[str, Any]:
    layers = range(args.n_layers) if args.moe_layers is None else args.moe_layers
    return {"num_experts": args.n_experts, "num_experts_per_tok": args.n_experts_per_token,
            "moe_intermediate_size": args.expert_ffn_dim, "norm_topk_prob": args.moe_norm_topk,
            "decoder_sparse_step": 1, "mlp_only_layers": [i for i in range(args.n_layers) if i not in layers],
            "router_aux_loss_coef": args.router_aux_loss_coef, "attention_bias": False,
            "use_sliding_window": False, "sliding_window": None}


QWEN3_MOE_CONFIG = LlamaStyleConfig(
    model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM",
    defaults={"num_key_value_heads": 4, "head_dim": None, "max_position_embeddings": 32768},
    refused_flags=("attention_bias", "use_sliding_window"), switches={"qk_norm": True}, moe=True,
    read_extra=_qwen3_moe_extra, export_keys=_qwen3_moe_keys,
)
QWEN3_MOE_LAYOUT = QWEN3_LAYOUT.extend(layer_names=ROUTED, expert_names=EXPERTS)  # dense layers keep their MLP

# The fused decode step has a dense MLP only.
QWEN3_MOE = QWEN3_MOE_CONFIG.register(QWEN3_MOE_LAYOUT, fused_decode=False, sizes={
    # Qwen/Qwen3-30B-A3B
    "qwen3-30b-a3b": dict(
        dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, ffn_hidden_dim=6144, norm_eps=1e-6,
        rope_theta=1000000.0, max_seq_len=40960, tie_embeddings=False, qk_norm=True, n_experts=128,
        n_experts_per_token=8, moe_ffn_dim=768, moe_norm_topk=True, router_aux_loss_coef=0.001),
})
