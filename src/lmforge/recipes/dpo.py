"""Direct preference optimization on ``prompt``/``chosen``/``rejected`` records.

The loss and its logged values are :mod:`lmforge.objectives.dpo`; the reference is the run's starting
model, frozen (:class:`~lmforge.objectives.reference.FrozenReference`). The step source is SFT's packed
loader over rows of whole pairs (:mod:`lmforge.data.preference_data`), so a pair never straddles
microbatches; each step's FLOPs include the reference's forward pass, and checkpoints record the
reference's source, so a resume scores against the same reference (:mod:`lmforge.recipes.jobs.preference`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from lmforge.config import Config, RunSection, StartEvalSection, TasksSection
from lmforge.recipes.base import register
from lmforge.recipes.jobs.preference_recipe import BetaSection, PreferenceRecipe

if TYPE_CHECKING:  # recipe modules import no torch until a run starts (lmforge --help stays fast)
    from lmforge.objectives.dpo import DPOObjective
    from lmforge.objectives.reference import FrozenReference
    from lmforge.runtime import Runtime


class DPOSection(BetaSection):
    """``beta``: the strength of the pull towards the reference (the reward scale: reward = beta * log-ratio)."""

    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """``lmforge.objectives.dpo.LossType`` (spelled out here: that module imports torch)."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """cDPO: the assumed share of flipped preference labels (sigmoid loss only)."""
    nll_weight: float = Field(0.0, ge=0)
    """Weight of the chosen response's per-token negative log-likelihood added to each pair's loss (RPO)."""
    ipo_per_token: bool = True
    """IPO on per-token mean log-ratios (TRL's form, the one behind the IPO paper's results); false:
    on log-ratios summed over each response (docs/parity.md)."""

    @model_validator(mode="after")
    def _smoothing_needs_sigmoid(self) -> "DPOSection":
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError(f"label_smoothing applies to the sigmoid loss only (loss_type={self.loss_type})")
        return self


class DPOConfig(Config):
    dpo: DPOSection = DPOSection()
    tasks: TasksSection = TasksSection()
    eval: StartEvalSection = StartEvalSection()
    run: RunSection = RunSection(dir="runs/dpo")


@register
class DPO(PreferenceRecipe):
    name = "dpo"
    config = DPOConfig
    summary = "direct preference optimization (sigmoid, cDPO, IPO; RPO's NLL term) on preference pairs"
    method, uses_reference, extra_forwards = "DPO", True, 1

    @staticmethod
    def objective(cfg: DPOConfig, reference: FrozenReference) -> DPOObjective:
        """The run's objective from its config alone (what tests check each key against)."""
        from lmforge.objectives.dpo import DPOObjective

        d = cfg.dpo
        return DPOObjective(reference, beta=d.beta, loss_type=d.loss_type, label_smoothing=d.label_smoothing,
                            nll_weight=d.nll_weight, ipo_per_token=d.ipo_per_token,
                            chunk_tokens=cfg.training.loss_chunk_tokens)

    def make_objective(self, rt: Runtime, cfg: DPOConfig, reference: FrozenReference | None) -> DPOObjective:
        assert reference is not None
        return self.objective(cfg, reference)
