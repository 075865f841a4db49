"""The load-balancing terms of a mixture of experts, added to a next-token loss, and the router
statistics they come with.

A run's loss for an MoE model is ``cross-entropy + aux_coef * aux_loss + z_coef * z_loss`` (see
:class:`lmforge.models.layers.moe.RouterLosses`). The logged ``loss`` stays the cross-entropy alone,
so it compares with a dense model's; the router terms are logged next to it.

Normalisation: a microbatch's router terms are weighted by its target tokens before the step's
global division by all target tokens, so the step's aux loss is the token-weighted mean over its
microbatches and ranks, and accumulation gives the same gradient as one large batch would.

The statistics are sums, like every other (``LossStats.sums``): ``router_expert_tokens`` is the
[MoE layers, experts] count of top-k slots each expert received, summed over microbatches and ranks
before :func:`router_log_values` reads load balance from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lmforge.models.args import ModelArgs
from lmforge.models.layers.moe import router_losses
from lmforge.training.stats import LossStats


@dataclass(frozen=True)
class RouterLossWeights:
    aux: float
    """Load-balancing loss coefficient (``training.router_aux_loss_coef``, else the model's own)."""
    z: float
    """Router z-loss coefficient (``training.router_z_loss_coef``)."""

    @classmethod
    def for_run(cls, aux: float | None, z: float, args: ModelArgs) -> RouterLossWeights | None:
        """The weights of a run on ``args`` (None for a dense model: nothing to add)."""
        if args.n_experts == 0:
            return None
        return cls(args.router_aux_loss_coef if aux is None else aux, z)


def add_router_terms(loss_sum: torch.Tensor, stats: LossStats, model: nn.Module,
                     weights: RouterLossWeights | None) -> torch.Tensor:
    """``loss_sum`` plus the router terms of ``model``'s last forward, weighted by the microbatch's
    target tokens; records them (and the expert counts) in ``stats.sums``."""
    if weights is None:
        return loss_sum
    terms = router_losses(model)
    if terms is None:
        return loss_sum
    tokens = stats.target_tokens.to(terms.aux_loss.dtype)
    stats.sums["router_aux_loss"] = terms.aux_loss.detach() * tokens
    stats.sums["router_z_loss"] = terms.z_loss.detach() * tokens
    stats.sums["router_expert_tokens"] = terms.counts.detach()
    return loss_sum + (weights.aux * terms.aux_loss + weights.z * terms.z_loss) * tokens


def router_log_values(totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``router_aux_loss``, ``router_z_loss`` (token means) and the experts' load, from global totals.

    ``expert_load_max`` / ``expert_load_min``: the busiest / idlest expert's share of a layer's slots
    relative to an even share (1.0 = balanced; min 0 = an expert got nothing), averaged over layers.
    """
    if "router_expert_tokens" not in totals:
        return {}
    tokens = totals["total_weights"].clamp(min=1)
    counts = totals["router_expert_tokens"]
    even = counts.mean(dim=1).clamp(min=1e-9)
    return {"router_aux_loss": totals["router_aux_loss"] / tokens, "router_z_loss": totals["router_z_loss"] / tokens,
            "expert_load_max": (counts.max(dim=1).values / even).mean(),
            "expert_load_min": (counts.min(dim=1).values / even).mean()}
