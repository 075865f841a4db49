"""The load-balancing terms of a mixture of experts, added to a next-token loss, and the router
statistics they come with.

A run's loss for an MoE model is ``cross-entropy + aux_coef * aux_loss + z_coef * z_loss`` (see
:class:`lmforge.models.layers.moe.RouterLosses`). The logged ``loss`` stays the cross-entropy alone,
so it compares with a dense model's; the router terms are logged next to it.

Padding: the terms and the expert counts cover the real tokens only (the batch's
:meth:`~lmforge.data.packing.Batch.real_token_mask`), as transformers' ``load_balancing_loss_func``
does with the attention mask; prompt tokens without a target are real and count.

Scope: per microbatch, as transformers computes them (per forward call). Each microbatch's
``aux_loss`` and ``z_loss`` are those of its own tokens (``f_e`` and ``P_e`` of that forward);
they are weighted by the microbatch's target tokens before the step's global division by all
target tokens, so the step's value is the target-token-weighted mean of per-microbatch values over
microbatches and ranks. The aux loss is a product of two means, so it is not additive: the same
rows split into two microbatches give a different value and gradient than as one (the z-loss, a
mean of per-token values, differs only through the weighting). Making it step-global would need
every microbatch's expert counts before the first backward (a second forward, or an all-reduce
per microbatch and layer); transformers (and so TRL's trainers) use the local form.

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
from lmforge.losses.stats import LossStats


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


NEXT_TOKEN_TRAINERS = ("pretrain", "sft")
"""The trainers whose loss carries the router terms (the others train MoE models without them)."""


def router_setup_note(trainer: str, aux: float | None, z: float, args: ModelArgs) -> str | None:
    """What the setup line says of the router terms (None for a dense model).

    Default: the model's own ``router_aux_loss_coef`` (config.json's), on. transformers adds the aux
    loss only when ``output_router_logits`` is set, which published configs leave off, so a plain
    transformers fine-tune trains without it; lmforge keeps it because it is the coefficient the
    model was trained with, an unbalanced router costs throughput under expert parallelism and can
    collapse onto few experts, and at 0.001-0.02 times a value near ``k`` the term is small next to
    the cross-entropy (the logged ``loss`` is the cross-entropy alone either way).
    ``training.router_aux_loss_coef=0`` gives transformers' default.
    """
    weights = RouterLossWeights.for_run(aux, z, args)
    if weights is None:
        return None
    if trainer not in NEXT_TOKEN_TRAINERS:
        return f"off ({trainer} trains MoE models without router terms)"
    source = "model config" if aux is None else "training.router_aux_loss_coef"
    return (f"aux {weights.aux:g} ({source}; transformers adds it only with output_router_logits, "
            f"0 turns it off), z {weights.z:g}; per microbatch, padding excluded")


def add_router_terms(loss_sum: torch.Tensor, stats: LossStats, model: nn.Module,
                     weights: RouterLossWeights | None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``loss_sum`` plus the router terms of ``model``'s last forward over the real tokens of ``mask``
    ([B, T]; None: every token), weighted by the microbatch's target tokens; records them (and the
    expert counts) in ``stats.sums``."""
    if weights is None:
        return loss_sum
    terms = router_losses(model, mask)
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
