"""Phase 1 of a run: check everything the config alone can settle. Pure: nothing is written, no
process group exists yet; a mistake is one line here instead of a failure after the model is loaded."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from lmforge.checkpoint import STATE_FILE, RunDir, list_checkpoints, resolve_checkpoint
from lmforge.config import Config, ModelSection
from lmforge.errors import UserError
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


def check_run(cfg: Config) -> RunPlan:
    """The run's layout over the launched processes and its model's source, once every start-up rule
    that needs neither holds.

    The world size is read from torchrun's environment (``WORLD_SIZE``), so the layout is checked
    before any process group exists.
    """
    check_fresh_start(cfg, RunDir(cfg.run.dir))
    layout = ParallelDims.from_config(cfg.parallel, int(os.environ.get("WORLD_SIZE", "1")))
    source = model_source(cfg.model, cfg.training.seed)
    check_qlora(cfg.lora, sharded=bool(layout.shards))
    check_optimizer(cfg, sharded=bool(layout.shards))
    return RunPlan(layout, source)


def model_source(m: ModelSection, seed: int) -> ModelSource:
    """Where a run's starting weights come from: a Hugging Face directory or Hub model (pinned to its
    commit), an lmforge checkpoint, or a fresh initialization with the run's seed."""
    if m.from_hf:  # a Hugging Face directory, a llama.cpp .gguf file (lmforge.models.gguf) or a Hub name
        return ModelSource.from_hf(m.from_hf)
    if m.from_checkpoint:
        p = Path(m.from_checkpoint)
        if not (p / STATE_FILE).is_file() and not list_checkpoints(RunDir(p).checkpoints):
            raise UserError(f"model.from_checkpoint={p}: no checkpoint there; train the starting model first "
                            f"(e.g. lmforge pretrain --config configs/debug.toml --run.dir={p})")
        return ModelSource("checkpoint", str(resolve_checkpoint(p).resolve()))
    return ModelSource("init", str(seed))
