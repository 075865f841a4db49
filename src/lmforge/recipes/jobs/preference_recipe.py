"""What every recipe on preference pairs declares: its config sections (:mod:`.preference_sections`), the check of its training data,
and :class:`PreferenceRecipe`, the recipe base of DPO, KTO, ORPO and SimPO.

Kept apart from :mod:`.preference` (the step source and the job, which need torch) so that these
recipes' config classes, and with them ``lmforge --help`` and every config error, load without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from lmforge.config import Config
from lmforge.data.inputs import train_spec
from lmforge.errors import UserError
from lmforge.recipes.base import Recipe
from lmforge.recipes.jobs.preference_sections import BetaSection, PairDataSection, PreferenceSection

if TYPE_CHECKING:
    from lmforge.objectives.reference import FrozenReference
    from lmforge.runtime import Runtime
    from lmforge.training.loop import Job


def check_preference_data(cfg: Config, method: str, records: str = "prompt, chosen, rejected") -> None:
    """Refuse, before anything is written, training data that cannot hold preference records."""
    if train_spec(cfg.data).kind != "path":
        raise UserError(f"data.train={cfg.data.train}: {method} trains on preference records (.jsonl/.parquet with "
                        f"{records}); examples/dpo_demo.py builds them from the embedded tasks")


__all__ = ["BetaSection", "PairDataSection", "PreferenceRecipe", "PreferenceSection", "check_preference_data"]


class PreferenceRecipe(Recipe):
    """A preference method: its section (named as the recipe), its objective and the facts below; the
    data check, the datasets, the frozen reference, the step source and the eval are built here."""

    method: ClassVar[str]
    """The method's name in messages (``DPO``)."""
    records: ClassVar[str] = "prompt, chosen, rejected"
    """The record fields it trains on, as the data check names them."""
    uses_reference: ClassVar[bool] = False
    """Trains against the run's starting model, frozen."""
    extra_forwards: ClassVar[int] = 0
    """Forward passes per step besides the policy's (counted in the step's FLOPs)."""

    @staticmethod
    def pairs(path: str, tokenizer: Any, chat: Any, seq_len: int, packing: bool, overlong: Any,
              images: Any = None) -> Any:
        """How the records become rows of pairs (:data:`~lmforge.recipes.jobs.preference.PairBuilder`);
        ``images``: a vision-language model's image encoding (prompts with image parts)."""
        from lmforge.recipes.jobs.preference import preference_pairs

        return preference_pairs(path, tokenizer, chat, seq_len, packing, overlong, images)

    def check(self, cfg: Any) -> None:
        check_preference_data(cfg, self.method, self.records)

    def make_objective(self, rt: Runtime, cfg: Any, reference: FrozenReference | None) -> Any:
        """The objective of the run (the recipe's own ``objective(cfg, ...)`` with what it needs)."""
        raise NotImplementedError

    def build(self, rt: Runtime, cfg: Any, inputs: None) -> Job:
        from lmforge.objectives.reference import FrozenReference
        from lmforge.recipes.jobs.preference import preference_datasets, preference_job

        section = getattr(cfg, self.name)
        train_set, val_set = preference_datasets(rt, section, self.name, type(self).pairs)
        reference = FrozenReference.for_run(rt) if self.uses_reference else None
        return preference_job(rt, section, self.make_objective(rt, cfg, reference), train_set, val_set, reference,
                              extra_forwards=self.extra_forwards)
