"""SimPO (simple preference optimization): a reference-free margin on length-normalised log-probs.

Per pair, with ``pc``/``pr`` the policy's summed log-probs of the chosen/rejected response and
``nc``/``nr`` their token counts, the implicit reward of a response is its *mean* token log-prob times
``beta``, and the loss asks the chosen reward to beat the rejected one by at least ``gamma``:

    loss = -log sigmoid(beta * (pc / nc - pr / nr) - gamma)

(with ``label_smoothing`` ls > 0: ``-(1 - ls) log sigmoid(x) - ls log sigmoid(-x)`` of the same ``x``).
No reference model: the length normalisation replaces DPO's reference log-ratio, so SimPO costs one
forward and backward per sequence. ``nll_weight`` > 0 adds that weight times the chosen response's
per-token negative log-likelihood (as CPO does), which keeps the chosen responses likely.
"""

from __future__ import annotations

from lmforge.objectives.pairwise import PairLogps, PairTerms, PairwiseLoss, PairwiseObjective, sigmoid_loss
from lmforge.losses.chunked_loss import DEFAULT_CHUNK_TOKENS


class SimPOLoss(PairwiseLoss):
    def __init__(self, *, beta: float, gamma: float, label_smoothing: float = 0.0, nll_weight: float = 0.0,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        super().__init__(None, chunk_tokens)
        self.beta, self.gamma, self.label_smoothing, self.nll_weight = beta, gamma, label_smoothing, nll_weight

    def terms(self, lp: PairLogps) -> PairTerms:
        chosen, rejected = self.beta * lp.pc / lp.nc, self.beta * lp.pr / lp.nr
        losses = sigmoid_loss(chosen - rejected - self.gamma, self.label_smoothing)
        nll = -lp.pc / lp.nc
        total = losses + self.nll_weight * nll if self.nll_weight else losses
        return PairTerms(total, chosen, rejected,
                         {"chosen_nll_sum": nll.detach().sum(), "simpo_loss_sum": losses.detach().sum()})


class SimPOObjective(PairwiseObjective):
    """SimPO over the step's pairs; ``rewards/*`` are ``beta`` x mean token log-probs."""

    extra_logs = {"nll/chosen": "chosen_nll_sum", "loss/simpo": "simpo_loss_sum"}

    def __init__(self, *, beta: float, gamma: float, label_smoothing: float = 0.0, nll_weight: float = 0.0,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        super().__init__(SimPOLoss(beta=beta, gamma=gamma, label_smoothing=label_smoothing, nll_weight=nll_weight,
                                   chunk_tokens=chunk_tokens))
