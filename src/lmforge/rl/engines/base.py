"""The rollout-engine interface (see :mod:`lmforge.rl.engines`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence

if TYPE_CHECKING:  # the package is imported by the GRPO config (engine keys), which loads without torch
    from torch import nn


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int
    temperature: float
    top_p: float = 1.0
    stop_ids: Sequence[int] = field(default_factory=tuple)
    """A completion ends after the first of these (kept in its tokens)."""


@dataclass
class Completion:
    token_ids: list[int]
    """The new tokens, the stop token included when one ended the completion."""
    logprobs: list[float] | None = None
    """log p of each sampled token under the distribution the engine sampled from (softmax of the
    logits at the sampling temperature), as the engine computed it; None when the engine does not
    report them (the trainer then computes them itself where it needs them)."""
    routes: Any = None
    """[n_moe_layers, len(prompt) + len(token_ids) - 1, k] int16 tensor: the experts each MoE layer sent each
    input token of prompt + completion to, in the pass that gave ``logprobs`` (``grpo.router_replay``);
    None when not asked for or not known."""

    def truncated(self, s: SamplingSettings) -> bool:
        """Cut off at ``max_new_tokens`` without a stop token."""
        return len(self.token_ids) >= s.max_new_tokens and (not self.token_ids or self.token_ids[-1] not in s.stop_ids)


class RolloutEngine(Protocol):
    name: str

    version: int
    """The ``version`` of the weights last loaded (-1: none yet)."""
    sync_seconds: float
    """Seconds the last ``load_weights`` took."""

    def generate(self, prompts: Sequence[list[int]], sampling: SamplingSettings, *, seed: int,
                 logprobs: bool = False) -> list[Completion]:
        """One completion per prompt row (repeat a prompt for several samples). ``seed`` fixes the
        random stream of this call where the engine can (the same call with the same seed and weights
        draws the same tokens); ``logprobs`` asks for the sampled tokens' log-probs."""
        ...

    def load_weights(self, model: nn.Module, version: int) -> None:
        """Take the policy's current weights (``version``: the optimizer steps taken so far). Every
        completion generated afterwards samples from them."""
        ...

    def close(self) -> None:
        ...
