"""The config sections every recipe on preference pairs shares (reward models too); light, so that
config classes load without torch."""

from __future__ import annotations

from pydantic import Field

from lmforge.config import Section


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
