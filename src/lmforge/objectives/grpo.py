"""The GRPO objective: group-relative advantages, clipped importance ratio, k3 KL, aggregation.

Notation for one update batch of N completions o_1..o_N, drawn in groups of G per prompt:
r_i is the weighted reward of o_i, |o_i| its number of completion tokens (the EOS included),
pi the policy being trained, pi_old the policy that sampled the batch, pi_ref the frozen
reference model. All log-probabilities are of the sampling distribution, i.e. of
softmax(logits / temperature), so that ratios compare the same distributions the rollout drew from.

The loss function returns the *sum* of its terms per microbatch; the shared
``gradient_computation`` divides by a global normalizer that depends on the aggregation mode
(:func:`aggregation_weight`), so the result does not depend on how the batch is split into
microbatches or ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from lmforge.data.packing import image_inputs
from lmforge.distributed import EVERY_RANK, ReduceGroup
from lmforge.objectives.policy_losses import PolicyLoss, check_policy_loss, policy_terms
from lmforge.losses.chunked_loss import DEFAULT_CHUNK_TOKENS, TargetLogprobHead
from lmforge.losses.stats import LossStats
from lmforge.models.layers.routing_replay import replay_disagreement, replay_routes

Aggregation = Literal["grpo", "dapo", "dr_grpo"]
AdvantageScale = Literal["group", "batch", "none"]
AdvantageStd = Literal["population", "sample"]

STD_EPS = 1e-4
"""Added to the reward std before dividing, so groups with tiny spread do not blow up."""


@dataclass
class PolicyBatch:
    """One microbatch of completions laid out for a teacher-forced forward pass.

    Row i is ``prompt_i + completion_i`` right-padded; ``targets[i, t]`` is the token that follows
    ``input_ids[i, t]`` and ``mask[i, t]`` is 1.0 where that target is a completion token.
    """

    input_ids: Tensor
    targets: Tensor
    mask: Tensor
    advantages: Tensor
    """[B] group-relative advantage of each completion."""
    old_logprobs: Tensor | None = None
    """[B, T] log pi_old of each target; None means "the current policy" (one update per rollout)."""
    ref_logprobs: Tensor | None = None
    """[B, T] log pi_ref of each target; only present when the KL penalty is on."""
    rollout_logprobs: Tensor | None = None
    """[B, T] log-probs of the sampled tokens as the sampler computed them (its own precision or
    engine); only present with the truncated importance-sampling correction (``grpo.tis_cap``)."""
    routes: Tensor | None = None
    """[n_moe_layers, B, T, k] the experts the rollout engine sent each input token to (``grpo.router_replay``):
    every forward over this batch replays them (:mod:`lmforge.models.layers.routing_replay`)."""
    pixel_values: Tensor | None = None
    """The rows' prompt images in row order (a vision-language policy; see ``Batch.pixel_values``): every
    forward over this batch (old, reference, loss) sees the images the completions were sampled on."""
    image_grid_thw: Tensor | None = None
    """Qwen: the images' patch grids, in the same order; None for Gemma 3 and text."""

    def image_inputs(self) -> dict[str, Tensor]:
        """The model's image keyword arguments; empty for text."""
        return image_inputs(self.pixel_values, self.image_grid_thw)

    def to(self, device: torch.device | str) -> "PolicyBatch":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return PolicyBatch(move(self.input_ids), move(self.targets), move(self.mask), move(self.advantages),
                           move(self.old_logprobs), move(self.ref_logprobs), move(self.rollout_logprobs),
                           move(self.routes), move(self.pixel_values), move(self.image_grid_thw))


def policy_rows(prompts: list[list[int]], completions: list[list[int]], keep: list[bool], pad_id: int,
           advantages: Tensor, device: torch.device, masks: list[list[int]] | None = None) -> PolicyBatch:
    """Right-padded ``prompt + completion`` rows with next-token targets and a completion mask.

    Right padding keeps every real token at the position it would have alone (positions count from
    0 at the row's first token, as in generation), and padding only ever follows real tokens.
    """
    seqs = [p + c for p, c in zip(prompts, completions)]
    T = max(len(x) for x in seqs) - 1
    B = len(seqs)
    ids = torch.full((B, T + 1), pad_id, dtype=torch.long)
    mask = torch.zeros(B, T)
    for i, (p, c, seq) in enumerate(zip(prompts, completions, seqs)):
        ids[i, : len(seq)] = torch.tensor(seq)
        if keep[i]:  # the targets at these positions are the completion (its policy-written tokens)
            mask[i, len(p) - 1: len(seq) - 1] = 1.0 if masks is None else torch.tensor(masks[i], dtype=torch.float32)
    return PolicyBatch(ids[:, :-1].to(device), ids[:, 1:].to(device), mask.to(device), advantages.float())


def group_advantages(rewards: Tensor, group_size: int, scale: AdvantageScale,
                     std: AdvantageStd = "population", reduce: ReduceGroup = EVERY_RANK) -> tuple[Tensor, Tensor]:
    """Advantages A_i and the number of groups whose rewards are all equal.

    A_i = r_i - mean_{j in group(i)} r_j, then divided by
      * ``group``: std_{j in group(i)} r_j + eps   (GRPO),
      * ``batch``: std over the whole batch (the ranks of ``reduce``) + eps,
      * ``none``:  nothing (Dr. GRPO: the std division favours groups with little spread).
    ``std="population"`` divides the variance by its count (G for a group), ``"sample"`` by count - 1
    (Bessel's correction: TRL's and verl's form, larger by sqrt(G / (G - 1)), 1.07 at G = 8).
    A group whose rewards are all equal has A = 0 for every member: it contributes no gradient.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not form whole groups of {group_size}")
    r = rewards.float().view(-1, group_size)
    centered = r - r.mean(dim=1, keepdim=True)
    zero_std_groups = (r.amax(dim=1) == r.amin(dim=1)).sum()
    if scale == "group":
        centered = centered / (r.std(dim=1, unbiased=std == "sample", keepdim=True) + STD_EPS)
    elif scale == "batch":
        flat = rewards.float()
        sums = reduce.sum(torch.stack([flat.new_tensor(flat.numel()), flat.sum(), (flat ** 2).sum()]))
        mean = sums[1] / sums[0]
        var = (sums[2] / sums[0] - mean ** 2).clamp(min=0)
        if std == "sample":
            var = var * sums[0] / (sums[0] - 1).clamp(min=1)
        centered = centered / (var.sqrt() + STD_EPS)
    elif scale != "none":
        raise ValueError(f"unknown advantage scale {scale!r}")
    return centered.flatten(), zero_std_groups


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref): exp(d) - d - 1 with d = log pi_ref - log pi.

    Unbiased for the KL when tokens are sampled from pi, and >= 0 for every token (e^d >= 1 + d),
    so it never rewards moving away from the reference; it is exactly 0 where the policies agree.
    """
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1


def aggregation_weight(mask: Tensor, mode: Aggregation, max_new_tokens: int) -> Tensor:
    """This microbatch's share of the global loss normalizer for ``mode``.

    * ``grpo``:    number of completions (with at least one token in the loss);
    * ``dapo``:    number of completion tokens;
    * ``dr_grpo``: number of completions x max_new_tokens (a constant per batch).
    Summed over all microbatches and ranks this is the denominator of the loss.
    """
    if mode == "grpo":
        return (mask.sum(dim=1) > 0).sum().float()
    if mode == "dapo":
        return mask.sum()
    if mode == "dr_grpo":
        return mask.new_tensor(float(mask.shape[0] * max_new_tokens))
    raise ValueError(f"unknown loss aggregation {mode!r}")


def aggregate(per_token: Tensor, mask: Tensor, mode: Aggregation) -> Tensor:
    """Numerator of the loss for ``mode`` (see :func:`aggregation_weight` for the denominator).

    * ``grpo``:    L = 1/N sum_i 1/|o_i| sum_t l_it  -> numerator sum_i (sum_t l_it / |o_i|):
      every completion weighs the same, so tokens of long completions weigh less;
    * ``dapo``:    L = sum_{i,t} l_it / sum_i |o_i|  -> numerator sum_{i,t} l_it: every token weighs
      the same;
    * ``dr_grpo``: L = sum_{i,t} l_it / (N * max_new_tokens) -> numerator sum_{i,t} l_it: a constant
      denominator, so no length bias at all.
    """
    summed = (per_token * mask).sum(dim=1)
    if mode == "grpo":
        return (summed / mask.sum(dim=1).clamp(min=1)).sum()
    return summed.sum()


def tis_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, cap: float) -> Tensor:
    """Truncated importance-sampling weights min(pi_old / pi_rollout, cap) per token (no gradient).

    The completions were drawn from the sampler's distribution pi_rollout, while the ratio of the
    loss is taken against pi_old as the training forward computes it; where the two differ (another
    precision or inference engine) the weight corrects the sampling, and the cap bounds its variance.
    """
    return torch.exp(old_logprobs - rollout_logprobs).clamp(max=cap).detach()


def policy_logprobs(model: nn.Module, batch: PolicyBatch, temperature: float, *, chunk_tokens: int,
                    entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """log p(target) [B, T] under softmax(logits / temperature), and the entropy [B, T] (no grad) if asked.

    Only completion positions (``mask > 0``) are computed, ``chunk_tokens`` rows of logits at a time
    (see :mod:`lmforge.losses.chunked_loss`); every other position holds 0. Differentiable when
    called with grad enabled. A batch with ``routes`` sends every token to the experts recorded there.
    """
    head = TargetLogprobHead(batch.targets, batch.mask > 0, chunk_tokens=chunk_tokens, temperature=temperature,
                             entropy=entropy)
    with replay_routes(model, batch.routes):
        out = model(batch.input_ids, head=head, **batch.image_inputs())
    shape = batch.targets.shape
    ent = None if out.entropy is None else out.dense(out.entropy, shape)
    return out.dense(out.logprobs, shape), ent


@torch.no_grad()
def token_logprobs(model: nn.Module, batch: PolicyBatch, temperature: float,
                   chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Tensor:
    """log p(target) at completion positions (0 elsewhere), for the old-policy and reference passes."""
    return policy_logprobs(model, batch, temperature, chunk_tokens=chunk_tokens)[0]


class GRPOLoss:
    """The loss function handed to ``gradient_computation``: ``(model, PolicyBatch) -> (sum, stats)``.

    Per completion token t of o_i, with ratio rho = pi(t) / pi_old(t) and advantage A_i, for the
    default ``policy_loss="ppo"``:
        l_it = -min(rho * A_i, clip(rho, 1 - eps_low, 1 + eps_high) * A_i) + beta * k3_it
    The clip keeps a token from moving the policy further once its ratio has left the trust region
    in the direction the advantage pushes it. Separate low/high epsilons (DAPO's "clip-higher")
    let rarely sampled tokens grow faster than they may shrink. ``gspo`` and ``cispo`` replace the
    policy term (:mod:`lmforge.objectives.policy_losses`); the KL term and the aggregation stay.

    With ``tis_cap`` and rollout log-probs in the batch, each token's policy term is multiplied by
    :func:`tis_weights` (the KL term is not: it is an expectation under the policy, not the sampler).
    """

    def __init__(self, *, eps_low: float, eps_high: float, beta: float, aggregation: Aggregation,
                 max_new_tokens: int, temperature: float, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 tis_cap: float = 0.0, policy_loss: PolicyLoss = "ppo") -> None:
        check_policy_loss(policy_loss, aggregation)
        self.eps_low, self.eps_high, self.beta = eps_low, eps_high, beta
        self.aggregation, self.max_new_tokens, self.temperature = aggregation, max_new_tokens, temperature
        self.chunk_tokens, self.tis_cap, self.policy_loss = chunk_tokens, tis_cap, policy_loss

    def __call__(self, model: nn.Module, batch: PolicyBatch) -> tuple[Tensor, LossStats]:
        logp, entropy = policy_logprobs(model, batch, self.temperature, chunk_tokens=self.chunk_tokens, entropy=True)
        assert entropy is not None
        mask = batch.mask
        old = logp.detach() if batch.old_logprobs is None else batch.old_logprobs
        adv = batch.advantages.unsqueeze(1)
        terms = policy_terms(self.policy_loss, logp, old, adv, mask, self.eps_low, self.eps_high)
        surrogate = terms.per_token
        tis = None
        if self.tis_cap and batch.rollout_logprobs is not None:
            tis = tis_weights(old, batch.rollout_logprobs, self.tis_cap)
            surrogate = surrogate * tis
        policy_sum = aggregate(surrogate, mask, self.aggregation)
        objective = policy_sum
        kl = torch.zeros_like(logp)
        if self.beta > 0:
            kl = k3_kl(logp, batch.ref_logprobs)
            objective = objective + self.beta * aggregate(kl, mask, self.aggregation)
        with torch.no_grad():
            sums = {
                "policy_loss_sum": policy_sum.detach(),
                "kl_sum": (kl.detach() * mask).sum(),
                "clip_low_count": (terms.clipped_low.float() * mask).sum(),
                "clip_high_count": (terms.clipped_high.float() * mask).sum(),
                "entropy_sum": (entropy * mask).sum(),
            }
            if batch.rollout_logprobs is not None:  # how far the sampler's numbers are from the trainer's
                sums["rollout_gap_sum"] = ((old - batch.rollout_logprobs).abs() * mask).sum()
            if tis is not None:
                sums["tis_weight_sum"] = (tis * mask).sum()
            flips = replay_disagreement(model, batch.input_ids.shape) if batch.routes is not None else None
            if flips is not None:  # how often the trainer would have routed a completion token elsewhere
                sums["route_flip_sum"] = (flips * (mask > 0)).sum()
            stats = LossStats(objective.detach(), aggregation_weight(mask, self.aggregation, self.max_new_tokens),
                              mask.sum(), sums)
        return objective, stats


def loss_normalizer(batches: list[PolicyBatch], aggregation: Aggregation, max_new_tokens: int,
                    reduce: ReduceGroup = EVERY_RANK) -> Tensor:
    """The global denominator of the loss: the shares of :func:`aggregation_weight` over the ranks of
    ``reduce``."""
    local = torch.stack([aggregation_weight(b.mask, aggregation, max_new_tokens) for b in batches]).sum()
    return reduce.sum(local)


def update_metrics(totals: dict[str, Tensor]) -> dict[str, Tensor]:
    """Turn the summed statistics (after ``compute_global_loss``) into per-token / per-batch means."""
    tokens = totals["total_weights"].clamp(min=1)  # the completion tokens that carry loss
    weights = totals["loss_weight"].clamp(min=1)
    return {
        "grpo/policy_loss": totals["policy_loss_sum"] / weights,
        "grpo/kl": totals["kl_sum"] / tokens,
        "grpo/clip_low": totals["clip_low_count"] / tokens,
        "grpo/clip_high": totals["clip_high_count"] / tokens,
        "grpo/entropy": totals["entropy_sum"] / tokens,
    } | ({"grpo/rollout_logprob_gap": totals["rollout_gap_sum"] / tokens} if "rollout_gap_sum" in totals else {}) \
      | ({"grpo/tis_weight": totals["tis_weight_sum"] / tokens} if "tis_weight_sum" in totals else {}) \
      | ({"grpo/route_flips": totals["route_flip_sum"] / tokens} if "route_flip_sum" in totals else {})


class GRPOObjective:
    """What the shared loop needs from GRPO: the loss, its global normalizer, and the logged values.

    ``total_weights`` on the log line is the completion tokens that carry loss (as for every trainer:
    the non-padding target tokens); ``loss`` is the aggregated objective over its own weight.
    """

    console_keys = ("reward/mean", "grpo/kl", "grpo/clip_high", "completion/mean_length")
    watch_spikes = False  # the GRPO loss hovers around 0 with either sign: a ratio test means nothing

    def __init__(self, *, eps_low: float, eps_high: float, beta: float, aggregation: Aggregation,
                 max_new_tokens: int, temperature: float, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 tis_cap: float = 0.0, policy_loss: PolicyLoss = "ppo") -> None:
        self.loss_fn = GRPOLoss(eps_low=eps_low, eps_high=eps_high, beta=beta, aggregation=aggregation,
                                max_new_tokens=max_new_tokens, temperature=temperature, chunk_tokens=chunk_tokens,
                                tis_cap=tis_cap, policy_loss=policy_loss)
        self.aggregation, self.max_new_tokens = aggregation, max_new_tokens

    def normalizer(self, microbatches: list[PolicyBatch], reduce: ReduceGroup = EVERY_RANK) -> Tensor:
        return loss_normalizer(microbatches, self.aggregation, self.max_new_tokens, reduce)

    def log_values(self, totals: dict[str, Tensor]) -> dict[str, Tensor]:
        return {"loss": totals["loss"], "total_weights": totals["total_weights"]} | update_metrics(totals)
