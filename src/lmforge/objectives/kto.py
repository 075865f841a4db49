"""KTO (Kahneman-Tversky optimization): single responses labelled desirable or undesirable, each
valued against a reference point instead of against a paired response.

Per example, with ``r = log pi(y|x) - log ref(y|x)`` (summed over the response's tokens) and the
reference point ``z0``:

    desirable:   loss = desirable_weight   * (1 - sigmoid(beta * (r - z0)))
    undesirable: loss = undesirable_weight * (1 - sigmoid(beta * (z0 - r)))

``z0`` estimates the policy's KL divergence from the reference: the mean, over the step's examples,
of the log-ratio of a *mismatched* completion (each example's prompt with another example's
completion, :mod:`lmforge.data.unpaired_data`), clamped at 0 and not differentiated through. It is
one number for the whole optimizer step, over every microbatch and rank, so the gradient does not
depend on how the step is split: :meth:`KTOObjective.normalizer`, which already sees the whole step
before the gradient passes, computes it with the policy and the reference without grad (one more
forward pass of each, counted in the step's FLOPs) and keeps the reference's log-probs of the
examples for the gradient pass. In eval, where batches are scored one at a time, each batch's own
mismatched completions give its reference point.

The loss is a sum over a microbatch's examples, divided by the examples of the whole step.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable

import torch
from torch import Tensor, nn

from lmforge.distributed import EVERY_RANK, ReduceGroup
from lmforge.data.packing import IGNORE_INDEX, Batch
from lmforge.data.preference_data import pair_values, pairs_in
from lmforge.objectives.pairwise import sequence_logprobs
from lmforge.losses.chunked_loss import DEFAULT_CHUNK_TOKENS
from lmforge.objectives.reference import FrozenReference
from lmforge.losses.stats import LossStats


def kto_losses(r: Tensor, z0: Tensor, desirable: Tensor, *, beta: float, desirable_weight: float = 1.0,
               undesirable_weight: float = 1.0) -> Tensor:
    """Per-example KTO loss from log-ratios ``r``, reference point ``z0`` and bool labels ``desirable``."""
    return torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (r - z0))),
                       undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r))))


def labels_of(batch: Batch, device: torch.device) -> Tensor:
    """Each example's label (bool, desirable), carried as its pair's value (1.0 or 0.0)."""
    values = pair_values(batch, device)
    assert values is not None, "KTO rows carry each example's label as its pair's value"
    return values > 0.5


class KTOLoss:
    """``(model, rows of examples) -> (summed KTO loss, summed statistics)``; the step's reference point
    and the reference's log-probs come from :meth:`prepare` (training) or from the batch (eval)."""

    def __init__(self, reference: FrozenReference, *, beta: float, desirable_weight: float = 1.0,
                 undesirable_weight: float = 1.0, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        self.reference, self.beta, self.chunk_tokens = reference, beta, chunk_tokens
        self.desirable_weight, self.undesirable_weight = desirable_weight, undesirable_weight
        self.prepared: dict[int, tuple[Tensor, Tensor]] = {}

    def _reference_logps(self, model: nn.Module, batch: Batch) -> Tensor:
        with torch.no_grad():
            return sequence_logprobs(self.reference.model_for(model), batch, self.chunk_tokens)

    def prepare(self, model: nn.Module, microbatches: list[Batch], reduce: ReduceGroup = EVERY_RANK) -> None:
        """The step's reference point over all microbatches and the ranks of ``reduce``, and each
        microbatch's reference log-probs, for the gradient pass that follows (no host sync: device
        tensors throughout)."""
        refs, kl_sum, kl_count = [], None, 0
        with torch.no_grad():
            for mb in microbatches:
                ref = self._reference_logps(model, mb)
                policy = sequence_logprobs(model, mb, self.chunk_tokens)
                refs.append(ref)
                diff = (policy[1::2] - ref[1::2]).sum()
                kl_sum = diff if kl_sum is None else kl_sum + diff
                kl_count += pairs_in(mb)
        assert kl_sum is not None, "a step has at least one microbatch"
        totals = reduce.sum(torch.stack([kl_sum.float(), kl_sum.new_tensor(float(kl_count))]))
        z0 = (totals[0] / totals[1].clamp(min=1)).clamp(min=0)
        self.prepared = {id(mb): (ref, z0) for mb, ref in zip(microbatches, refs)}

    def __call__(self, model: nn.Module, batch: Batch) -> tuple[Tensor, LossStats]:
        if id(batch) in self.prepared:
            ref, z0 = self.prepared.pop(id(batch))
        else:  # eval: this batch's own reference point
            ref = self._reference_logps(model, batch)
            with torch.no_grad():
                kl = sequence_logprobs(model, batch, self.chunk_tokens)[1::2] - ref[1::2]
            z0 = kl.mean().clamp(min=0)
        logps = sequence_logprobs(model, batch, self.chunk_tokens)
        pc, r = logps[0::2], logps[0::2] - ref[0::2]
        desirable = labels_of(batch, pc.device)
        losses = kto_losses(r, z0, desirable, beta=self.beta, desirable_weight=self.desirable_weight,
                            undesirable_weight=self.undesirable_weight)
        objective = losses.sum()
        with torch.no_grad():
            rewards, d = self.beta * r.detach(), desirable.float()
            sums = {"desirable_reward_sum": (rewards * d).sum(), "undesirable_reward_sum": (rewards * (1 - d)).sum(),
                    "desirable_count": d.sum(), "undesirable_count": (1 - d).sum(),
                    "desirable_logp_sum": (pc.detach() * d).sum(), "undesirable_logp_sum": (pc.detach() * (1 - d)).sum(),
                    "kl_sum": z0 * len(losses)}
            stats = LossStats(objective.detach(), objective.new_tensor(float(len(losses))),
                              (batch.labels != IGNORE_INDEX).sum(), sums)
        return objective, stats


class KTOObjective:
    """The KTO loss, the step's examples over all microbatches and ranks as its normalizer (and, in
    the same call, the step's reference point: see the module docstring), and the logged means:
    rewards over the desirable / undesirable examples, ``kl`` the reference point."""

    console_keys = ("kl", "rewards/margins")
    watch_spikes = False

    def __init__(self, model: nn.Module, reference: FrozenReference, *, beta: float, desirable_weight: float = 1.0,
                 undesirable_weight: float = 1.0, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 autocast: Callable[[], AbstractContextManager[Any] | None] = lambda: None) -> None:
        self.model, self.autocast = model, autocast
        self.loss_fn = KTOLoss(reference, beta=beta, desirable_weight=desirable_weight,
                               undesirable_weight=undesirable_weight, chunk_tokens=chunk_tokens)

    def normalizer(self, microbatches: list[Batch], reduce: ReduceGroup = EVERY_RANK) -> Tensor:
        with self.autocast() or nullcontext():  # the same precision as the gradient pass
            self.loss_fn.prepare(self.model, microbatches, reduce)
        local = torch.tensor(float(sum(pairs_in(mb) for mb in microbatches)), device=microbatches[0].input_ids.device)
        return reduce.sum(local)

    def log_values(self, totals: dict[str, Tensor]) -> dict[str, Tensor]:
        examples = totals["loss_weight"].clamp(min=1)
        good, bad = totals["desirable_count"].clamp(min=1), totals["undesirable_count"].clamp(min=1)
        chosen, rejected = totals["desirable_reward_sum"] / good, totals["undesirable_reward_sum"] / bad
        return {"loss": totals["loss"], "total_weights": totals["total_weights"], "examples": totals["loss_weight"],
                "rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/margins": chosen - rejected,
                "logps/chosen": totals["desirable_logp_sum"] / good, "logps/rejected": totals["undesirable_logp_sum"] / bad,
                "kl": totals["kl_sum"] / examples}
