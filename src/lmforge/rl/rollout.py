"""Rollouts: G sampled completions per prompt from the current policy, scored and laid out for the loss.

One rollout batch holds ``prompts x num_generations`` completions; rows of a group are adjacent, so
group statistics are plain reshapes. Sampling uses the KV-cache generator; each ``generate`` call
draws from a ``torch.Generator`` seeded by the position of its first prompt in the prompt order, so a
resumed run, or one on another number of ranks, draws the same completions for the same prompts.

A completion ends at the stop token (kept: the policy must learn to emit it) or is *truncated* at
``max_new_tokens``. Truncated completions stay in the loss unless ``mask_truncated`` drops them
(DAPO's overlong filtering: a cut-off answer's reward says little about its tokens).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from lmforge import distributed as dist_utils
from lmforge.distributed import EVERY_RANK, ReduceGroup
from lmforge.rl.engines.base import Completion, RolloutEngine, SamplingSettings
from lmforge.rl.engines.lmforge_engine import LmforgeEngine
from lmforge.objectives.grpo import (
    AdvantageScale, AdvantageStd, PolicyBatch, group_advantages, policy_rows, token_logprobs,
)
from lmforge.rl.image_prompts import PromptImages, attach_images
from lmforge.rl.rewards import WeightedReward, score_completions
from lmforge.losses.chunked_loss import DEFAULT_CHUNK_TOKENS


class PromptSampler:
    """Which prompts each sampling round uses: a seeded permutation per epoch, identical at any world size.

    Round k takes global positions ``[k*P, (k+1)*P)`` of the endless shuffled order; rank r of W takes
    a contiguous slice of P / W of them. Its checkpoint state is the count of prompts consumed (with
    dynamic sampling a rollout may take several rounds; the count includes them all).
    """

    def __init__(self, size: int, prompts_per_rollout: int, rank: int, world_size: int, seed: int) -> None:
        self.size, self.per_rollout, self.rank, self.world = size, prompts_per_rollout, rank, world_size
        self.seed = seed
        self.consumed = 0
        self._perm: tuple[int, np.ndarray] | None = None

    def index(self, position: int) -> int:
        """The prompt at ``position`` of the endless shuffled order."""
        epoch, pos = divmod(position, self.size)
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.size))
        return int(self._perm[1][pos])

    def next_positions(self) -> list[int]:
        """This rank's positions of the next round (and the round counted as consumed)."""
        share = self.per_rollout // self.world
        start = self.consumed + self.rank * share
        self.consumed += self.per_rollout
        return list(range(start, start + share))

    def next_indices(self) -> list[int]:
        return [self.index(p) for p in self.next_positions()]

    def state_dict(self) -> dict[str, int]:
        return {"prompts_consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed = int(state["prompts_consumed"])


@dataclass
class RolloutSettings:
    num_generations: int
    max_new_tokens: int
    temperature: float
    top_p: float
    micro_batch_size: int
    advantage_scale: AdvantageScale
    mask_truncated: bool
    need_old_logprobs: bool
    """True when a batch is reused for several updates: pi_old is then frozen at the rollout's layout (the
    policy at its first update; under async sampling that is not the sampler's weights)."""
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    """Completion tokens whose vocabulary log-softmax is computed at once (bounded memory)."""
    prompts_per_generation: int = 0
    """Prompts per ``generate`` call (0: all of a round's prompts on this rank at once)."""
    need_rollout_logprobs: bool = False
    """Record the log-probs of the sampled tokens in the rollout's precision (for ``grpo.tis_cap``)."""
    advantage_std: AdvantageStd = "population"
    """The reward standard deviation the advantages divide by (``grpo.advantage_std``)."""


@dataclass
class Rollout:
    batches: list[PolicyBatch]
    prompts: list[str]
    completions: list[str]
    rewards: list[float]
    per_function: dict[str, list[float]]
    metrics: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    """Tokens one update pass processes on this rank (padding included): the throughput numerator."""
    sequence_lengths: list[int] = field(default_factory=list)
    """Real input tokens of each row (prompt + completion minus the last target, padding excluded),
    known on the host: what the FLOPs of an update pass are counted from."""



@dataclass
class SampledGroups:
    """Completions of one or more sampling rounds, scored: ``num_generations`` adjacent rows per prompt."""

    group_size: int
    records: list[dict[str, Any]]
    """One per group (the prompt record)."""
    prompt_ids: list[list[int]]
    """One per group."""
    completion_ids: list[list[int]]
    prompts: list[Any]
    completions: list[str]
    truncated: list[bool]
    total: list[float]
    per_function: dict[str, list[float]]
    gen_seconds: float = 0.0
    """Time spent in ``generate`` (scoring excluded)."""
    logprobs: list[list[float]] | None = None
    """Per completion: the engine's log-probs of its sampled tokens (None: not asked for)."""
    version: int = 0
    """Optimizer steps the weights that sampled these groups had taken (for staleness)."""
    completion_masks: list[list[int]] | None = None
    """Per completion, 1 where the policy wrote the token and 0 where an environment did (tool results,
    template text between turns); None: every completion token is the policy's."""
    metrics: dict[str, float] = field(default_factory=dict)
    """This rank's means of per-episode statistics (multi-turn), combined over ranks when laid out."""
    routes: list[Any] | None = None
    """Per completion: the experts the engine routed its prompt + completion tokens to
    (:attr:`lmforge.rl.engines.base.Completion.routes`; ``grpo.router_replay``), None: not recorded."""
    token_versions: list[list[int]] | None = None
    """Per completion: the weight version that sampled each token (``grpo.partial_rollouts``, whose
    completions span several); None: every token was sampled at ``version``."""
    images: list[Any] | None = None
    """Per group: the prompt's :class:`lmforge.rl.image_prompts.PromptImages` (None for a text prompt);
    None: a text round. Every forward over the group's completions takes them."""

    def __post_init__(self) -> None:
        if self.images:  # restored from a checkpoint's rank state (``dataclasses.asdict``): dicts again
            self.images = [PromptImages(**x) if isinstance(x, dict) else x for x in self.images]

    def __len__(self) -> int:
        return len(self.records)

    def has_spread(self) -> list[bool]:
        """Per group: whether its rewards differ (a group whose rewards are all equal has zero
        advantages and, without a KL term, no gradient)."""
        G = self.group_size
        return [max(self.total[i * G:(i + 1) * G]) != min(self.total[i * G:(i + 1) * G]) for i in range(len(self))]

    def take(self, groups: Sequence[int]) -> "SampledGroups":
        G = self.group_size
        rows = [i * G + j for i in groups for j in range(G)]
        pick = lambda xs: [xs[r] for r in rows]  # noqa: E731
        return SampledGroups(G, [self.records[i] for i in groups], [self.prompt_ids[i] for i in groups],
                             pick(self.completion_ids), pick(self.prompts), pick(self.completions),
                             pick(self.truncated), pick(self.total), {k: pick(v) for k, v in self.per_function.items()},
                             logprobs=None if self.logprobs is None else pick(self.logprobs), version=self.version,
                             completion_masks=None if self.completion_masks is None else pick(self.completion_masks),
                             metrics=dict(self.metrics), routes=None if self.routes is None else pick(self.routes),
                             token_versions=None if self.token_versions is None else pick(self.token_versions),
                             images=None if self.images is None else [self.images[i] for i in groups])

    @staticmethod
    def concat(parts: Sequence["SampledGroups"], group_size: int) -> "SampledGroups":
        out = SampledGroups(group_size, [], [], [], [], [], [], [], {},
                            logprobs=[] if parts and all(p.logprobs is not None for p in parts) else None,
                            version=min((p.version for p in parts), default=0),
                            completion_masks=[] if parts and all(p.completion_masks is not None for p in parts) else None,
                            routes=[] if parts and all(p.routes is not None for p in parts) else None,
                            token_versions=([] if parts and any(p.token_versions is not None for p in parts)
                                            else None),
                            images=[] if parts and any(p.images is not None for p in parts) else None)
        rows = sum(len(p.completion_ids) for p in parts)
        for key in {k for p in parts for k in p.metrics}:  # means weighted by rows
            out.metrics[key] = sum(p.metrics.get(key, 0.0) * len(p.completion_ids) for p in parts) / max(rows, 1)
        for p in parts:
            if out.logprobs is not None:
                out.logprobs += p.logprobs  # type: ignore[operator]
            if out.completion_masks is not None:
                out.completion_masks += p.completion_masks  # type: ignore[operator]
            if out.routes is not None:
                out.routes += p.routes  # type: ignore[operator]
            if out.token_versions is not None:
                out.token_versions += p.token_versions or [[p.version] * len(c) for c in p.completion_ids]
            if out.images is not None:
                out.images += p.images or [None] * len(p.records)
            out.records += p.records
            out.prompt_ids += p.prompt_ids
            out.completion_ids += p.completion_ids
            out.prompts += p.prompts
            out.completions += p.completions
            out.truncated += p.truncated
            out.total += p.total
            for k, v in p.per_function.items():
                out.per_function.setdefault(k, []).extend(v)
        return out


def sample_groups(
    engine: RolloutEngine, records: Sequence[dict[str, Any]], prompt_ids: Sequence[list[int]],
    rewards: Sequence[WeightedReward], s: RolloutSettings, *, stop_ids: Sequence[int],
    decode: Callable[[list[int]], str], seed_for: Callable[[int], int], prompt_field: str = "prompt",
    engine_logprobs: bool = False, images: Sequence[Any] | None = None,
) -> SampledGroups:
    """G completions for each of ``records`` from ``engine``, scored by ``rewards``.

    Prompts go to the engine ``prompts_per_generation`` at a time; the k-th call samples with seed
    ``seed_for(k * prompts_per_generation)`` (the trainer derives it from the global position of the
    call's first prompt, so the same prompts draw the same completions at any world size).
    ``engine_logprobs``: keep the engine's log-probs of the sampled tokens (the behaviour policy's).
    ``images``: per record, its prompt's images (lmforge's engine only), or None for a text round.
    """
    G = s.num_generations
    per_call = s.prompts_per_generation or len(prompt_ids)
    sampling = SamplingSettings(s.max_new_tokens, s.temperature, s.top_p, tuple(stop_ids))
    completions_out: list[Completion] = []
    t0 = time.perf_counter()
    for lo in range(0, len(prompt_ids), per_call):
        rows = [list(p) for p in prompt_ids[lo:lo + per_call] for _ in range(G)]
        extra = {} if images is None else {"images": [im for im in images[lo:lo + per_call] for _ in range(G)]}
        completions_out += engine.generate(rows, sampling, seed=seed_for(lo), logprobs=engine_logprobs, **extra)
    gen_seconds = time.perf_counter() - t0
    logprobs = [list(c.logprobs or []) for c in completions_out] if engine_logprobs else None
    routes = [c.routes for c in completions_out]
    groups = score_groups(records, prompt_ids, completions_out, rewards, sampling, decode=decode,
                          prompt_field=prompt_field, group_size=G, gen_seconds=gen_seconds, logprobs=logprobs)
    groups.routes = routes if routes and all(r is not None for r in routes) else None
    groups.images = None if images is None else list(images)
    return groups


def score_groups(records: Sequence[dict[str, Any]], prompt_ids: Sequence[list[int]], completions_out: Sequence[Completion],
                 rewards: Sequence[WeightedReward], sampling: SamplingSettings, *, decode: Callable[[list[int]], str],
                 prompt_field: str, group_size: int, gen_seconds: float,
                 logprobs: list[list[float]] | None) -> SampledGroups:
    """Finished completions (``group_size`` adjacent rows per record) decoded and scored by ``rewards``."""
    G = group_size
    completion_ids = [c.token_ids for c in completions_out]
    truncated = [c.truncated(sampling) for c in completions_out]
    completions = [decode(c) for c in completion_ids]
    prompts = [rec[prompt_field] for rec in records for _ in range(G)]
    fields = {k: [rec.get(k) for rec in records for _ in range(G)] for k in records[0] if k != prompt_field}
    fields["completion_length"] = [len(c) for c in completion_ids]
    scores = score_completions(rewards, prompts, completions, fields)
    return SampledGroups(G, list(records), [list(p) for p in prompt_ids], completion_ids, prompts, completions,
                         truncated, scores.total, scores.per_function, gen_seconds, logprobs, metrics=scores.metrics)


def build_rollout(
    policy: nn.Module, groups: SampledGroups, s: RolloutSettings, *, pad_id: int, reference: nn.Module | None,
    autocast: Any, rollout_autocast: Any = None, gen_seconds: float = 0.0, started: float | None = None,
    extra_metrics: dict[str, float] | None = None, reduce: ReduceGroup = EVERY_RANK,
) -> Rollout:
    """Lay out sampled groups for the loss: advantages, microbatches, pi_old / reference / rollout log-probs;
    batch statistics are taken over the ranks of ``reduce`` (the run's ``world.dist.reduce``)."""
    G = s.num_generations
    t0 = time.perf_counter() if started is None else started
    rows = [p for p in groups.prompt_ids for _ in range(G)]
    device = next(policy.parameters()).device
    reward_t = torch.tensor(groups.total, dtype=torch.float32, device=device)
    advantages, zero_std = group_advantages(reward_t, G, s.advantage_scale, s.advantage_std, reduce)
    batches = []
    for start in range(0, len(rows), s.micro_batch_size):
        end = start + s.micro_batch_size
        keep = [not (s.mask_truncated and t) for t in groups.truncated[start:end]]
        masks = None if groups.completion_masks is None else groups.completion_masks[start:end]
        mb = policy_rows(rows[start:end], groups.completion_ids[start:end], keep, pad_id, advantages[start:end], device, masks)
        if groups.images is not None:  # before any forward over the batch: they all see the prompts' pixels
            attach_images(mb, [groups.images[r // G] for r in range(start, min(end, len(rows)))])
        if groups.routes is not None:  # before any forward over the batch: they all replay the engine's experts
            mb.routes = dense_routes(groups.routes[start:end], mb.input_ids.shape, device)
        if s.need_old_logprobs:
            with autocast:
                mb.old_logprobs = token_logprobs(policy, mb, s.temperature, s.chunk_tokens)
        if groups.logprobs is not None:
            mb.rollout_logprobs = dense_logprobs(rows[start:end], groups.logprobs[start:end], mb.targets.shape, device)
        elif s.need_rollout_logprobs:
            with rollout_autocast if rollout_autocast is not None else autocast:
                mb.rollout_logprobs = token_logprobs(policy, mb, s.temperature, s.chunk_tokens)
        if reference is not None:
            with autocast:
                mb.ref_logprobs = token_logprobs(reference, mb, s.temperature, s.chunk_tokens)
        batches.append(mb)

    lengths = [len(c) for c in groups.completion_ids]
    metrics = rollout_metrics(groups.total, groups.per_function, lengths, groups.truncated, int(zero_std),
                              len(groups), gen_seconds, time.perf_counter() - t0, device, reduce)
    if groups.metrics:  # every rank holds as many episodes: the mean of the ranks' means
        keys = sorted(groups.metrics)
        sums = reduce.sum(torch.tensor([groups.metrics[k] for k in keys], dtype=torch.float64, device=device)).tolist()
        metrics |= {k: v / reduce.size for k, v in zip(keys, sums)}
    return Rollout(batches, groups.prompts, groups.completions, groups.total, groups.per_function,
                   metrics | (extra_metrics or {}), tokens=sum(b.input_ids.numel() for b in batches),
                   sequence_lengths=[len(p) + len(c) - 1 for p, c in zip(rows, groups.completion_ids)])


def collect_rollout(
    policy: nn.Module, records: Sequence[dict[str, Any]], prompt_ids: Sequence[list[int]],
    rewards: Sequence[WeightedReward], s: RolloutSettings, *, stop_ids: Sequence[int], pad_id: int,
    decode: Callable[[list[int]], str], seed: int, reference: nn.Module | None,
    autocast: Any, prompt_field: str = "prompt",
) -> Rollout:
    """Sample, score and lay out one rollout batch for ``records`` on one process with lmforge's engine,
    every generate call seeded with ``seed``.

    A completion ends at the first of ``stop_ids`` (all the tokens that end a reply, see
    :func:`lmforge.data.chat.stop_token_ids`); one that ends at none of them is truncated.
    """
    t0 = time.perf_counter()
    engine = LmforgeEngine(pad_id=pad_id, autocast=autocast)
    engine.load_weights(policy, 0)
    groups = sample_groups(engine, records, prompt_ids, rewards, s, stop_ids=stop_ids, decode=decode,
                           seed_for=lambda _: seed, prompt_field=prompt_field)
    return build_rollout(policy, groups, s, pad_id=pad_id, reference=reference, autocast=autocast,
                         gen_seconds=groups.gen_seconds, started=t0)


class AllTruncatedWarning:
    """The one warning line of a run whose rollout ended no completion with a stop token.

    Every completion then counts as truncated: with ``mask_truncated`` the loss is zero and nothing
    learns, without it the rewards score cut-off text. Usually the policy never learned the stop
    token, or ``max_new_tokens`` is too small. Said once per run, not every step.
    """

    def __init__(self, stop_names: Sequence[str], max_new_tokens: int, mask_truncated: bool) -> None:
        self.stop_names, self.max_new_tokens, self.mask_truncated = list(stop_names), max_new_tokens, mask_truncated
        self.said = False

    def check(self, metrics: dict[str, float]) -> str | None:
        """The warning, the first time a rollout's completions (all ranks) were all truncated; else None."""
        if self.said or metrics.get("completion/truncated", 0.0) < 1.0:
            return None
        self.said = True
        effect = ("grpo.mask_truncated drops them all, so the loss is zero" if self.mask_truncated
                  else "their rewards score cut-off text")
        return (f"warning: every completion of this rollout was truncated: no stop token "
                f"({', '.join(self.stop_names)}) within grpo.max_new_tokens={self.max_new_tokens}; {effect}")


def dense_logprobs(prompts: list[list[int]], logprobs: list[list[float]], shape: torch.Size,
                   device: torch.device) -> Tensor:
    """Per-completion log-prob lists placed at their target positions of a :func:`layout` batch (0 elsewhere)."""
    out = torch.zeros(shape)
    for i, (p, lp) in enumerate(zip(prompts, logprobs)):
        out[i, len(p) - 1: len(p) - 1 + len(lp)] = torch.tensor(lp, dtype=torch.float32)
    return out.to(device)


def dense_routes(routes: list[Tensor], shape: torch.Size, device: torch.device) -> Tensor:
    """Per-row recorded experts ``[L, n_i, k]`` as one ``[L, B, T, k]`` tensor for a batch of input ``shape``
    ``[B, T]``; a row's padding positions (after its tokens: nothing real attends to them) take experts
    ``0..k-1``."""
    L, _, k = routes[0].shape
    out = torch.arange(k, dtype=routes[0].dtype).expand(L, shape[0], shape[1], k).clone()
    for i, r in enumerate(routes):
        if r.shape[0] != L or r.shape[1] > shape[1]:
            raise ValueError(f"recorded routes of shape {tuple(r.shape)} for a row of {shape[1]} tokens and {L} MoE layers")
        out[:, i, : r.shape[1]] = r
    return out.to(device)


def rollout_metrics(total: list[float], per_fn: dict[str, list[float]], lengths: list[int], truncated: list[bool],
                    zero_std_groups: int, groups: int, gen_seconds: float, seconds: float,
                    device: torch.device | str = "cpu", reduce: ReduceGroup = EVERY_RANK) -> dict[str, float]:
    """Reward and completion statistics of one rollout, combined over the ranks of ``reduce``."""
    names = sorted(per_fn)
    fn_sums = [sum(v for v in per_fn[n] if not math.isnan(v)) for n in names]
    fn_counts = [sum(1 for v in per_fn[n] if not math.isnan(v)) for n in names]
    local = [len(total), sum(total), sum(x * x for x in total), zero_std_groups, groups, sum(lengths),
             sum(truncated), *fn_sums, *fn_counts]
    g = reduce.sum(torch.tensor(local, dtype=torch.float64, device=device)).tolist()
    n, rsum, rsq, zero, ngroups, nlen, ntrunc = g[:7]
    k = len(names)
    mean = rsum / n
    out = {
        "reward/mean": mean,
        "reward/std": math.sqrt(max(rsq / n - mean * mean, 0.0)),
        **{f"reward/{name}": (g[7 + i] / g[7 + k + i] if g[7 + k + i] else math.nan) for i, name in enumerate(names)},
        "grpo/zero_std_groups": zero / ngroups,
        "completion/mean_length": nlen / n,
        "completion/min_length": -dist_utils.all_reduce_max(-float(min(lengths))),
        "completion/max_length": dist_utils.all_reduce_max(float(max(lengths))),
        "completion/truncated": ntrunc / n,
        # generated tokens per second of sampling on this rank (prefill included in the time)
        "rollout/tokens_per_sec": sum(lengths) / gen_seconds if gen_seconds > 0 else 0.0,
        "rollout/seconds": seconds,
    }
    return out
