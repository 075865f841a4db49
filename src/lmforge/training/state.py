"""Where training stands: the typed state the loop advances and every checkpoint carries.

What a checkpoint holds besides tensors is assembled in one place (:func:`checkpoint_state`):
this state, the step source's position (data samples consumed, or prompts consumed plus rollout RNG
and reference for GRPO), the world size and the model's description. Per-rank torch/numpy/python
RNG states are saved by the checkpointer itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps completed."""
    tokens_seen: int = 0
    """Target tokens (total_weights) trained on so far, over all ranks (see :meth:`count_tokens`)."""
    last_eval_loss: float | None = None
    training_seconds: float = 0.0
    """Seconds on the training clock, agreed across ranks (for the time budget)."""
    stop_requested: str | None = None
    """Why the run stops after this step (a signal name), agreed by every rank; None: it goes on."""
    stop_signal: str | None = None
    """A stop signal this rank received and the ranks have not agreed on yet (loop.end_of_step): acting
    on it alone would leave this rank saving while the others run the next step, each waiting forever
    in a different collective."""
    redo_until: int = 0
    """The newest step an earlier attempt logged: steps up to it are computed again (lost progress)."""
    resumed_from: Path | None = None
    pending_tokens: list[torch.Tensor] = field(default_factory=list)
    """Device counts of target tokens not yet added to ``tokens_seen`` (read only when needed)."""

    def count_tokens(self, total_weights: torch.Tensor, read_now: bool) -> None:
        """Add a step's target tokens; they reach the host only when ``read_now`` (a log step, or a
        token budget that must be checked every step), so other steps never wait for the device."""
        self.pending_tokens.append(total_weights)
        if read_now:
            self.flush_tokens()

    def flush_tokens(self) -> None:
        if self.pending_tokens:
            self.tokens_seen += int(torch.stack(self.pending_tokens).sum().item())
            self.pending_tokens.clear()

    def state_dict(self) -> dict[str, Any]:
        self.flush_tokens()  # a checkpoint between log steps must count every step it contains
        return {"step": self.step, "tokens_seen": self.tokens_seen, "last_eval_loss": self.last_eval_loss}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.tokens_seen = int(state.get("tokens_seen", 0))
        self.last_eval_loss = state.get("last_eval_loss")
        self.pending_tokens.clear()
