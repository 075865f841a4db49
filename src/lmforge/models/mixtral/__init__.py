"""Mixtral (``model_type`` ``mixtral``): Mistral's attention (optional ``sliding_window``, off by default)
with ``num_local_experts`` experts of ``intermediate_size``, top-k always renormalised; its tensors live
under ``block_sparse_moe`` with experts named ``w1``/``w2``/``w3``. Router jitter noise is refused.
"""

from __future__ import annotations

from typing import Any

from lmforge.models.args import ModelArgs
from lmforge.models.common.llama_style import LLAMA_LAYOUT, LlamaStyleConfig
from lmforge.models.common.moe_keys import DENSE_MLP, all_layers_sparse, expert_reader


def _mixtral_keys(args: ModelArgs) -> dict[str, Any]:
    return {"num_local_experts": args.n_experts, "num_experts_per_tok": args.n_experts_per_token,
            "intermediate_size": args.expert_ffn_dim, "router_aux_loss_coef": args.router_aux_loss_coef,
            "router_jitter_noise": 0.0, "sliding_window": args.sliding_window}


def _mixtral_check(args: ModelArgs) -> str | None:
    return all_layers_sparse(args) or (None if args.moe_norm_topk else "its router always renormalises the top-k")


MIXTRAL_CONFIG = LlamaStyleConfig(
    model_type="mixtral", architecture="MixtralForCausalLM",
    defaults={"num_key_value_heads": 8, "head_dim": None, "max_position_embeddings": 4096 * 32, "sliding_window": None},
    sliding_window=True, moe=True,
    read_extra=expert_reader("num_local_experts", "intermediate_size", True, 0.001), export_keys=_mixtral_keys,
    export_check=_mixtral_check,
)
MIXTRAL_LAYOUT = LLAMA_LAYOUT.extend(
    layer_names={"feed_forward.router.weight": "block_sparse_moe.gate.weight"},
    expert_names={"feed_forward.experts.w1": "block_sparse_moe.experts.{e}.w1.weight",
                  "feed_forward.experts.w2": "block_sparse_moe.experts.{e}.w2.weight",
                  "feed_forward.experts.w3": "block_sparse_moe.experts.{e}.w3.weight"},
    drop=DENSE_MLP,
)

# The fused decode step has a dense MLP only.
MIXTRAL = MIXTRAL_CONFIG.register(MIXTRAL_LAYOUT, fused_decode=False, sizes={
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral-8x7b": dict(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden_dim=14336, norm_eps=1e-5, rope_theta=1000000.0,
        max_seq_len=32768, tie_embeddings=False, n_experts=8, n_experts_per_token=2, moe_norm_topk=True,
        router_aux_loss_coef=0.02),
})
