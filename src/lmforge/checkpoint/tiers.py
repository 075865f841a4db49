"""Checkpoint tiers: durable checkpoints, plus an optional fast tier of snapshots, as one service.

Every trainer saves and resumes through a :class:`CheckpointTiers`. Without a fast tier it is
simply the durable :class:`Checkpointer` of the run directory. The elastic mode adds a fast tier
(snapshots in memory-backed storage every few steps) so that a restart loses few steps; both tiers
use the same atomic DCP format, and a resume takes the newest complete state of either.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from lmforge import distributed as dist_utils
from lmforge.checkpoint.checkpointer import Checkpointer
from lmforge.checkpoint.layout import _step_of

Tier = Literal["durable", "fast"]


class CheckpointTiers:
    """A durable :class:`Checkpointer` and an optional fast one, composed (neither wraps the other).

    A snapshot is only chosen if every rank sees the same newest intact snapshot (node-local storage
    on several machines never qualifies), so all ranks always restore the same step.
    """

    def __init__(self, durable: Checkpointer, fast: Checkpointer | None = None) -> None:
        self.durable = durable
        self.fast = fast

    def latest(self) -> Path | None:
        """The newest complete state over both tiers (collective)."""
        durable = self.durable.latest()
        if self.fast is None:
            return durable
        snap = self.fast.latest()
        snap_step = _step_of(snap) if snap is not None else -1
        newest = dist_utils.all_reduce_max(float(snap_step))
        oldest = -dist_utils.all_reduce_max(float(-snap_step))
        if snap is not None and newest == oldest and (durable is None or snap_step > (_step_of(durable) or 0)):
            return snap
        return durable

    def is_snapshot(self, path: Path | None) -> bool:
        return self.fast is not None and path is not None and Path(path).parent == self.fast.root

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
             trainer_state: dict[str, Any], rank_state: dict[str, Any] | None = None,
             tier: Tier = "durable") -> Path:
        target = self.fast if tier == "fast" else self.durable
        if target is None:
            raise ValueError("no fast checkpoint tier configured")
        return target.save(step, model, optimizer, trainer_state, rank_state)

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        tier = self.fast if self.is_snapshot(path) else self.durable
        return tier.load(path, model, optimizer)  # type: ignore[union-attr]

    def disable_fast(self) -> None:
        """Turn the fast tier off (e.g. a snapshot could not be written); durable saves continue."""
        self.fast = None
