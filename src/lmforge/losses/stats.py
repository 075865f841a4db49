"""The statistics a loss function returns: typed, so no objective renames keys back.

Two counts are easy to confuse and mean different things:

* ``loss_weight`` is what the *logged* loss is a mean over: target tokens for next-token losses, pairs
  for DPO, the aggregation shares for GRPO. The logged loss is ``Σ loss_sum / Σ loss_weight``.
* ``target_tokens`` is the tokens that carry loss. It is ``total_weights`` on every trainer's log line
  and what ``training.max_tokens`` counts, whatever the loss is averaged over.

For cross-entropy both are the same count. Everything else a loss measures goes in ``sums``: sums
(never means), so they add up exactly over microbatches and ranks and objectives turn them into
means over the global counts. A sum may be a tensor of any fixed shape (an MoE's per-expert token
counts); all of them travel in the one all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lmforge.distributed import EVERY_RANK, ReduceGroup


@dataclass
class LossStats:
    """Summed statistics of one or more microbatches, as device tensors (no host sync)."""

    loss_sum: torch.Tensor
    loss_weight: torch.Tensor
    target_tokens: torch.Tensor
    sums: dict[str, torch.Tensor] = field(default_factory=dict)

    def detached(self) -> "LossStats":
        return LossStats(self.loss_sum.detach().clone(), self.loss_weight.detach().clone(),
                         self.target_tokens.detach().clone(), {k: v.detach().clone() for k, v in self.sums.items()})

    def __add__(self, other: "LossStats") -> "LossStats":
        return LossStats(self.loss_sum + other.loss_sum, self.loss_weight + other.loss_weight,
                         self.target_tokens + other.target_tokens,
                         {k: self.sums[k] + other.sums[k] for k in self.sums})

    def global_totals(self, reduce: ReduceGroup = EVERY_RANK) -> dict[str, torch.Tensor]:
        """Every count summed over the ranks of ``reduce`` (the run's ``world.dist.reduce``) in one
        all-reduce; ``loss`` is the global mean over ``loss_weight`` and ``total_weights`` the global
        target tokens."""
        keys = sorted(self.sums)
        parts = [self.loss_sum, self.loss_weight, self.target_tokens, *(self.sums[k] for k in keys)]
        local = torch.cat([p.float().reshape(-1) for p in parts])
        summed = reduce.sum(local).split([p.numel() for p in parts])
        loss_sum, weight, tokens = (t.reshape(()) for t in summed[:3])
        return {"loss": loss_sum / weight.clamp(min=1), "total_weights": tokens, "loss_weight": weight,
                **{k: t.reshape(self.sums[k].shape) for k, t in zip(keys, summed[3:])}}


def accumulate(total: LossStats | None, stats: LossStats) -> LossStats:
    """``total + stats``, starting from a copy of the first microbatch's statistics."""
    return stats.detached() if total is None else total + stats
