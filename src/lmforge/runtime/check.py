"""Phase 1 of a run: check everything the config alone can settle. Pure: nothing is written, no
process group exists yet; a mistake is one line here instead of a failure after the model is loaded."""

from __future__ import annotations

import os

from lmforge.checkpoint import RunDir
from lmforge.config import Config
from lmforge.models.qlora import check_qlora
from lmforge.optim.optimizers import check_optimizer
from lmforge.parallel.dims import ParallelDims
from lmforge.runtime.startup_checks import check_fresh_start


def check_run(cfg: Config) -> ParallelDims:
    """The run's parallel layout over the launched processes, once every start-up rule holds.

    The world size is read from torchrun's environment (``WORLD_SIZE``), so the layout is checked
    before any process group exists.
    """
    layout = ParallelDims.from_config(cfg.parallel, int(os.environ.get("WORLD_SIZE", "1")))
    check_optimizer(cfg, sharded=bool(layout.shards))
    check_qlora(cfg.lora, sharded=bool(layout.shards))
    check_fresh_start(cfg, RunDir(cfg.run.dir))
    return layout
