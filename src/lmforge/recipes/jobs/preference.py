"""What the preference recipes (DPO, ORPO, SimPO, KTO) share: their config options, the check of
their data, the step source over rows of pairs, the job around a method's objective, and
:class:`PreferenceRecipe`, their base.

A recipe of this kind is then only its own section, its objective and (KTO) how records become pairs.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

from pydantic import Field

from lmforge.config import Config, Section
from lmforge.data.chat import ChatFormat, training_chat_format
from lmforge.data.inputs import DataSpec, train_and_validation, train_spec
from lmforge.data.overlong import Overlong
from lmforge.data.preference_data import PreferenceDataset, PreferenceSummary, build_preference_dataset, read_preference_records
from lmforge.errors import UserError
from lmforge.evaluation.loss import validation_eval
from lmforge.evaluation.tasks import TaskEval, held_out_examples
from lmforge.models.tokenizer import Tokenizer
from lmforge.training.loop import EvalFn, Job, StepBatch
from lmforge.recipes.jobs.next_token import LoaderSource
from lmforge.objectives.reference import FrozenReference
from lmforge.recipes.base import Recipe
from lmforge.runtime import Runtime


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


PairBuilder = Callable[[str, Tokenizer, "ChatFormat | None", int, bool, Overlong],
                      "tuple[PreferenceDataset, PreferenceSummary]"]
"""``(data file or directory, tokenizer, chat, seq_len, packing, data.overlong) -> (rows of pairs, summary)``."""


def preference_pairs(path: str, tokenizer: Tokenizer, chat: ChatFormat | None, seq_len: int,
                     packing: bool, overlong: Overlong) -> tuple[PreferenceDataset, PreferenceSummary]:
    """``prompt``/``chosen``/``rejected`` records to rows of pairs (DPO, ORPO, SimPO)."""
    return build_preference_dataset(read_preference_records(path), path, tokenizer, chat, seq_len=seq_len,
                                    packing=packing, overlong=overlong)


def check_preference_data(cfg: Config, method: str, records: str = "prompt, chosen, rejected") -> None:
    """Refuse, before anything is written, training data that cannot hold preference records."""
    if train_spec(cfg.data).kind != "path":
        raise UserError(f"data.train={cfg.data.train}: {method} trains on preference records (.jsonl/.parquet with "
                        f"{records}); examples/dpo_demo.py builds them from the embedded tasks")


class PreferenceSource(LoaderSource):
    """SFT's packed loader over rows of pairs, plus the forward passes without grad that the method
    runs inside each step (a reference model's, KTO's reference-point pass) in each step's FLOPs, and
    the reference's source in each checkpoint (so a resume scores against the same reference)."""

    def __init__(self, rt: Runtime, dataset: PreferenceDataset, reference: FrozenReference | None,
                 extra_forwards: int) -> None:
        super().__init__(rt, dataset)
        self.rt, self.reference, self.extra_forwards = rt, reference, extra_forwards

    def next_step(self, step: int) -> StepBatch:
        batch = super().next_step(step)
        if self.extra_forwards:
            # a forward pass is a third of full training FLOPs (2 of 6 per parameter and token, 4 of 12
            # for attention), whatever the policy's backward costs (LoRA's is cheaper)
            lengths = [n for mb in batch.microbatches for n in mb.real_document_lengths()]
            batch.flops += self.extra_forwards * self.rt.model.spec.training_flops(self.rt.model.args, lengths) / 3
        return batch

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | (self.reference.state_dict() if self.reference else {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.reference is not None:
            self.reference.load_state_dict(state)


def preference_datasets(rt: Runtime, section: PreferenceSection, method: str,
                        build: PairBuilder = preference_pairs) -> tuple[PreferenceDataset, PreferenceDataset | None]:
    """Train and validation rows of pairs; each summary (pairs kept, skipped) is logged as ``{method}_data``."""
    d = rt.cfg.data
    chat = training_chat_format(rt.model.tokenizer, rt.model.args.vocab_size, section.chat_template)

    def one(spec: DataSpec, split: str) -> PreferenceDataset:
        dataset, summary = build(spec.value, rt.model.tokenizer, chat, d.seq_len, section.packing, d.overlong)
        summary.method = method
        rt.metrics.record_event(f"{method}_data", 0, summary.line(), split=split, **summary.counts())
        return dataset

    return train_and_validation(d, one)


def preference_job(rt: Runtime, section: PreferenceSection, objective: Any, train_set: PreferenceDataset,
                   val_set: PreferenceDataset | None, reference: FrozenReference | None, extra_forwards: int,
                   evaluate: Callable[..., EvalFn | None] = validation_eval) -> Job:
    """The step source over ``train_set``, ``objective``, and eval on ``val_set`` (plus held-out task
    exact match with ``task_eval``)."""
    tasks = TaskEval(held_out_examples(rt.cfg.tasks) if section.task_eval else [], rt.cfg.tasks.eval_max_new_tokens)
    return Job(PreferenceSource(rt, train_set, reference, extra_forwards), objective,
               evaluate(objective, val_set, tasks))


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
    pairs: ClassVar[PairBuilder] = preference_pairs
    """How the records become rows of pairs."""

    def check(self, cfg: Any) -> None:
        check_preference_data(cfg, self.method, self.records)

    def make_objective(self, rt: Runtime, cfg: Any, reference: FrozenReference | None) -> Any:
        """The objective of the run (the recipe's own ``objective(cfg, ...)`` with what it needs)."""
        raise NotImplementedError

    def build(self, rt: Runtime, cfg: Any, inputs: None) -> Job:
        section = getattr(cfg, self.name)
        train_set, val_set = preference_datasets(rt, section, self.name, type(self).pairs)
        reference = FrozenReference.for_run(rt) if self.uses_reference else None
        return preference_job(rt, section, self.make_objective(rt, cfg, reference), train_set, val_set, reference,
                              extra_forwards=self.extra_forwards)
