"""ORPO on ``prompt``/``chosen``/``rejected`` records: SFT on the chosen response plus an odds-ratio
term, with no reference model (:mod:`lmforge.objectives.orpo`); data, step source and eval as every
preference recipe (:mod:`lmforge.recipes.jobs.preference`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from lmforge.config import Config, RunSection, StartEvalSection, TasksSection
from lmforge.recipes.base import register
from lmforge.recipes.jobs.preference_recipe import PreferenceRecipe, PreferenceSection

if TYPE_CHECKING:  # recipe modules import no torch until a run starts (lmforge --help stays fast)
    from lmforge.objectives.orpo import ORPOObjective
    from lmforge.runtime import Runtime


class ORPOSection(PreferenceSection):
    beta: float = Field(0.1, gt=0)
    """The odds-ratio term's weight (the paper's lambda; 0.1 there and in common recipes)."""
    nll: Literal["pair", "token"] = "pair"
    """The SFT term: each pair's mean token NLL averaged over pairs (``pair``, the paper's formula) or
    the step's chosen-token NLL over its chosen tokens (``token``, TRL's; docs/parity.md)."""


class ORPOConfig(Config):
    orpo: ORPOSection = ORPOSection()
    tasks: TasksSection = TasksSection()
    eval: StartEvalSection = StartEvalSection()
    run: RunSection = RunSection(dir="runs/orpo")


@register
class ORPO(PreferenceRecipe):
    name = "orpo"
    config = ORPOConfig
    summary = "ORPO: SFT plus an odds-ratio preference term, no reference model"
    method = "ORPO"

    @staticmethod
    def objective(cfg: ORPOConfig) -> ORPOObjective:
        """The run's objective from its config alone (what tests check each key against)."""
        from lmforge.objectives.orpo import ORPOObjective

        return ORPOObjective(beta=cfg.orpo.beta, nll=cfg.orpo.nll, chunk_tokens=cfg.training.loss_chunk_tokens)

    def make_objective(self, rt: Runtime, cfg: ORPOConfig, reference: None) -> ORPOObjective:
        return self.objective(cfg)
