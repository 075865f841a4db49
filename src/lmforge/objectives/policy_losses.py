"""The policy term of the GRPO loss, per completion token, for each ``grpo.policy_loss``.

Each function maps the policy's log-probabilities ``logp`` [B, T] (differentiable), pi_old's ``old``
[B, T] (no gradient), the advantages ``adv`` [B, 1] and the completion ``mask`` [B, T] to a per-token
term l_it (aggregated by :func:`lmforge.objectives.grpo.aggregate`) and two boolean maps saying which
tokens count as clipped below / above, for the ``grpo/clip_low`` / ``grpo/clip_high`` statistics.
r_it = pi(t) / pi_old(t) is the token ratio, A_i the advantage of completion i.

* ``ppo``   (GRPO, DAPO): l_it = -min(r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i). A token
  whose ratio left the trust region in the direction its advantage pushes gets no gradient.
* ``gspo``  (Zheng et al. 2025, Group Sequence Policy Optimization): one ratio per completion,
  s_i = exp(1/|o_i| sum_t (log pi(t) - log pi_old(t))), clipped as a whole:
  loss_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i). Written in the paper's
  GSPO-token form, l_it = -min(s_it A_i, clip(s_it) A_i) with s_it = sg[s_i] pi(t) / sg[pi(t)]:
  s_it has the value s_i, so the mean of l_it over the completion's tokens is loss_i, and its gradient
  is s_i grad log pi(t), so that mean's gradient is the paper's -A_i s_i 1/|o_i| sum_t grad log pi(t)
  (0 for the whole completion when it is clipped on the side A_i pushes). The mean over the tokens is
  what the ``grpo`` aggregation takes, which is why gspo needs it (:func:`check_policy_loss`).
* ``cispo`` (MiniMax-M1, 2025): l_it = -sg[clip(r_it, 1 - eps_low, 1 + eps_high)] A_i log pi(t). The
  clip bounds the importance weight, never the update: every token keeps its gradient
  -w_it A_i grad log pi(t). Its value is a REINFORCE-style objective (it moves with log pi, not with
  the ratio), so ``grpo/policy_loss`` is not comparable with the other two losses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # PolicyLoss and check_policy_loss are read by the GRPO config, which loads without torch
    from torch import Tensor

PolicyLoss = Literal["ppo", "gspo", "cispo"]


@dataclass
class PolicyTerms:
    per_token: Tensor
    """[B, T] l_it, before the truncated-IS weight and the mask."""
    clipped_low: Tensor
    """[B, T] bool: the token counts as clipped at 1 - eps_low (see each loss for what that means)."""
    clipped_high: Tensor
    """[B, T] bool: the token counts as clipped at 1 + eps_high."""


def check_policy_loss(policy_loss: str, aggregation: str) -> None:
    """Refuse an unknown policy loss, or one combined with an aggregation that changes what it means.

    gspo's loss is a plain mean over completions of per-completion losses; with ``dapo`` or ``dr_grpo``
    each completion's loss would weigh as much as it has tokens, which is not GSPO's objective.
    """
    if policy_loss not in POLICY_LOSSES:
        raise ValueError(f"grpo.policy_loss must be one of {', '.join(POLICY_LOSSES)} (got {policy_loss!r})")
    if policy_loss == "gspo" and aggregation != "grpo":
        raise ValueError(f"grpo.policy_loss = 'gspo' averages per completion: it needs grpo.loss_aggregation = "
                         f"'grpo' (got {aggregation!r})")


def ppo_terms(logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, eps_low: float, eps_high: float) -> PolicyTerms:
    """The token-level clipped surrogate; clipped tokens are those whose gradient the clip removed."""
    ratio = (logp - old).exp()
    clipped_ratio = ratio.clamp(1 - eps_low, 1 + eps_high)
    surrogate = -(ratio * adv).minimum(clipped_ratio * adv)
    r = ratio.detach()
    return PolicyTerms(surrogate, (r < 1 - eps_low) & (adv < 0), (r > 1 + eps_high) & (adv > 0))


def sequence_log_ratio(logp: Tensor, old: Tensor, mask: Tensor) -> Tensor:
    """[B, 1] log s_i = 1/|o_i| sum_t mask_it (log pi(t) - log pi_old(t)); 0 for a completion without tokens."""
    diff = (logp - old).where(mask > 0, 0.0)  # what sits at padding never reaches the sum, not even as NaN
    return diff.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)


def gspo_terms(logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, eps_low: float, eps_high: float) -> PolicyTerms:
    """GSPO-token: the sequence ratio's value at every token, each token's own log-prob's gradient.

    A token counts as clipped when its completion was (the share of tokens in clipped completions).
    """
    log_s = sequence_log_ratio(logp.detach(), old, mask)
    s_t = (log_s + logp - logp.detach()).exp()  # value s_i, d s_t / d log pi(t) = s_i
    clipped = s_t.clamp(1 - eps_low, 1 + eps_high)
    surrogate = -(s_t * adv).minimum(clipped * adv)
    s = log_s.exp().expand_as(logp)
    return PolicyTerms(surrogate, (s < 1 - eps_low) & (adv < 0), (s > 1 + eps_high) & (adv > 0))


def cispo_terms(logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, eps_low: float, eps_high: float) -> PolicyTerms:
    """The clipped, detached IS weight times the policy gradient's -A log pi.

    A token counts as clipped when its weight was truncated, whatever the advantage's sign: the clip
    changes the size of its gradient (it never removes it).
    """
    ratio = (logp - old).detach().exp()
    weight = ratio.clamp(1 - eps_low, 1 + eps_high)
    return PolicyTerms(-weight * adv * logp, ratio < 1 - eps_low, ratio > 1 + eps_high)


TERMS = {"ppo": ppo_terms, "gspo": gspo_terms, "cispo": cispo_terms}
POLICY_LOSSES: tuple[str, ...] = tuple(TERMS)


def policy_terms(policy_loss: PolicyLoss, logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor,
                 eps_low: float, eps_high: float) -> PolicyTerms:
    """The per-token policy term of ``policy_loss`` (see the module docstring)."""
    return TERMS[policy_loss](logp, old, adv, mask, eps_low, eps_high)
