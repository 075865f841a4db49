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

Normalisation: each pair's SFT term is a mean over its own chosen tokens, so every pair weighs the
same, and the sum over pairs is divided by the step's pairs (the shared pair rule); an SFT loss that
averages all chosen tokens of a batch together would weigh long responses more and would change
with the microbatch split. Logged rewards are ``lambda`` x the mean token log-probs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from lmforge.objectives.pairwise import PairLogps, PairTerms, PairwiseLoss, PairwiseObjective
from lmforge.training.chunked_loss import DEFAULT_CHUNK_TOKENS


def log1m_exp(a: Tensor) -> Tensor:
    """``log(1 - exp(a))`` for ``a <= 0``, accurate near 0 and for very negative ``a``. ``a`` is clamped
    at -1e-7 (float32's resolution next to 1): a mean log-prob of exactly 0 would give log(0), and one
    closer to 0 a gradient of about -1/a, so the odds of a response already near-certain stop growing there."""
    a = a.clamp(max=-1e-7)
    return torch.where(a > -math.log(2), torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))


def orpo_log_odds(ac: Tensor, ar: Tensor) -> Tensor:
    """log(odds(chosen) / odds(rejected)) from mean token log-probs."""
    return (ac - ar) - (log1m_exp(ac) - log1m_exp(ar))


class ORPOLoss(PairwiseLoss):
    def __init__(self, *, beta: float, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        super().__init__(None, chunk_tokens)
        self.beta = beta

    def terms(self, lp: PairLogps) -> PairTerms:
        ac, ar = lp.pc / lp.nc, lp.pr / lp.nr
        log_odds = orpo_log_odds(ac, ar)
        odds_term = F.logsigmoid(log_odds)
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

    def __init__(self, *, beta: float, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        super().__init__(ORPOLoss(beta=beta, chunk_tokens=chunk_tokens))
