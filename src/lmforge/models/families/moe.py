"""Mixtures of experts: Qwen3-MoE (``qwen3_moe``), Mixtral (``mixtral``) and OLMoE (``olmoe``).

Each is its dense relative with :class:`~lmforge.models.layers.moe.MoEFeedForward` in place of the
MLP; they differ in the router and the attention around it:

- **Qwen3-MoE**: Qwen3's attention (per-head q/k norms, explicit ``head_dim``); ``num_experts``
  experts of ``moe_intermediate_size``, ``num_experts_per_tok`` per token, top-k renormalised when
  ``norm_topk_prob``; layers in ``mlp_only_layers`` or off the ``decoder_sparse_step`` keep a dense
  MLP of ``intermediate_size``.
- **Mixtral**: Mistral's attention (optional ``sliding_window``, off by default); ``num_local_experts``
  experts of ``intermediate_size``, top-k always renormalised; its tensors live under
  ``block_sparse_moe`` with experts named ``w1``/``w2``/``w3``.
- **OLMoE**: q/k RMSNorm over the whole projection (not per head); top-k not renormalised
  (``norm_topk_prob`` false by default).

``router_aux_loss_coef`` is read as the family's load-balancing weight; a run's
``training.router_aux_loss_coef`` overrides it. Refused: router jitter noise (Mixtral),
``clip_qkv`` (OLMoE), shared experts (Qwen2-MoE's, a different ``model_type``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from lmforge.errors import UserError
from lmforge.models.args import ModelArgs
from lmforge.models.families.llama_style import LLAMA_LAYOUT, LlamaStyleConfig
from lmforge.models.families.qwen import QWEN3_LAYOUT

_DENSE_MLP = ("feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")


def _experts(experts_key: str, expert_size_key: str, norm_topk: bool | None,
             coef: float) -> Callable[[Mapping[str, Any], str], dict[str, Any]]:
    """The ``read_extra`` of a family: its expert count key (transformers may save it under the other
    spelling, ``num_experts`` / ``num_local_experts``), expert size key, renormalisation (None: read
    ``norm_topk_prob``, default False as transformers) and default load-balancing weight."""

    def read(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
        if cfg.get("router_jitter_noise"):
            raise UserError(f"{where}: router_jitter_noise={cfg['router_jitter_noise']} is not supported")
        if cfg.get("clip_qkv") is not None:
            raise UserError(f"{where}: clip_qkv={cfg['clip_qkv']} is not supported")
        n_experts = cfg.get(experts_key, cfg.get("num_local_experts", cfg.get("num_experts")))
        if n_experts is None or "num_experts_per_tok" not in cfg:
            raise UserError(f"{where}: missing field {experts_key!r} or 'num_experts_per_tok'")
        extra: dict[str, Any] = {
            "n_experts": int(n_experts),
            "n_experts_per_token": int(cfg["num_experts_per_tok"]),
            "moe_norm_topk": bool(cfg.get("norm_topk_prob", False)) if norm_topk is None else norm_topk,
            "router_aux_loss_coef": float(cfg.get("router_aux_loss_coef", coef)),
        }
        if expert_size_key != "intermediate_size":
            extra["moe_ffn_dim"] = int(cfg[expert_size_key])
        return extra

    return read


def _qwen3_moe_extra(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    extra = _experts("num_experts", "moe_intermediate_size", None, 0.001)(cfg, where)
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


def _mixtral_keys(args: ModelArgs) -> dict[str, Any]:
    return {"num_local_experts": args.n_experts, "num_experts_per_tok": args.n_experts_per_token,
            "intermediate_size": args.expert_ffn_dim, "router_aux_loss_coef": args.router_aux_loss_coef,
            "router_jitter_noise": 0.0, "sliding_window": args.sliding_window}


def _olmoe_keys(args: ModelArgs) -> dict[str, Any]:
    return {"num_experts": args.n_experts, "num_experts_per_tok": args.n_experts_per_token,
            "intermediate_size": args.expert_ffn_dim, "norm_topk_prob": args.moe_norm_topk,
            "router_aux_loss_coef": args.router_aux_loss_coef, "clip_qkv": None, "attention_bias": False}


def _all_layers_sparse(args: ModelArgs) -> str | None:
    return None if args.moe_layers is None else "every layer must be a mixture of experts"


def _mixtral_check(args: ModelArgs) -> str | None:
    return _all_layers_sparse(args) or (None if args.moe_norm_topk else "its router always renormalises the top-k")


QWEN3_MOE_CONFIG = LlamaStyleConfig(
    model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM",
    defaults={"num_key_value_heads": 4, "head_dim": None, "max_position_embeddings": 32768},
    refused_flags=("attention_bias", "use_sliding_window"), switches={"qk_norm": True}, moe=True,
    read_extra=_qwen3_moe_extra, export_keys=_qwen3_moe_keys,
)
MIXTRAL_CONFIG = LlamaStyleConfig(
    model_type="mixtral", architecture="MixtralForCausalLM",
    defaults={"num_key_value_heads": 8, "head_dim": None, "max_position_embeddings": 4096 * 32, "sliding_window": None},
    sliding_window=True, moe=True,
    read_extra=_experts("num_local_experts", "intermediate_size", True, 0.001), export_keys=_mixtral_keys,
    export_check=_mixtral_check,
)
OLMOE_CONFIG = LlamaStyleConfig(
    model_type="olmoe", architecture="OlmoeForCausalLM",
    defaults={"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 4096},
    refused_flags=("attention_bias",), moe=True, switches={"qk_norm": True, "qk_norm_per_head": False},
    read_extra=_experts("num_experts", "intermediate_size", None, 0.01), export_keys=_olmoe_keys,
    export_check=_all_layers_sparse,
)

_ROUTED = {"feed_forward.router.weight": "mlp.gate.weight"}
_EXPERTS = {"feed_forward.experts.w1": "mlp.experts.{e}.gate_proj.weight",
            "feed_forward.experts.w2": "mlp.experts.{e}.down_proj.weight",
            "feed_forward.experts.w3": "mlp.experts.{e}.up_proj.weight"}
QWEN3_MOE_LAYOUT = QWEN3_LAYOUT.extend(layer_names=_ROUTED, expert_names=_EXPERTS)  # dense layers keep their MLP
OLMOE_LAYOUT = QWEN3_LAYOUT.extend(layer_names=_ROUTED, expert_names=_EXPERTS, drop=_DENSE_MLP)
MIXTRAL_LAYOUT = LLAMA_LAYOUT.extend(
    layer_names={"feed_forward.router.weight": "block_sparse_moe.gate.weight"},
    expert_names={"feed_forward.experts.w1": "block_sparse_moe.experts.{e}.w1.weight",
                  "feed_forward.experts.w2": "block_sparse_moe.experts.{e}.w2.weight",
                  "feed_forward.experts.w3": "block_sparse_moe.experts.{e}.w3.weight"},
    drop=_DENSE_MLP,
)


# The fused decode step has a dense MLP only.
QWEN3_MOE = QWEN3_MOE_CONFIG.register(QWEN3_MOE_LAYOUT, fused_decode=False)
MIXTRAL = MIXTRAL_CONFIG.register(MIXTRAL_LAYOUT, fused_decode=False)
OLMOE = OLMOE_CONFIG.register(OLMOE_LAYOUT, fused_decode=False)
