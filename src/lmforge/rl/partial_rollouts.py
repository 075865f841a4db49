"""Partial rollouts (``grpo.partial_rollouts``): completions that continue across weight updates.

Without them, a weight update in asynchronous GRPO (``grpo.async_steps = k``) waits until every round in
flight has finished, and a round is sampled whole by one version of the weights. With them, every round
is decoded in ``k`` *segments* of ``ceil(max_new_tokens / k)`` new tokens, and between two weight updates
the engine runs one segment of each of the ``k`` rounds in flight (oldest first). At an update the
rounds in flight therefore stop after their current segment, the engine loads the new weights, and they
continue under them: a round taken for training at update ``u`` had its first segment sampled at update
``u - k``, its last at ``u - 1``. The update waits for one segment of each round (one round's worth of
tokens), never for whole rounds.

Continuing re-prefills prompt + tokens so far under the new weights (the KV cache of the old ones is
recomputed, not kept: keys and values computed by older weights would make the next tokens depend on
two policies at once). Every token keeps the version of the weights that sampled it and its log-prob
under them (the behaviour policy, per token), which ``grpo.tis_cap`` weighs it by.

The schedule is counted in segments, never in seconds, and each segment's random stream is seeded by
its round's prompt positions and its index: the same run draws the same tokens, and a checkpoint saves
the rounds in flight part-way (after the current segments), so a resumed run continues them exactly.

``grpo.max_staleness = s`` (:func:`mask_stale_tokens`): a completion token sampled by weights more than
``s`` optimizer steps older than the policy the rollout is laid out for is masked out of the loss (the
rollout is not regenerated); ``rollout/stale_tokens_masked`` counts them.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from lmforge import distributed as dist_utils
from lmforge.rl.engines.base import Completion, RolloutEngine, SamplingSettings
from lmforge.rl.rewards import WeightedReward
from lmforge.rl.rollout import SampledGroups, score_groups


@dataclass
class PartialRound:
    """One sampling round part-way through: ``group_size`` rows per prompt, their tokens so far."""

    positions: list[int]
    """The prompts' positions in the prompt order (they seed each segment's random stream)."""
    records: list[dict[str, Any]]
    prompt_ids: list[list[int]]
    """One per group."""
    group_size: int
    completion_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    """Per row: each token's log-prob under the weights that sampled it."""
    token_versions: list[list[int]] = field(default_factory=list)
    """Per row: each token's weight version (optimizer steps those weights had taken)."""
    done: list[bool] = field(default_factory=list)
    """Per row: ended by a stop token or at ``max_new_tokens``."""
    segments: int = 0
    gen_seconds: float = 0.0
    result: SampledGroups | None = None
    """The scored groups, once every segment has run."""

    def __post_init__(self) -> None:
        rows = len(self.prompt_ids) * self.group_size
        if not self.completion_ids:
            self.completion_ids = [[] for _ in range(rows)]
            self.logprobs = [[] for _ in range(rows)]
            self.token_versions = [[] for _ in range(rows)]
            self.done = [False] * rows

    def state(self) -> dict[str, Any]:
        """Checkpoint form: plain lists and dicts."""
        return dataclasses.asdict(self)

    @staticmethod
    def from_state(state: dict[str, Any]) -> "PartialRound":
        s = dict(state)
        result = s.pop("result", None)
        return PartialRound(**s, result=None if result is None else SampledGroups(**result))


def segment_tokens(max_new_tokens: int, segments: int) -> int:
    """New tokens per segment: a round's ``segments`` segments together reach ``max_new_tokens``."""
    return -(-max_new_tokens // segments)


def advance_round(engine: RolloutEngine, rnd: PartialRound, sampling: SamplingSettings, segments: int,
                  rows_per_call: int, seed_for: Callable[[int, int], int]) -> None:
    """Run the next segment of ``rnd`` with the engine's current weights: every unfinished row gets up to
    one segment of new tokens (prompt + its tokens so far re-prefilled; for vLLM one completion request of
    token ids with ``max_tokens`` = the segment), with their log-probs and the engine's version. ``seed_for(position, segment)`` seeds each generate call from the position of its
    first row's prompt."""
    t0 = time.perf_counter()
    G, N = rnd.group_size, sampling.max_new_tokens
    active = [i for i, d in enumerate(rnd.done) if not d]
    if active:
        n = min(segment_tokens(N, segments), N - len(rnd.completion_ids[active[0]]))
        step = SamplingSettings(n, sampling.temperature, sampling.top_p, sampling.stop_ids)
        stops = set(sampling.stop_ids)
        for lo in range(0, len(active), rows_per_call):
            rows = active[lo:lo + rows_per_call]
            prompts = [rnd.prompt_ids[i // G] + rnd.completion_ids[i] for i in rows]
            out = engine.generate(prompts, step, seed=seed_for(rnd.positions[rows[0] // G], rnd.segments),
                                  logprobs=True)
            for i, c in zip(rows, out):
                rnd.completion_ids[i] += c.token_ids
                rnd.logprobs[i] += list(c.logprobs or [])
                rnd.token_versions[i] += [engine.version] * len(c.token_ids)
                # a row is not continued once it ended: a stop token, max_new_tokens, or fewer tokens than asked
                # (an engine that cut it short, e.g. vLLM at its max_model_len, would cut it again)
                rnd.done[i] = (len(rnd.completion_ids[i]) >= N or len(c.token_ids) < n
                               or bool(c.token_ids and c.token_ids[-1] in stops))
    rnd.segments += 1
    rnd.gen_seconds += time.perf_counter() - t0


def finish_round(rnd: PartialRound, rewards: Sequence[WeightedReward], sampling: SamplingSettings, *,
                 decode: Callable[[list[int]], str], prompt_field: str) -> SampledGroups:
    """A round whose segments have all run, scored; its ``version`` is its oldest token's."""
    groups = score_groups(rnd.records, rnd.prompt_ids, [Completion(list(c)) for c in rnd.completion_ids], rewards,
                          sampling, decode=decode, prompt_field=prompt_field, group_size=rnd.group_size,
                          gen_seconds=rnd.gen_seconds, logprobs=[list(x) for x in rnd.logprobs])
    groups.token_versions = [list(v) for v in rnd.token_versions]
    groups.version = min((v for vs in rnd.token_versions for v in vs), default=0)
    return groups


class PartialRolloutQueue:
    """The rounds in flight, advanced one segment each per weight update by one background thread.

    ``advance(round)`` runs a round's next segment; ``finish(round)`` scores a round whose ``depth``
    segments have all run. The main thread touches the rounds only while no job runs (``wait_idle``)."""

    def __init__(self, depth: int, advance: Callable[[PartialRound], None],
                 finish: Callable[[PartialRound], SampledGroups]) -> None:
        self.depth, self.advance, self.finish = depth, advance, finish
        self.rounds: list[PartialRound] = []
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmforge-rollout")
        self.job: Future[None] | None = None

    def __len__(self) -> int:
        return len(self.rounds)

    def add(self, rnd: PartialRound) -> None:
        self.wait_idle()
        self.rounds.append(rnd)

    def run(self) -> None:
        """Queue one segment of every round in flight (with the weights the engine holds now)."""
        self.wait_idle()
        self.job = self.pool.submit(self._segment, list(self.rounds))

    def _segment(self, rounds: Sequence[PartialRound]) -> None:
        for rnd in rounds:
            if rnd.segments < self.depth:
                self.advance(rnd)
            if rnd.segments >= self.depth and rnd.result is None:
                rnd.result = self.finish(rnd)

    def wait_idle(self) -> None:
        """The queued segments have run (a failure in the thread is raised here): the engine is free."""
        if self.job is not None:
            job, self.job = self.job, None
            job.result()

    def take(self) -> SampledGroups:
        """The oldest round, every segment run and scored."""
        self.wait_idle()
        rnd = self.rounds.pop(0)
        if rnd.result is None:
            raise RuntimeError(f"partial rollout taken after {rnd.segments} of {self.depth} segments")
        return rnd.result

    def drain(self) -> list[dict[str, Any]]:
        """The rounds in flight after the queued segments, as checkpoint state (they stay queued)."""
        self.wait_idle()
        return [r.state() for r in self.rounds]

    def restore(self, states: list[dict[str, Any]]) -> None:
        self.wait_idle()
        self.rounds = [PartialRound.from_state(s) for s in states]

    def close(self) -> None:
        if self.job is not None:
            self.job.cancel()
            self.job = None
        self.rounds.clear()
        self.pool.shutdown(wait=True)


def mask_stale_tokens(groups: SampledGroups, version: int, max_staleness: int, device: torch.device,
                      reduce: dist_utils.ReduceGroup) -> tuple[SampledGroups, dict[str, float]]:
    """Per-token staleness of the groups laid out for the update after ``version`` optimizer steps (the
    policy-version lag of each policy-written completion token, over all ranks of ``reduce``), and with
    ``max_staleness > 0`` the groups with tokens older than that masked out of the loss."""
    versions = groups.token_versions or [[groups.version] * len(c) for c in groups.completion_ids]
    masks = groups.completion_masks or [[1] * len(c) for c in groups.completion_ids]
    lag_sum = count = masked = 0.0
    lag_max = 0.0
    new_masks: list[list[int]] = []
    for vs, ms in zip(versions, masks):
        row = []
        for v, m in zip(vs, ms):
            lag = version - v
            if m:
                lag_sum, count, lag_max = lag_sum + lag, count + 1, max(lag_max, float(lag))
            stale = bool(m) and max_staleness > 0 and lag > max_staleness
            masked += stale
            row.append(0 if stale else int(m))
        new_masks.append(row)
    sums = reduce.sum(torch.tensor([lag_sum, count, masked], dtype=torch.float64, device=device)).tolist()
    metrics = {"rollout/token_staleness_mean": sums[0] / sums[1] if sums[1] else 0.0,
               "rollout/token_staleness_max": dist_utils.all_reduce_max(lag_max),
               "rollout/stale_tokens_masked": sums[2]}
    if masked:  # this rank's rows lose some tokens
        groups = dataclasses.replace(groups, completion_masks=new_masks)
    return groups, metrics
