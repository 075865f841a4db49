"""SimPO on ``prompt``/``chosen``/``rejected`` records: a reference-free, length-normalised margin
(:mod:`lmforge.objectives.simpo`); data, step source and eval as every preference recipe
(:mod:`lmforge.recipes.jobs.preference`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from lmforge.config import Config, RunSection, StartEvalSection, TasksSection
from lmforge.recipes.base import register
from lmforge.recipes.jobs.preference_recipe import PreferenceRecipe, PreferenceSection

if TYPE_CHECKING:  # recipe modules import no torch until a run starts (lmforge --help stays fast)
    from lmforge.objectives.simpo import SimPOObjective
    from lmforge.runtime import Runtime


class SimPOSection(PreferenceSection):
    beta: float = Field(2.0, gt=0)
    """Reward scale: a response's reward is ``beta`` x its mean token log-prob (the paper uses 2-2.5)."""
    gamma: float = Field(1.0, ge=0)
    """Target reward margin of chosen over rejected (the paper's gamma/beta of 0.5-0.8 with beta 2)."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    nll_weight: float = Field(0.0, ge=0)
    """Weight of the chosen response's per-token negative log-likelihood (CPO's term)."""


class SimPOConfig(Config):
    simpo: SimPOSection = SimPOSection()
    tasks: TasksSection = TasksSection()
    eval: StartEvalSection = StartEvalSection()
    run: RunSection = RunSection(dir="runs/simpo")


@register
class SimPO(PreferenceRecipe):
    name = "simpo"
    config = SimPOConfig
    summary = "SimPO: reference-free preference optimization on length-normalised rewards with a margin"
    method = "SimPO"

    @staticmethod
    def objective(cfg: SimPOConfig) -> SimPOObjective:
        """The run's objective from its config alone (what tests check each key against)."""
        from lmforge.objectives.simpo import SimPOObjective

        s = cfg.simpo
        return SimPOObjective(beta=s.beta, gamma=s.gamma, label_smoothing=s.label_smoothing,
                              nll_weight=s.nll_weight, chunk_tokens=cfg.training.loss_chunk_tokens)

    def make_objective(self, rt: Runtime, cfg: SimPOConfig, reference: None) -> SimPOObjective:
        return self.objective(cfg)
