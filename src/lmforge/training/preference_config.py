"""The config sections every recipe on preference pairs shares, and the check of their training data.

Kept apart from :mod:`.preference` (the step source and job, which need torch) so that a recipe's
config class, and with it ``lmforge --help`` and every config error, loads without torch.
"""

from __future__ import annotations

from pydantic import Field

from lmforge.config import Config, Section
from lmforge.data.inputs import train_spec
from lmforge.errors import UserError


class PairDataSection(Section):
    """How every recipe on preference pairs lays out its data (reward models too)."""

    packing: bool = True
    """Pack several pairs per row (isolated by document masks); false: one pair per row."""
    chat_template: str | None = None
    """A jinja file to use instead of the tokenizer's own chat template."""


class PreferenceSection(PairDataSection):
    """Options every preference recipe has (its own section adds the method's)."""

    task_eval: bool = False
    """Also score held-out exact match on the embedded tasks at every eval (for pairs built from them)."""


class BetaSection(PreferenceSection):
    beta: float = Field(0.1, gt=0)


def check_preference_data(cfg: Config, method: str, records: str = "prompt, chosen, rejected") -> None:
    """Refuse, before anything is written, training data that cannot hold preference records."""
    if train_spec(cfg.data).kind != "path":
        raise UserError(f"data.train={cfg.data.train}: {method} trains on preference records (.jsonl/.parquet with "
                        f"{records}); examples/dpo_demo.py builds them from the embedded tasks")
