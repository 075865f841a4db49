"""KTO on single responses labelled desirable or undesirable (or preference pairs, split into one of
each): the loss is :mod:`lmforge.objectives.kto`, the data :mod:`lmforge.data.unpaired_data`; the
reference is the run's starting model, frozen, and everything else is every preference recipe's
(:mod:`lmforge.recipes.jobs.preference`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field

from lmforge.config import Config, RunSection, StartEvalSection, TasksSection
from lmforge.recipes.base import register
from lmforge.recipes.jobs.preference_recipe import BetaSection, PreferenceRecipe

if TYPE_CHECKING:  # recipe modules import no torch until a run starts (lmforge --help stays fast)
    from lmforge.objectives.kto import KTOObjective
    from lmforge.objectives.reference import FrozenReference
    from lmforge.runtime import Runtime


class KTOSection(BetaSection):
    """``beta``: the reward scale (reward = beta * log-ratio to the reference), as in DPO."""

    desirable_weight: float = Field(1.0, gt=0)
    undesirable_weight: float = Field(1.0, gt=0)
    """Weights of the two kinds of example; with unbalanced data, choose them so that
    ``desirable_weight * desirable / (undesirable_weight * undesirable)`` lies in [1, 4/3] (the KTO paper's advice)."""


class KTOConfig(Config):
    kto: KTOSection = KTOSection()
    tasks: TasksSection = TasksSection()
    eval: StartEvalSection = StartEvalSection()
    run: RunSection = RunSection(dir="runs/kto")


@register
class KTO(PreferenceRecipe):
    name = "kto"
    config = KTOConfig
    summary = "KTO on responses labelled desirable/undesirable (or preference pairs, split)"
    method, records = "KTO", "prompt, completion, label; or prompt, chosen, rejected"
    # the reference point's pass: one forward of the policy and one of the reference, without grad
    uses_reference, extra_forwards = True, 2

    @staticmethod
    def pairs(path: str, tokenizer: Any, chat: Any, seq_len: int, packing: bool, overlong: Any) -> Any:
        from lmforge.data.unpaired_data import build_unpaired_dataset

        return build_unpaired_dataset(path, tokenizer, chat, seq_len, packing, overlong)

    @staticmethod
    def objective(cfg: KTOConfig, policy: Any, reference: FrozenReference, autocast: Any = None) -> KTOObjective:
        """The run's objective from its config (what tests check each key against)."""
        from lmforge.objectives.kto import KTOObjective

        k = cfg.kto
        return KTOObjective(policy, reference, beta=k.beta, desirable_weight=k.desirable_weight,
                            undesirable_weight=k.undesirable_weight, chunk_tokens=cfg.training.loss_chunk_tokens,
                            **({} if autocast is None else {"autocast": autocast}))

    def make_objective(self, rt: Runtime, cfg: KTOConfig, reference: FrozenReference | None) -> KTOObjective:
        assert reference is not None
        return self.objective(cfg, rt.model.module, reference, rt.model.autocast)
