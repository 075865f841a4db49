"""ORPO on ``prompt``/``chosen``/``rejected`` records: SFT on the chosen response plus an odds-ratio
term, with no reference model (:mod:`lmforge.objectives.orpo`); data, step source and eval as every
preference recipe (:mod:`lmforge.recipes.jobs.preference`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from lmforge.config import Config, RunSection, StartEvalSection, TasksSection
from lmforge.objectives.orpo import ORPOObjective
from lmforge.recipes.base import Recipe, register
from lmforge.training.loop import Job
from lmforge.recipes.jobs.preference import PreferenceSection, check_preference_data, preference_datasets, preference_job
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
class ORPO(Recipe):
    name = "orpo"
    config = ORPOConfig
    summary = "ORPO: SFT plus an odds-ratio preference term, no reference model"

    def check(self, cfg: ORPOConfig) -> None:
        check_preference_data(cfg, "ORPO")

    @staticmethod
    def objective(cfg: ORPOConfig) -> ORPOObjective:
        """The run's objective from its config alone (what tests check each key against)."""
        return ORPOObjective(beta=cfg.orpo.beta, nll=cfg.orpo.nll, chunk_tokens=cfg.training.loss_chunk_tokens)

    def build(self, rt: Runtime, cfg: ORPOConfig, inputs: None) -> Job:
        o = cfg.orpo
        train_set, val_set = preference_datasets(rt, o, "orpo")
        objective = self.objective(cfg)
        return preference_job(rt, o, objective, train_set, val_set, None, extra_forwards=0)
