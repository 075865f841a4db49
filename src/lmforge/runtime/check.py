"""Phase 1 of a run: check everything the config alone can settle. Pure: nothing is written, no
process group exists yet; a mistake is one line here instead of a failure after the model is loaded."""

from __future__ import annotations

import os
from dataclasses import dataclass

from lmforge.checkpoint import RunDir
from lmforge.config import Config
from lmforge.models.load import ModelSource
from lmforge.models.qlora import check_qlora
from lmforge.optim.optimizers import check_optimizer
from lmforge.parallel.dims import ParallelDims
from lmforge.runtime.startup_checks import check_fresh_start


@dataclass(frozen=True)
class RunPlan:
    """What the config settles before anything runs."""

    layout: ParallelDims
    """How the launched processes divide the work."""
    source: ModelSource
    """Where the starting weights come from."""
    run: RunDir
    """The run directory (``run.dir``), checked for a fresh start; claimed by the world."""


def check_run(cfg: Config) -> RunPlan:
    """The run's plan: its layout over the launched processes, its model's source and its run directory,
    once every start-up rule that needs no process group and no model holds (a fresh start in a
    directory of checkpoints, the LoRA and optimizer rules that depend on the layout).

    The world size is read from torchrun's environment (``WORLD_SIZE``), so the layout is checked
    before any process group exists; the later phases take the plan instead of working it out again.
    """
    run = RunDir(cfg.run.dir)
    check_fresh_start(cfg, run)
    layout = ParallelDims.from_config(cfg.parallel, int(os.environ.get("WORLD_SIZE", "1")))
    source = ModelSource.from_section(cfg.model, cfg.training.seed)
    check_qlora(cfg.lora, sharded=bool(layout.shards))
    check_optimizer(cfg, sharded=bool(layout.shards))
    return RunPlan(layout, source, run)

