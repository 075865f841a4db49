"""The runtime every recipe trains on, built in four phases.

1. **check** (:mod:`.check`): the config alone, pure; nothing is written.
2. **world** (:mod:`.world`): process group, layout, mesh, reduce group, the claimed run directory.
3. **model** (:mod:`.model_bundle`): loaded, adapted, checked, laid out over the mesh, compiled.
4. **services** (:mod:`.services`): optimizer, metrics, checkpoint tiers, the step guard, and what the
   recipe adds.

The :class:`Runtime` holds what the phases built and is never changed afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from lmforge.checkpoint import RunDir
from lmforge.checkpoint.layout import write_json, write_text
from lmforge.checkpoint.tiers import CheckpointTiers
from lmforge.config import Config
from lmforge.errors import UserError
from lmforge.metrics import MetricLogger
from lmforge.optim.optimizers import make_optimizer
from lmforge.runtime.check import check_run
from lmforge.runtime.guard import Guard
from lmforge.runtime.model_bundle import ModelBundle, build_model_bundle
from lmforge.runtime.services import RecipeServices, StepHook, build_checkpoints, log_setup
from lmforge.runtime.world import World, start_world


@dataclass(frozen=True)
class Runtime:
    """What every trainer runs on: the config, the world, the model, and the services around it."""

    cfg: Config
    world: World
    model: ModelBundle
    optimizer: torch.optim.Optimizer
    metrics: MetricLogger
    checkpoints: CheckpointTiers
    guard: Guard
    """Checks each step (non-finite values, loss spikes) and every checkpoint before it is saved."""
    step_hooks: tuple[StepHook, ...] = ()

    def open_run_dir(self) -> None:
        """Write the run's config, model description and metrics: called once every start-up check
        (config, data, the checkpoint to resume) has passed, so a refused start leaves the run
        directory as it was."""
        self.metrics.open()
        if self.world.dist.is_main:
            run = RunDir(self.world.run_dir)
            try:
                write_text(run.config, self.cfg.to_toml())
                write_json(run.model_args, self.model.description)
            except OSError as e:
                raise UserError(f"run.dir={run.root}: cannot write the run directory ({e.strerror or e})") from None


def build_runtime(cfg: Config, trainer: str, services: RecipeServices = RecipeServices()) -> Runtime:
    """Check, then the world, then the model, then the services (see the module's docstring)."""
    plan = check_run(cfg)
    t = cfg.training
    world = start_world(t.device, t.threads, plan.layout, cfg.parallel, plan.run.root)
    model = build_model_bundle(cfg, world, plan.source, trainer, services.head)
    return with_services(cfg, plan.run, world, model, trainer, services)


def with_services(cfg: Config, run: RunDir, world: World, model: ModelBundle, trainer: str,
                  services: RecipeServices) -> Runtime:
    """The optimizer, the metrics (and the setup line), the guard and the checkpoint tiers around
    ``model``, each from its own section, in that order: a model the optimizer refuses stops the run
    before anything is logged, and the setup line comes before what the tiers report."""
    info, t = world.dist, cfg.training
    optimizer = make_optimizer(model.module, cfg.optimizer)
    metrics = MetricLogger.from_section(cfg.metrics, run.root, rank=info.rank, world_size=info.world_size,
                                        device=info.device, steps=t.steps, max_tokens=t.max_tokens,
                                        flops_per_token=model.flops_per_token, peak_flops=model.peak_flops,
                                        config=cfg.to_dict(), process_start=services.process_start)
    log_setup(cfg, world, model, metrics, trainer, services.notes_for(model.args))
    guard = Guard.from_section(t, cfg.checkpoint, metrics, info.device.type)
    checkpoints = build_checkpoints(cfg, info, run, metrics, trainer, services)
    return Runtime(cfg, world, model, optimizer, metrics, checkpoints, guard, services.step_hooks)
