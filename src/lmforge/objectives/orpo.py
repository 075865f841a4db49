"""ORPO (odds-ratio preference optimization): SFT on the chosen response plus an odds-ratio term
against the rejected one, with no reference model and no separate SFT stage.

Per pair, with ``ac = pc / nc`` and ``ar = pr / nr`` the policy's mean token log-probs of the chosen
and rejected responses (``P = exp(a)`` the geometric-mean token probability), the odds of a response
are ``P / (1 - P)`` and

    log_odds = (ac - ar) - (log(1 - exp(ac)) - log(1 - exp(ar)))
    loss     = -ac - lambda * log sigmoid(log_odds)

where ``-ac`` is the chosen response's per-token negative log-likelihood (this pair's SFT term) and
``lambda`` (``orpo.beta``) weighs the odds ratio. ``log(1 - exp(a))`` is computed as
``log(-expm1(a))`` near ``a = 0`` and ``log1p(-exp(a))`` below ``-ln 2``, which stays finite and
accurate where the naive form loses every digit (a response the model already predicts with
probability near 1).

Normalisation of the SFT term (``orpo.nll``):

* ``pair`` (default, the paper's formula: ``L_SFT`` is each pair's mean token NLL, averaged over
  pairs): every pair weighs the same; the sum over pairs is divided by the step's pairs (the shared
  pair rule).
* ``token`` (TRL's and the ORPO authors' code: a cross-entropy over all chosen tokens of the batch):
  the step's chosen-token NLL sum divided by the step's chosen tokens, over every microbatch and
  rank (so it does not change with the split; TRL's is per device batch), which weighs long responses
  more. Each pair contributes ``-pc * pairs / chosen_tokens`` to the pair sum, with both counts the
  step's (:meth:`ORPOObjective.normalizer`); an eval batch uses its own counts.

Logged rewards are ``lambda`` x the mean token log-probs.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmforge.distributed import EVERY_RANK, ReduceGroup
from lmforge.data.packing import IGNORE_INDEX, Batch
from lmforge.objectives.pairwise import PairLogps, PairTerms, PairwiseLoss, PairwiseObjective
from lmforge.losses.chunked_loss import DEFAULT_CHUNK_TOKENS


def log1m_exp(a: Tensor) -> Tensor:
    """``log(1 - exp(a))`` for ``a <= 0``, accurate near 0 and for very negative ``a``. ``a`` is clamped
    at -1e-7 (float32's resolution next to 1): a mean log-prob of exactly 0 would give log(0), and one
    closer to 0 a gradient of about -1/a, so the odds of a response already near-certain stop growing there."""
    a = a.clamp(max=-1e-7)
    return torch.where(a > -math.log(2), torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))


def orpo_log_odds(ac: Tensor, ar: Tensor) -> Tensor:
    """log(odds(chosen) / odds(rejected)) from mean token log-probs."""
    return (ac - ar) - (log1m_exp(ac) - log1m_exp(ar))


NLLNorm = Literal["pair", "token"]


def chosen_tokens(batch: Batch) -> Tensor:
    """Target tokens of the chosen responses in ``batch`` (device count, no host sync): a row's
    documents alternate chosen, rejected, so the chosen ones have even document ids."""
    assert batch.document_ids is not None, "preference rows always carry document ids"
    return ((batch.labels != IGNORE_INDEX) & (batch.document_ids % 2 == 0)).sum()


class ORPOLoss(PairwiseLoss):
    def __init__(self, *, beta: float, nll: NLLNorm = "pair", chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        super().__init__(None, chunk_tokens)
        self.beta, self.nll = beta, nll
        self.step_scale: dict[int, Tensor] = {}
        """``nll="token"``: pairs / chosen tokens of the step, per microbatch id (set by the normalizer)."""
        self._scale: Tensor | None = None

    def __call__(self, model: nn.Module, batch: Batch) -> tuple[Tensor, Any]:
        self._scale = self.step_scale.pop(id(batch), None)  # None in eval: the batch's own counts
        return super().__call__(model, batch)

    def terms(self, lp: PairLogps) -> PairTerms:
        ac, ar = lp.pc / lp.nc, lp.pr / lp.nr
        log_odds = orpo_log_odds(ac, ar)
        odds_term = F.logsigmoid(log_odds)
        if self.nll == "token":
            scale = self._scale if self._scale is not None else len(lp.pc) / lp.nc.sum().clamp(min=1)
            nll = -lp.pc * scale
        else:
            nll = -ac
        losses = nll - self.beta * odds_term
        return PairTerms(losses, self.beta * ac, self.beta * ar,
                         {"chosen_nll_sum": nll.detach().sum(), "log_odds_ratio_sum": odds_term.detach().sum(),
                          "log_odds_chosen_sum": log_odds.detach().sum()})


class ORPOObjective(PairwiseObjective):
    """ORPO over the step's pairs: ``nll/chosen`` is the SFT term, ``log_odds_ratio`` the mean
    log sigmoid(log_odds) and ``log_odds_chosen`` the mean log odds ratio."""

    extra_logs = {"nll/chosen": "chosen_nll_sum", "log_odds_ratio": "log_odds_ratio_sum",
                  "log_odds_chosen": "log_odds_chosen_sum"}

    def __init__(self, *, beta: float, nll: NLLNorm = "pair", chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        super().__init__(ORPOLoss(beta=beta, nll=nll, chunk_tokens=chunk_tokens))

    def normalizer(self, microbatches: list[Batch], reduce: ReduceGroup = EVERY_RANK) -> Tensor:
        """The step's pairs; for ``nll="token"`` also the step's chosen tokens, over the ranks of ``reduce``."""
        pairs = super().normalizer(microbatches, reduce)
        loss = self.loss_fn
        if loss.nll == "token":
            tokens = reduce.sum(torch.stack([chosen_tokens(mb) for mb in microbatches]).sum().float())
            scale = pairs / tokens.clamp(min=1)
            loss.step_scale = {id(mb): scale for mb in microbatches}
        return pairs
