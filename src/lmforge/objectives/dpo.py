"""Direct preference optimization: raise the policy's log-ratio to a frozen reference on the chosen
response over the rejected one.

Notation per pair: ``pc``/``pr`` the policy's log-probs of the chosen/rejected response (sums over
the response's tokens), ``rc``/``rr`` the reference's, ``z = (pc - rc) - (pr - rr)``. Losses:

* ``sigmoid``: ``-(1 - ls) * log sigmoid(beta * z) - ls * log sigmoid(-beta * z)``, where
  ``ls = label_smoothing`` > 0 is conservative DPO (a share ``ls`` of the labels is assumed flipped);
* ``ipo``: ``(z - 1 / (2 * beta))^2``, which stops pushing once the margin reaches ``1 / (2 beta)``.
  By default (``ipo_per_token``) ``z`` is taken on per-token means, ``(pc - rc) / nc - (pr - rr) / nr``
  with ``nc``/``nr`` the responses' token counts: TRL's form, which the IPO authors confirmed is the
  one behind the paper's results; on sums the target margin ``1 / (2 beta)`` would be per sequence,
  whatever its length (with beta 0.1, 5 nats per sequence instead of per token).

``nll_weight`` > 0 adds that weight times the chosen response's negative log-likelihood per token
(RPO). Pure DPO only asks the chosen response to gain on the rejected one *relative to the
reference*; on pairs that differ in a token or two both can lose probability, the chosen one too,
and the NLL term anchors the chosen response.

The reference's log-probs are computed inside the step, in the loss function, without grad: their
time is step time and their FLOPs (one more forward pass) count in the step's FLOPs. The loss is a
sum over a microbatch's pairs, divided by the pairs of the whole step (all microbatches and ranks):
the shared pair machinery of :mod:`lmforge.objectives.pairwise`.
"""

from __future__ import annotations

from typing import Literal

import torch.nn.functional as F
from torch import Tensor

from lmforge.objectives.pairwise import PairLogps, PairTerms, PairwiseLoss, PairwiseObjective, sequence_logprobs
from lmforge.losses.chunked_loss import DEFAULT_CHUNK_TOKENS
from lmforge.objectives.reference import FrozenReference

__all__ = ["LossType", "dpo_losses", "sequence_logprobs", "DPOLoss", "DPOObjective"]

LossType = Literal["sigmoid", "ipo"]


def dpo_losses(z: Tensor, *, beta: float, loss_type: LossType, label_smoothing: float = 0.0) -> Tensor:
    """Per-pair loss from the log-ratio margin ``z`` (see the module docstring)."""
    if loss_type == "sigmoid":
        return -(1 - label_smoothing) * F.logsigmoid(beta * z) - label_smoothing * F.logsigmoid(-beta * z)
    if loss_type == "ipo":
        return (z - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown DPO loss type {loss_type!r}")


class DPOLoss(PairwiseLoss):
    """DPO's per-pair terms: the loss of the log-ratio margin, rewards ``beta * (policy - reference)``."""

    def __init__(self, reference: FrozenReference, *, beta: float, loss_type: LossType, label_smoothing: float = 0.0,
                 nll_weight: float = 0.0, ipo_per_token: bool = True, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        super().__init__(reference, chunk_tokens)
        self.beta, self.loss_type = beta, loss_type
        self.label_smoothing, self.nll_weight, self.ipo_per_token = label_smoothing, nll_weight, ipo_per_token

    def terms(self, lp: PairLogps) -> PairTerms:
        assert lp.rc is not None and lp.rr is not None
        if self.loss_type == "ipo" and self.ipo_per_token:
            z = (lp.pc - lp.rc) / lp.nc.clamp(min=1) - (lp.pr - lp.rr) / lp.nr.clamp(min=1)
        else:
            z = (lp.pc - lp.rc) - (lp.pr - lp.rr)
        losses = dpo_losses(z, beta=self.beta, loss_type=self.loss_type, label_smoothing=self.label_smoothing)
        nll = -lp.pc / lp.nc  # per token of each chosen response
        total = losses + self.nll_weight * nll if self.nll_weight else losses
        return PairTerms(total, self.beta * (lp.pc - lp.rc), self.beta * (lp.pr - lp.rr),
                         {"chosen_nll_sum": nll.detach().sum(), "dpo_loss_sum": losses.detach().sum()})


class DPOObjective(PairwiseObjective):
    """The DPO loss over the step's pairs; ``loss`` is the DPO loss, plus ``nll_weight`` x ``nll/chosen``
    if set, and ``loss/dpo`` the DPO loss alone."""

    extra_logs = {"nll/chosen": "chosen_nll_sum", "loss/dpo": "dpo_loss_sum"}

    def __init__(self, reference: FrozenReference, *, beta: float, loss_type: LossType, label_smoothing: float = 0.0,
                 nll_weight: float = 0.0, ipo_per_token: bool = True, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        super().__init__(DPOLoss(reference, beta=beta, loss_type=loss_type, label_smoothing=label_smoothing,
                                 nll_weight=nll_weight, ipo_per_token=ipo_per_token, chunk_tokens=chunk_tokens))
