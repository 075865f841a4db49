"""What the mixture-of-experts families share in their config.json: the expert keys and their defaults.

Each family (``qwen3_moe``, ``mixtral``, ``olmoe``, each in its own folder) is its dense relative with a
:class:`~lmforge.models.layers.moe.MoEFeedForward` in place of the MLP. ``router_aux_loss_coef`` is read as
the family's load-balancing weight; a run's ``training.router_aux_loss_coef`` overrides it. Refused:
router jitter noise (Mixtral), ``clip_qkv`` (OLMoE).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from lmforge.errors import UserError
from lmforge.models.args import ModelArgs

DENSE_MLP = ("feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")
"""A dense MLP's lmforge names, dropped from the layouts of families whose every layer is sparse."""
ROUTED = {"feed_forward.router.weight": "mlp.gate.weight"}
EXPERTS = {"feed_forward.experts.w1": "mlp.experts.{e}.gate_proj.weight",
           "feed_forward.experts.w2": "mlp.experts.{e}.down_proj.weight",
           "feed_forward.experts.w3": "mlp.experts.{e}.up_proj.weight"}
"""The stacked experts under transformers' per-expert names (Qwen3-MoE, OLMoE)."""


def expert_reader(experts_key: str, expert_size_key: str, norm_topk: bool | None,
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


def all_layers_sparse(args: ModelArgs) -> str | None:
    return None if args.moe_layers is None else "every layer must be a mixture of experts"
