"""Reward models: a scalar score per sequence, trained on preference pairs (``lmforge rm``).

The model is the run's decoder (any family) with a score head (:mod:`lmforge.models.heads`), which
the runtime adds before wrapping the model, so it trains, syncs and checkpoints like any parameter;
the loss and its logged values are :mod:`lmforge.objectives.reward`. The data are DPO's preference
records and rows, each sequence whole, with an optional ``margin`` per record
(:mod:`lmforge.data.reward_data`). ``lmforge export --hf`` writes the run as the family's
``*ForSequenceClassification``, and ``grpo.rewards = ["rm:PATH"]`` uses it as a GRPO reward
(:mod:`lmforge.rl.reward_model`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import Field

from lmforge.config import Config, RunSection, StartEvalSection
from lmforge.data.inputs import train_and_validation
from lmforge.errors import UserError
from lmforge.recipes.base import Recipe, register
from lmforge.recipes.jobs.preference_recipe import PairDataSection, check_preference_data

if TYPE_CHECKING:  # recipe modules import no torch until a run starts (lmforge --help stays fast)
    from lmforge.data.preference_data import PreferenceDataset
    from lmforge.data.sources import Record
    from lmforge.runtime import RecipeServices, Runtime
    from lmforge.training.loop import Job


class RMSection(PairDataSection):
    center_rewards_coefficient: float = Field(0.0, ge=0)
    """Weight of ``(r_chosen + r_rejected)^2`` added to each pair's loss: keeps scores centred on 0."""
    holdout: float = Field(0.0, ge=0, lt=1)
    """Share of data.train's records (the last ones) held out as validation pairs (needs data.validation=none)."""


class RMConfig(Config):
    rm: RMSection = RMSection()
    eval: StartEvalSection = StartEvalSection()
    run: RunSection = RunSection(dir="runs/rm")


@dataclass
class RMInputs:
    train: list[Record]
    validation: list[Record] | None
    sources: tuple[str, str]


def read_inputs(cfg: RMConfig) -> RMInputs:
    """Train and validation records, checked (margins too), or the training records' last
    ``rm.holdout`` share as validation."""
    from lmforge.data.reward_data import read_reward_records

    d, share = cfg.data, cfg.rm.holdout
    if share and d.validation not in ("", "none"):
        raise UserError(f"rm.holdout={share} takes the validation pairs from data.train: set data.validation=none "
                        "(or give a validation file with rm.holdout=0)")
    train, val = train_and_validation(d, lambda spec, split: read_reward_records(spec.value))
    if not share:
        return RMInputs(train, val, (d.train, d.validation))
    held = round(len(train) * share)
    if held < 1 or held >= len(train):
        raise UserError(f"rm.holdout={share} of {len(train)} records leaves no training or no validation pairs")
    return RMInputs(train[:-held], train[-held:], (d.train, f"{d.train} (last {held} records)"))


@register
class RM(Recipe):
    name = "rm"
    config = RMConfig
    summary = "reward model (Bradley-Terry, optional margins and centring) on preference pairs"

    def check(self, cfg: RMConfig) -> RMInputs:
        check_preference_data(cfg, "a reward model", "prompt, chosen, rejected and an optional numeric margin")
        return read_inputs(cfg)

    def services(self, cfg: RMConfig, inputs: RMInputs) -> RecipeServices:
        from lmforge.runtime import RecipeServices

        return RecipeServices(head="score")

    def build(self, rt: Runtime, cfg: RMConfig, inputs: RMInputs) -> Job:
        from lmforge.data.chat import training_chat_format
        from lmforge.data.reward_data import build_reward_dataset
        from lmforge.evaluation.loss import validation_eval
        from lmforge.objectives.reward import RewardObjective
        from lmforge.recipes.jobs.next_token import LoaderSource
        from lmforge.training.loop import Job

        chat = training_chat_format(rt.model.tokenizer, rt.model.args.vocab_size, cfg.rm.chat_template)

        def build(records: list[Record], source: str, split: str) -> PreferenceDataset:
            dataset, summary = build_reward_dataset(records, source, rt.model.tokenizer, chat, seq_len=cfg.data.seq_len,
                                                    packing=cfg.rm.packing, overlong=cfg.data.overlong)
            rt.metrics.record_event("rm_data", 0, summary.line(), split=split, **summary.counts())
            return dataset

        train_set = build(inputs.train, inputs.sources[0], "train")
        val_set = None if inputs.validation is None else build(inputs.validation, inputs.sources[1], "validation")
        objective = RewardObjective(cfg.rm.center_rewards_coefficient)
        return Job(LoaderSource(rt, train_set), objective, validation_eval(objective, val_set))
