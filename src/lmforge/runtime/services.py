"""Phase 4 of a run: the services around the model. The optimizer, the MetricLogger (and its setup
line, from the model bundle's notes and the plan's config text), the step guard and the checkpoint
tiers, plus what a recipe adds (:class:`RecipeServices`).
Each is built from its own section: the MetricLogger from ``[metrics]``
(:meth:`~lmforge.metrics.MetricLogger.from_section`), the guard from ``[training]``
(:meth:`~lmforge.runtime.guard.Guard.from_section`), the optimizer from ``[optimizer]``, the tiers here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from lmforge import distributed as dist_utils
from lmforge.checkpoint import Checkpointer, RunDir
from lmforge.checkpoint.tiers import CheckpointTiers
from lmforge.config import Config
from lmforge.metrics import MetricLogger
from lmforge.runtime.model_bundle import ModelBundle
from lmforge.runtime.world import World

StepHook = Callable[[Any, Any, Any], None]
"""``hook(rt, state, source)`` (the :class:`~lmforge.runtime.build.Runtime`, the loop's state and step
source), called at the very end of every step of the loop."""
SnapshotRoot = Callable[[Config, RunDir, dist_utils.DistInfo], "tuple[Path | None, str]"]
"""Where a fast checkpoint tier lives for this run, or (None, why not)."""


@dataclass(frozen=True)
class RecipeServices:
    """What a recipe adds to the shared runtime (the elastic mode adds the first four to any recipe's)."""

    step_hooks: tuple[StepHook, ...] = ()
    snapshot_root: SnapshotRoot | None = None
    """Adds a fast checkpoint tier (snapshots) where it returns a directory."""
    snapshot_keep: int = 1
    process_start: float | None = None
    """Moves the start of goodput accounting earlier (a restarted attempt counts from the failure)."""
    head: str | None = None
    """An output head the recipe's objective reads (``"score"``: a reward model's scalar score; see
    :mod:`lmforge.models.heads`), added to the model before it is wrapped, and named in checkpoints."""
    setup_notes: Callable[[Any], dict[str, str]] | None = None
    """More entries for the setup line, given the model's args (e.g. which router losses an MoE model
    trains with)."""

    def notes_for(self, args: Any) -> dict[str, str]:
        return self.setup_notes(args) if self.setup_notes else {}


def build_checkpoints(cfg: Config, info: dist_utils.DistInfo, run: RunDir, metrics: MetricLogger,
                      trainer: str, services: RecipeServices) -> CheckpointTiers:
    """The durable tier in the run directory as ``[checkpoint]`` asks, plus a fast tier where the recipe
    asks for one (its ``snapshot_root`` reads the whole config: the elastic mode's section)."""
    report = lambda line: metrics.record_event("checkpoint_damaged", 0, line)  # noqa: E731
    durable = Checkpointer(run.root, cfg.checkpoint.keep, on_damaged=cfg.checkpoint.on_damaged, report=report)
    fast = None
    if services.snapshot_root is not None:
        root, why_not = services.snapshot_root(cfg, run, info)
        if root is None:
            metrics.console(f"{trainer}: fast snapshots off ({why_not})")
        else:
            fast = Checkpointer(run.root, services.snapshot_keep, on_damaged=cfg.checkpoint.on_damaged,
                                report=report, root=root)
    return CheckpointTiers(durable, fast)


def log_setup(cfg: Config, config_toml: str, world: World, model: ModelBundle, metrics: MetricLogger,
              trainer: str, notes: dict[str, str]) -> None:
    """The run's setup line: what was built, and why each choice was made (``config_toml``: the plan's
    text of the config, recorded beside it)."""
    raw, info = model.raw, world.dist
    trainable, total = model.trainable
    n = model.notes
    metrics.log_setup({
        "trainer": trainer, "parameters": raw.num_params(), "non_embedding_parameters":
        raw.num_params(exclude_embeddings=True), "trainable_parameters": trainable,
        "trainable_share": round(trainable / total, 6), "flops_per_token": model.flops_per_token,
        "peak_tflops_per_device": model.peak_flops / 1e12, "peak_source": n["peak_source"],
        "world_size": info.world_size, "device": str(info.device), "parallel": world.layout.kind,
        "mesh": world.layout.describe_mesh(), "dtype": n["dtype"], "dtype_reason": n["dtype_reason"],
        "compile": n["compile"], "compile_reason": n["compile_reason"], "optimizer": cfg.optimizer.name,
        "activation_offload": n["activation_offload"], "host_memory": n["host_memory"],
        "threads": torch.get_num_threads(), "run_dir": str(world.run_dir), **notes,
    }, config_toml)

