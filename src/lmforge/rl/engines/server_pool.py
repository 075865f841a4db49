"""Several rollout servers behind one backend: prompts spread over them, a failed one dropped.

A rollout batch is split into contiguous, balanced slices (the ``num_generations`` samples of a prompt
stay together, so a server's prefix cache serves them), one per live server, sent at the same time, and
the completions put back in prompt order: the result's order never depends on which server answered
first. A slice starting at prompt ``k`` is sent with seed ``seed + k``, so every prompt row gets the seed
it would get from one server (where the engine honours per-request seeds).

A server that fails (:class:`~.vllm_engine.ServerFailure`: unreachable, cut off, timed out, a 5xx, a
reply that is not the protocol) is dropped with one ``warning:`` line and its slice is sampled by the
others; the run stops with one ``error:`` line only when none is left. A refused request (a 4xx) is not a
server failing: every server would refuse it, so it stops the run at once.

On several trainer ranks every rank samples through its own pool, and rank 0 alone loads the weights;
:meth:`ServerPool.agree` (a collective, around every weight load) keeps only the servers every rank
still has, so no rank samples from a server that missed a load.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Sequence

import torch.distributed as dist

from lmforge.errors import UserError
from lmforge.rl.engines.vllm_engine import ServerBackend, ServerFailure

__all__ = ["ServerPool", "slices"]


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def slices(rows: Sequence[int], parts: int) -> list[list[int]]:
    """``rows`` (sorted prompt indices) cut into ``parts`` runs as equal as can be, in order; each run
    then split where the indices are not consecutive, so every request covers a contiguous range."""
    size, extra = divmod(len(rows), parts)
    out, start = [], 0
    for p in range(parts):
        run = list(rows[start:start + size + (p < extra)])
        start += len(run)
        while run:
            end = next((i for i in range(1, len(run)) if run[i] != run[i - 1] + 1), len(run))
            out.append(run[:end])
            run = run[end:]
    return out


class ServerPool:
    """Rollout servers as one backend (:class:`~.vllm_engine.VllmEngine`'s ``generate``/``load_weights``)."""

    def __init__(self, servers: Sequence[ServerBackend], warn: Callable[[str], None] = _warn) -> None:
        if not servers:
            raise UserError("grpo.vllm_url: no server named")
        self.servers, self.started = list(servers), list(servers)
        self.warn = warn
        self.last_failure = ""

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def _drop(self, server: ServerBackend, failure: Exception) -> None:
        if server in self.servers:
            self.servers.remove(server)
            self.last_failure = str(failure)
            if self.servers:  # the last one's failure is the run's error line, said once
                self.warn(f"rollout server {server.url} dropped ({failure}); {len(self.servers)} left")

    def require(self) -> None:
        """One line when every server has failed."""
        if not self.servers:
            raise UserError(f"every rollout server failed (grpo.vllm_url); the last: {self.last_failure}")

    def generate(self, prompts: Sequence[list[int]], *, seed: int = 0, **kw: Any) -> list[dict[str, Any]]:
        results: list[dict[str, Any] | None] = [None] * len(prompts)
        pending = list(range(len(prompts)))
        while pending:
            self.require()
            work = list(zip(slices(pending, min(len(self.servers), len(pending))), _cycle(self.servers)))

            def ask(job: tuple[list[int], ServerBackend]) -> list[dict[str, Any]] | ServerFailure:
                rows, server = job
                try:
                    return server.generate([prompts[i] for i in rows], seed=seed + rows[0], **kw)
                except ServerFailure as e:
                    return e

            with ThreadPoolExecutor(len(work)) as ex:
                answers = list(ex.map(ask, work))
            for (rows, server), answer in zip(work, answers):
                if isinstance(answer, ServerFailure):
                    self._drop(server, answer)
                    continue
                for i, c in zip(rows, answer):
                    results[i] = c
            pending = [i for i, r in enumerate(results) if r is None]
        return results  # type: ignore[return-value]

    def load_weights(self, path: str) -> float:
        """Every live server loads ``path`` (at the same time); the slowest one's seconds. A server that
        fails is dropped; with none left, one line (after :meth:`agree`, so every rank stops)."""
        def load(server: ServerBackend) -> float | ServerFailure:
            try:
                return server.load_weights(path)
            except ServerFailure as e:
                return e

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max(1, len(self.servers))) as ex:
            answers = list(ex.map(load, list(self.servers)))
        for server, answer in zip(list(self.servers), answers):
            if isinstance(answer, ServerFailure):
                self._drop(server, answer)
        done = [a for a in answers if not isinstance(a, ServerFailure)]
        return max(done) if done else time.perf_counter() - t0

    def init_transfer(self, device: Any) -> None:
        """Set up every server's weight-transfer group (in-memory sync); one that fails is dropped."""
        for server in list(self.servers):
            try:
                server.init_transfer(device)
            except ServerFailure as e:
                self._drop(server, e)
        self.require()

    def push_weights(self, buckets: Iterable[list[tuple[str, Any]]]) -> int:
        """One in-memory sync: every live server receives each bucket as it is made (:mod:`.weight_transfer`);
        the bytes sent to each. A server whose transfer fails is dropped."""
        members, live = list(self.servers), list(self.servers)
        replies: dict[str, Any] = {}

        def receive(server: Any) -> None:
            try:
                replies[server.url] = server.receive_weights()
            except ServerFailure as e:
                replies[server.url] = e

        threads = [threading.Thread(target=receive, args=(s,), daemon=True) for s in members]
        for t in threads:
            t.start()
        sent = 0

        def each(step: Callable[[Any], Any]) -> None:
            """``step`` started on every live server, then waited on (the sends overlap)."""
            from lmforge.rl.engines.weight_transfer import wait

            started = []
            for server in list(live):
                try:
                    started.append((server, step(server)))
                except (RuntimeError, OSError) as e:
                    fail(server, e)
            for server, pending in started:
                try:
                    wait(pending)
                except (RuntimeError, OSError) as e:  # the group broke: the server died or left
                    fail(server, e)

        def fail(server: Any, e: BaseException) -> None:
            if server in live:
                live.remove(server)
            self._drop(server, ServerFailure(f"vLLM server {server.url}: the weight transfer failed ({e})"[:400]))

        for bucket in buckets:
            each(lambda s: s.sender.send(bucket))
            sent += sum(t.numel() * t.element_size() for _, t in bucket)
        each(lambda s: s.sender.end())
        for t, server in zip(threads, members):
            t.join(server.timeout_s)
        for server in list(self.servers):
            reply = replies.get(server.url)
            if not isinstance(reply, dict):
                self._drop(server, reply if isinstance(reply, Exception) else
                           ServerFailure(f"vLLM server {server.url}: no reply to the weight transfer"))
        return sent

    def agree(self) -> None:
        """Keep the servers every rank still has (a collective on several ranks; nothing on one)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, self.urls)
        keep = set.intersection(*(set(u) for u in everyone))
        for server in [s for s in self.servers if s.url not in keep]:
            self._drop(server, ServerFailure("failed on another rank"))

    def close(self) -> None:
        for server in self.started:  # the dropped ones too: a process lmforge started must not outlive the run
            server.close()


def _cycle(items: list[ServerBackend]):  # noqa: ANN202 - a plain generator
    while True:
        yield from items
