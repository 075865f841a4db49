"""Checkpoints from the loop's side: what a checkpoint holds besides tensors, saving the current step,
and resuming from the newest complete checkpoint of either tier (the checkpointer itself, atomic DCP
saves and code-free loading, is :mod:`lmforge.checkpoint`)."""

from __future__ import annotations

from typing import Any

from lmforge.errors import UserError
from lmforge.metrics.records import last_logged_step
from lmforge.runtime import Runtime
from lmforge.training.state import TrainState


def checkpoint_state(rt: Runtime, state: TrainState, source: Any) -> dict[str, Any]:
    """Everything a checkpoint holds besides tensors and RNG (see lmforge.training.state)."""
    return {**state.state_dict(), "data": source.state_dict(), "world_size": rt.world.dist.world_size,
            "model": rt.model.description}


def save(rt: Runtime, state: TrainState, source: Any, tier: str = "durable") -> Any:
    """Checkpoint the current step (every rank); the guard first refuses a non-finite step."""
    rt.guard.before_save()
    with rt.metrics.timed("checkpoint_save"):
        return rt.checkpoints.save(state.step, rt.model.module, rt.optimizer, checkpoint_state(rt, state, source),
                                   rank_state=source.rank_state(), tier=tier)  # type: ignore[arg-type]


def resume(rt: Runtime, source: Any) -> TrainState:
    """Continue from the newest complete checkpoint (of either tier) of the run directory, if any."""
    state = TrainState()
    if rt.cfg.checkpoint.resume == "never":
        return state
    path = rt.checkpoints.latest()
    if path is None:
        return state
    with rt.metrics.timed("checkpoint_restore"):
        saved = rt.checkpoints.load(path, rt.model.module, rt.optimizer)
        try:
            source.load_state_dict(saved.get("data", {}))
            source.load_rank_state(saved.get("rank_state", {}))
        except UserError as e:
            raise UserError(f"resuming from {path}: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"resuming from {path}: its data position is unreadable ({e!r})") from None
    state.load_state_dict(saved)
    state.resumed_from = path
    state.redo_until = last_logged_step(rt.world.run_dir)
    rt.metrics.record_event("resume", state.step, f"resumed from {path} at step {state.step}",
                            path=str(path), saved_world_size=saved.get("world_size", 0))
    return state
