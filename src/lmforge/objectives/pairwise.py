"""What every preference method on pairs shares (DPO, ORPO, SimPO): the per-sequence log-probs of a
batch of pair rows, the pair count as the global normalizer, and the logged means over pairs.

A method is only its per-pair terms (:meth:`PairwiseLoss.terms`): from the policy's summed log-probs
of the chosen and rejected responses (``pc``, ``pr``), their token counts (``nc``, ``nr``) and, for a
method with a reference model, the reference's (``rc``, ``rr``), it returns each pair's loss, the
method's implicit rewards of both responses, and any extra sums to log. Everything else (the
reference's forward without grad, the chunked output layer, normalization, metrics) is here once.

Normalization: a loss function returns the *sum* of its pairs' losses; the train step divides by the
pairs of the whole step (all microbatches and ranks), so gradients and logged means are exact under
accumulation and data parallelism. A logged ``name`` in ``extra_logs`` is ``Σ sum / Σ pairs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmforge.distributed import EVERY_RANK, ReduceGroup
from lmforge.data.packing import IGNORE_INDEX, Batch
from lmforge.data.preference_data import pairs_in, sequence_index
from lmforge.losses.chunked_loss import DEFAULT_CHUNK_TOKENS, TargetLogprobHead
from lmforge.objectives.reference import FrozenReference
from lmforge.losses.stats import LossStats


def sequence_logprobs(model: Any, batch: Batch, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                      with_lengths: bool = False) -> Any:
    """Summed log-probs of every sequence's response tokens, ``[2 * pairs]`` (chosen, rejected
    alternating): per-token log-probs at target positions only (chunked output layer), then a
    segment sum by sequence. Differentiable when called with grad enabled. ``with_lengths``: also
    each sequence's number of response tokens."""
    mask = batch.labels != IGNORE_INDEX
    head = TargetLogprobHead(batch.labels, mask, chunk_tokens=chunk_tokens)
    images = batch.image_inputs()  # a vision-language model's images (Qwen: positions from their grids)
    positions = None if "image_grid_thw" in images else batch.position_ids
    out = model(batch.input_ids, position_ids=positions, document_ids=batch.document_ids, head=head, **images)
    index = sequence_index(batch, out.positions)
    sums = out.logprobs.new_zeros(2 * pairs_in(batch)).index_add(0, index, out.logprobs)
    if not with_lengths:
        return sums
    return sums, torch.zeros_like(sums).index_add_(0, index, torch.ones_like(out.logprobs))


def sigmoid_loss(x: Tensor, label_smoothing: float = 0.0) -> Tensor:
    """``-(1 - ls) log sigmoid(x) - ls log sigmoid(-x)``: the logistic loss on a margin ``x``, with a
    share ``ls`` of the preference labels assumed flipped (conservative DPO's smoothing)."""
    if not label_smoothing:
        return -F.logsigmoid(x)
    return -(1 - label_smoothing) * F.logsigmoid(x) - label_smoothing * F.logsigmoid(-x)


@dataclass
class PairLogps:
    """One batch's per-pair log-probs: the policy's (with grad) and the reference's (without), sums
    over each response's tokens; ``nc``/``nr`` are the responses' token counts."""

    pc: Tensor
    pr: Tensor
    nc: Tensor
    nr: Tensor
    rc: Tensor | None = None
    rr: Tensor | None = None


@dataclass
class PairTerms:
    """A method's per-pair results: ``losses`` [pairs] (differentiable), the implicit rewards of the
    chosen and rejected responses [pairs] (logged; accuracy is chosen > rejected), and ``sums`` of
    anything else to log (no grad)."""

    losses: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor
    sums: dict[str, Tensor] = field(default_factory=dict)


class PairwiseLoss:
    """``(model, rows of pairs) -> (summed loss, summed statistics)`` for ``gradient_computation``;
    subclasses give :meth:`terms`. ``reference`` None: a method without a reference model."""

    def __init__(self, reference: FrozenReference | None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        self.reference, self.chunk_tokens = reference, chunk_tokens

    def terms(self, lp: PairLogps) -> PairTerms:
        raise NotImplementedError

    def __call__(self, model: nn.Module, batch: Batch) -> tuple[Tensor, LossStats]:
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = sequence_logprobs(self.reference.model_for(model), batch, self.chunk_tokens)
        logps, lengths = sequence_logprobs(model, batch, self.chunk_tokens, with_lengths=True)
        lp = PairLogps(logps[0::2], logps[1::2], lengths[0::2], lengths[1::2],
                       None if ref is None else ref[0::2], None if ref is None else ref[1::2])
        t = self.terms(lp)
        objective = t.losses.sum()
        with torch.no_grad():
            chosen, rejected = t.chosen_rewards.detach(), t.rejected_rewards.detach()
            sums = {"chosen_reward_sum": chosen.sum(), "rejected_reward_sum": rejected.sum(),
                    "ordered_count": (chosen > rejected).sum(),
                    "chosen_logp_sum": lp.pc.detach().sum(), "rejected_logp_sum": lp.pr.detach().sum(),
                    **{k: v.detach() for k, v in t.sums.items()}}
            # the loss is a mean over pairs; total_weights stays the target tokens
            stats = LossStats(objective.detach(), objective.new_tensor(float(len(t.losses))),
                              (batch.labels != IGNORE_INDEX).sum(), sums)
        return objective, stats


class PairwiseObjective:
    """A :class:`PairwiseLoss`, the step's pair count over all microbatches and ranks as its
    normalizer, and the logged means over pairs. ``extra_logs`` maps a logged name to one of the
    loss's extra sums."""

    console_keys = ("rewards/accuracies", "rewards/margins")
    watch_spikes = False  # the loss heads for 0, where a ratio to its running mean flags ordinary noise
    extra_logs: dict[str, str] = {}

    def __init__(self, loss_fn: PairwiseLoss) -> None:
        self.loss_fn = loss_fn

    def normalizer(self, microbatches: list[Batch], reduce: ReduceGroup = EVERY_RANK) -> Tensor:
        local = torch.tensor(float(sum(pairs_in(mb) for mb in microbatches)), device=microbatches[0].input_ids.device)
        return reduce.sum(local)

    def log_values(self, totals: dict[str, Tensor]) -> dict[str, Tensor]:
        """``totals`` from ``compute_global_loss``: ``loss`` is already the summed objective divided by
        the pairs; every other value is a sum divided here by the same global pair count."""
        pairs = totals["loss_weight"].clamp(min=1)
        chosen, rejected = totals["chosen_reward_sum"] / pairs, totals["rejected_reward_sum"] / pairs
        return {"loss": totals["loss"], "total_weights": totals["total_weights"], "pairs": totals["loss_weight"],
                "rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/margins": chosen - rejected,
                "rewards/accuracies": totals["ordered_count"] / pairs,
                "logps/chosen": totals["chosen_logp_sum"] / pairs, "logps/rejected": totals["rejected_logp_sum"] / pairs,
                **{name: totals[key] / pairs for name, key in self.extra_logs.items()}}
