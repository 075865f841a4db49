"""Reward modelling: a scalar score per sequence, trained on preference pairs with the Bradley-Terry loss.

Per pair, with ``rc``/``rr`` the scores of the chosen/rejected sequence and ``m`` the record's margin
(0 when absent)::

    loss = -log sigmoid(rc - rr - m) + c * (rc + rr)^2

The first term is the negative log-likelihood of "chosen beats rejected" under the Bradley-Terry model
(with the margin, chosen must win by at least ``m`` before the loss flattens); the second
(``rm.center_rewards_coefficient`` = c, 0 by default) pulls each pair's scores towards a zero mean,
since the first term only sees score differences and would let the level drift.

A sequence's score is the score head at its last token's final-normed hidden state
(:mod:`lmforge.models.heads`), read inside the model's forward. The loss is a sum over a
microbatch's pairs, divided by the pairs of the whole step (all microbatches and ranks), so any split
gives the same gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmforge.distributed import EVERY_RANK, ReduceGroup
from lmforge.data.packing import IGNORE_INDEX, Batch
from lmforge.data.preference_data import pair_values, pairs_in
from lmforge.models.heads import ScoreHead, last_positions, score_layer
from lmforge.losses.stats import LossStats


def bradley_terry_losses(chosen: Tensor, rejected: Tensor, margin: Tensor | float = 0.0,
                         center_coefficient: float = 0.0) -> Tensor:
    """Per-pair loss (see the module docstring)."""
    losses = -F.logsigmoid(chosen - rejected - margin)
    if center_coefficient:
        losses = losses + center_coefficient * (chosen + rejected) ** 2
    return losses


def sequence_ends(batch: Batch) -> Tensor:
    """Flat positions of every sequence's last token (chosen, rejected alternating), from host data."""
    assert batch.document_lengths is not None, "preference rows always carry their document lengths"
    return last_positions(batch.document_lengths, batch.input_ids.shape[1], batch.input_ids.device)


def sequence_scores(model: nn.Module, batch: Batch, ends: Tensor | None = None) -> Tensor:
    """The score of every sequence of a batch of preference rows, ``[2 * pairs]`` (chosen, rejected
    alternating), float32; differentiable when called with grad enabled."""
    head = ScoreHead(score_layer(model), sequence_ends(batch) if ends is None else ends)
    return model(batch.input_ids, position_ids=batch.position_ids, document_ids=batch.document_ids, head=head)


def batch_margins(batch: Batch, ends: Tensor) -> Tensor | float:
    """Each pair's margin (its value, see :mod:`lmforge.data.reward_data`), or 0 without values."""
    margins = pair_values(batch, ends.device)
    return 0.0 if margins is None else margins


class RewardLoss:
    """``(model, rows of pairs) -> (summed loss, summed statistics)`` for ``gradient_computation``."""

    def __init__(self, center_coefficient: float = 0.0) -> None:
        self.center_coefficient = center_coefficient

    def __call__(self, model: nn.Module, batch: Batch) -> tuple[Tensor, LossStats]:
        ends = sequence_ends(batch)
        scores = sequence_scores(model, batch, ends)
        chosen, rejected = scores[0::2], scores[1::2]
        margin = batch_margins(batch, ends)
        losses = bradley_terry_losses(chosen, rejected, margin, self.center_coefficient)
        objective = losses.sum()
        with torch.no_grad():
            c, r = chosen.detach(), rejected.detach()
            # a tie counts half: an untrained (zero) head scores 0.5, the chance level, not 0
            correct = (c > r).float() + 0.5 * (c == r).float()
            sums = {"chosen_score_sum": c.sum(), "rejected_score_sum": r.sum(), "correct_count": correct.sum(),
                    "bt_loss_sum": (-F.logsigmoid(c - r - margin)).sum()}
            # the loss is a mean over pairs; total_weights counts the response tokens, as DPO's
            stats = LossStats(objective.detach(), losses.new_tensor(float(len(losses))),
                              (batch.labels != IGNORE_INDEX).sum(), sums)
        return objective, stats


class RewardObjective:
    """The reward-model loss, the step's pair count over all microbatches and ranks as its normalizer,
    and the logged means over pairs (exact under accumulation and ranks: sums over the global count)."""

    console_keys = ("pair_accuracy", "score/margin")
    watch_spikes = False  # the loss heads for 0, where a ratio to its running mean flags ordinary noise

    def __init__(self, center_coefficient: float = 0.0) -> None:
        self.loss_fn = RewardLoss(center_coefficient)

    def normalizer(self, microbatches: list[Batch], reduce: ReduceGroup = EVERY_RANK) -> Tensor:
        local = torch.tensor(float(sum(pairs_in(mb) for mb in microbatches)), device=microbatches[0].input_ids.device)
        return reduce.sum(local)

    def log_values(self, totals: dict[str, Tensor]) -> dict[str, Tensor]:
        """``pair_accuracy``: share of pairs scored chosen > rejected (ties half); ``score/margin``: mean
        chosen minus rejected score; ``loss/bt``: the Bradley-Terry term alone."""
        pairs = totals["loss_weight"].clamp(min=1)
        chosen, rejected = totals["chosen_score_sum"] / pairs, totals["rejected_score_sum"] / pairs
        return {"loss": totals["loss"], "total_weights": totals["total_weights"], "pairs": totals["loss_weight"],
                "pair_accuracy": totals["correct_count"] / pairs, "score/chosen": chosen,
                "score/rejected": rejected, "score/margin": chosen - rejected, "loss/bt": totals["bt_loss_sum"] / pairs}
