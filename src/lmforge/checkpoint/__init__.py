"""Checkpoints and the run directory: atomic DCP saves, integrity manifests, code-free loading,
the two-tier (durable + fast snapshot) composition, and the run-directory layout and lock."""

from lmforge.checkpoint.checkpointer import (
    Checkpointer, load_model_weights, read_trainer_state, resolve_checkpoint,
)
from lmforge.checkpoint.layout import MANIFEST_FILE, STATE_FILE, RunDir, list_checkpoints
from lmforge.checkpoint.verify import checkpoint_problem

__all__ = ["Checkpointer", "MANIFEST_FILE", "RunDir", "STATE_FILE", "checkpoint_problem", "list_checkpoints",
           "load_model_weights", "read_trainer_state", "resolve_checkpoint"]
