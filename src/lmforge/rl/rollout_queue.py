"""Rollouts sampled ahead of training (``grpo.async_steps``): one background thread runs the engine.

With ``async_steps = k`` the source keeps k sampling rounds in flight: when a step needs a rollout it
takes the oldest round, loads the current weights into the engine and queues the next round, which then
samples while the step trains. The engine is idle whenever weights are loaded (a round never mixes two
versions of the weights), so a round taken at optimizer step v was sampled by weights of step
v - k x ``num_iterations`` or later: its *staleness* (``rollout/staleness``, in optimizer steps) is at most that.
With ``grpo.partial_rollouts`` the rounds advance in segments across weight updates instead
(:mod:`lmforge.rl.partial_rollouts`), and a round's tokens carry several versions.

The thread only samples and scores (no collectives: ranks never wait for each other from it); everything
that needs all ranks (advantages with batch scaling, log-probs, metrics) happens on the main thread when
the round is taken. A checkpoint waits for the rounds in flight and saves them, so a resumed run trains on
exactly the completions the uninterrupted one would have (:meth:`RolloutQueue.drain`).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from lmforge.rl.rollout import SampledGroups


class RolloutQueue:
    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmforge-rollout")
        self.pending: deque[Future[SampledGroups]] = deque()

    def __len__(self) -> int:
        return len(self.pending)

    def submit(self, sample: Callable[[], SampledGroups]) -> None:
        self.pending.append(self.pool.submit(sample))

    def take(self) -> SampledGroups:
        """The oldest round (waits for it; a failure in the thread is raised here)."""
        return self.pending.popleft().result()

    def wait_idle(self) -> None:
        """Every queued round finished: the engine is free for a weight load."""
        for f in self.pending:
            f.exception()

    def drain(self) -> list[SampledGroups]:
        """The rounds in flight, finished, in order (they stay queued)."""
        return [f.result() for f in self.pending]

    def restore(self, rounds: list[SampledGroups]) -> None:
        self.pending.clear()
        for r in rounds:
            done: Future[SampledGroups] = Future()
            done.set_result(r)
            self.pending.append(done)

    def close(self) -> None:
        for f in self.pending:
            f.cancel()
        self.pending.clear()
        self.pool.shutdown(wait=True)
