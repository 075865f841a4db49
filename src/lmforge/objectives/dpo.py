"""Direct preference optimization: raise the policy's log-ratio to a frozen reference on the chosen
response over the rejected one.

Notation per pair: ``pc``/``pr`` the policy's log-probs of the chosen/rejected response (sums over
the response's tokens), ``rc``/``rr`` the reference's, ``z = (pc - rc) - (pr - rr)``. Losses:

* ``sigmoid``: ``-(1 - ls) * log sigmoid(beta * z) - ls * log sigmoid(-beta * z)``, where
  ``ls = label_smoothing`` > 0 is conservative DPO (a share ``ls`` of the labels is assumed flipped);
* ``ipo``: ``(z - 1 / (2 * beta))^2``, which stops pushing once the margin reaches ``1 / (2 beta)``.

``nll_weight`` > 0 adds that weight times the chosen response's negative log-likelihood per token
(RPO). Pure DPO only asks the chosen response to gain on the rejected one *relative to the
reference*; on pairs that differ in a token or two both can lose probability, the chosen one too,
and the NLL term anchors the chosen response.

The reference's log-probs are computed inside the step, in the loss function, without grad: their
time is step time and their FLOPs (one more forward pass) count in the step's FLOPs. The loss is a
sum over a microbatch's pairs, divided by the pairs of the whole step (all microbatches and ranks).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmforge import distributed as dist_utils
from lmforge.data.packing import IGNORE_INDEX, Batch
from lmforge.data.preference_data import pairs_in, sequence_index
from lmforge.training.chunked_loss import DEFAULT_CHUNK_TOKENS, TargetLogprobHead
from lmforge.training.reference import FrozenReference
from lmforge.training.stats import LossStats

LossType = Literal["sigmoid", "ipo"]


def dpo_losses(z: Tensor, *, beta: float, loss_type: LossType, label_smoothing: float = 0.0) -> Tensor:
    """Per-pair loss from ``z = (pc - rc) - (pr - rr)`` (see the module docstring)."""
    if loss_type == "sigmoid":
        return -(1 - label_smoothing) * F.logsigmoid(beta * z) - label_smoothing * F.logsigmoid(-beta * z)
    if loss_type == "ipo":
        return (z - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown DPO loss type {loss_type!r}")


def sequence_logprobs(model: Any, batch: Batch, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                      with_lengths: bool = False) -> Any:
    """Summed log-probs of every sequence's response tokens, ``[2 * pairs]`` (chosen, rejected
    alternating): per-token log-probs at target positions only (chunked output layer), then a
    segment sum by sequence. Differentiable when called with grad enabled. ``with_lengths``: also
    each sequence's number of response tokens."""
    mask = batch.labels != IGNORE_INDEX
    head = TargetLogprobHead(batch.labels, mask, chunk_tokens=chunk_tokens)
    out = model(batch.input_ids, position_ids=batch.position_ids, document_ids=batch.document_ids, head=head)
    index = sequence_index(batch, out.positions)
    sums = out.logprobs.new_zeros(2 * pairs_in(batch)).index_add(0, index, out.logprobs)
    if not with_lengths:
        return sums
    return sums, torch.zeros_like(sums).index_add_(0, index, torch.ones_like(out.logprobs))


class DPOLoss:
    """``(model, rows of pairs) -> (summed DPO loss, summed statistics)`` for ``gradient_computation``."""

    def __init__(self, reference: FrozenReference, *, beta: float, loss_type: LossType, label_smoothing: float = 0.0,
                 nll_weight: float = 0.0, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        self.reference, self.beta, self.loss_type = reference, beta, loss_type
        self.label_smoothing, self.nll_weight, self.chunk_tokens = label_smoothing, nll_weight, chunk_tokens

    def __call__(self, model: nn.Module, batch: Batch) -> tuple[Tensor, LossStats]:
        with torch.no_grad():
            ref = sequence_logprobs(self.reference.model_for(model), batch, self.chunk_tokens)
        logps, lengths = sequence_logprobs(model, batch, self.chunk_tokens, with_lengths=True)
        pc, pr, rc, rr = logps[0::2], logps[1::2], ref[0::2], ref[1::2]
        losses = dpo_losses((pc - rc) - (pr - rr), beta=self.beta, loss_type=self.loss_type,
                            label_smoothing=self.label_smoothing)
        nll = -pc / lengths[0::2]  # per token of each chosen response
        objective = losses.sum() + self.nll_weight * nll.sum() if self.nll_weight else losses.sum()
        with torch.no_grad():
            chosen, rejected = self.beta * (pc - rc), self.beta * (pr - rr)
            sums = {
                "chosen_reward_sum": chosen.sum(), "rejected_reward_sum": rejected.sum(),
                "ordered_count": (chosen > rejected).sum(),
                "chosen_logp_sum": pc.detach().sum(), "rejected_logp_sum": pr.detach().sum(),
                "chosen_nll_sum": nll.detach().sum(), "dpo_loss_sum": losses.detach().sum(),
            }
            # the loss is a mean over pairs; total_weights stays the target tokens
            stats = LossStats(objective.detach(), losses.new_tensor(float(len(losses))),
                              (batch.labels != IGNORE_INDEX).sum(), sums)
        return objective, stats


class DPOObjective:
    """The DPO loss, the step's pair count over all microbatches and ranks as its normalizer, and the
    logged means over pairs (exact under accumulation and ranks: sums over the global pair count)."""

    console_keys = ("rewards/accuracies", "rewards/margins")
    watch_spikes = False  # the loss heads for 0, where a ratio to its running mean flags ordinary noise

    def __init__(self, reference: FrozenReference, *, beta: float, loss_type: LossType, label_smoothing: float = 0.0,
                 nll_weight: float = 0.0, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        self.loss_fn = DPOLoss(reference, beta=beta, loss_type=loss_type, label_smoothing=label_smoothing,
                               nll_weight=nll_weight, chunk_tokens=chunk_tokens)

    def normalizer(self, microbatches: list[Batch]) -> Tensor:
        local = torch.tensor(float(sum(pairs_in(mb) for mb in microbatches)), device=microbatches[0].input_ids.device)
        return dist_utils.all_reduce_sum(local)

    def log_values(self, totals: dict[str, Tensor]) -> dict[str, Tensor]:
        """``totals`` from ``compute_global_loss``: ``loss`` is already the objective summed over the
        pairs, divided by their number (the DPO loss, plus ``nll_weight`` x ``nll/chosen`` if set)."""
        pairs = totals["loss_weight"].clamp(min=1)
        chosen, rejected = totals["chosen_reward_sum"] / pairs, totals["rejected_reward_sum"] / pairs
        return {"loss": totals["loss"], "total_weights": totals["total_weights"], "pairs": totals["loss_weight"],
                "rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/margins": chosen - rejected,
                "rewards/accuracies": totals["ordered_count"] / pairs,
                "logps/chosen": totals["chosen_logp_sum"] / pairs, "logps/rejected": totals["rejected_logp_sum"] / pairs,
                "nll/chosen": totals["chosen_nll_sum"] / pairs, "loss/dpo": totals["dpo_loss_sum"] / pairs}
