"""The runtime every recipe trains on, built in four phases.

1. **check** (:mod:`.check`): the config alone, pure; nothing is written. It settles a
   :class:`~lmforge.runtime.check.RunPlan` (the layout, the model's source, the run directory, the
   config's text) that the later phases take instead of working it out again.
2. **world** (:mod:`.world`): process group, layout, mesh, reduce group, the claimed run directory.
3. **model** (:mod:`.model_bundle`): loaded and adapted (the model layer), then checked against the
   checkpoints to resume, its dtype and the device's peak chosen (:mod:`.precision`), compiled where
   that pays (:mod:`.compile_cache`), laid out over the mesh.
4. **services** (:mod:`.services`, built in :func:`build_runtime`): optimizer, metrics, the step
   guard, the setup line, checkpoint tiers, each from its own section, and what the recipe adds.

Each phase takes the plan, what the phases before it built and its own config sections; it runs the
runtime's own steps before it calls down the layers, except where a decision needs a fact only a lower
layer produces (the process group before the layout is agreed on, the loaded model before the
checkpoints, dtype and compiling are decided; ARCHITECTURE.md, "The runtime"). The :class:`Runtime`
holds what the phases built and is never changed afterwards.
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
    config_toml: str
    """The config's text, settled once by the check phase (the setup line and ``config.toml``)."""
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
                write_text(run.config, self.config_toml)
                write_json(run.model_args, self.model.description)
            except OSError as e:
                raise UserError(f"run.dir={run.root}: cannot write the run directory ({e.strerror or e})") from None


def build_runtime(cfg: Config, trainer: str, services: RecipeServices = RecipeServices()) -> Runtime:
    """Check, then the world, then the model, then the services (see the module's docstring).

    The services come in one straight line, each from its own section: the optimizer first (a model it
    refuses stops the run before anything is logged), the metrics, the guard, the setup line, then the
    checkpoint tiers (whatever they report comes after the setup line)."""
    plan = check_run(cfg)
    t = cfg.training
    world = start_world(t.device, t.threads, plan.layout, cfg.parallel, plan.run.root)
    model = build_model_bundle(cfg, plan, world, trainer, services.head)
    info = world.dist
    optimizer = make_optimizer(model.module, cfg.optimizer)
    metrics = MetricLogger.from_section(cfg.metrics, plan.run.root, rank=info.rank, world_size=info.world_size,
                                        device=info.device, steps=t.steps, max_tokens=t.max_tokens,
                                        flops_per_token=model.flops_per_token, peak_flops=model.peak_flops,
                                        config=cfg.to_dict(), process_start=services.process_start)
    guard = Guard.from_section(t, cfg.checkpoint, metrics, info.device.type)
    log_setup(cfg, plan.config_toml, world, model, metrics, trainer, services.notes_for(model.args))
    checkpoints = build_checkpoints(cfg, info, plan.run, metrics, trainer, services)
    return Runtime(cfg, plan.config_toml, world, model, optimizer, metrics, checkpoints, guard, services.step_hooks)
