"""What the preference recipes (DPO, ORPO, SimPO, KTO) share: their config options, the check of
their data and :class:`~.preference_recipe.PreferenceRecipe`, their base (in :mod:`.preference_recipe`,
light to import), the step source over rows of pairs and the job around a method's objective.

A recipe of this kind is then only its own section, its objective and (KTO) how records become pairs.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from lmforge.data.chat import ChatFormat, training_chat_format
from lmforge.data.image_tokens import ImageEncoding, image_encoding_for
from lmforge.data.inputs import DataSpec, train_and_validation
from lmforge.data.overlong import Overlong
from lmforge.data.preference_data import PreferenceDataset, PreferenceSummary, build_preference_dataset, read_preference_records
from lmforge.evaluation.loss import validation_eval
from lmforge.evaluation.tasks import TaskEval, held_out_examples
from lmforge.models.tokenizer import Tokenizer
from lmforge.training.loop import EvalFn, Job, StepBatch
from lmforge.recipes.jobs.next_token import LoaderSource
from lmforge.objectives.reference import FrozenReference
from lmforge.recipes.jobs.preference_sections import PreferenceSection
from lmforge.runtime import Runtime

PairBuilder = Callable[[str, Tokenizer, "ChatFormat | None", int, bool, Overlong],
                      "tuple[PreferenceDataset, PreferenceSummary]"]
"""``(data file or directory, tokenizer, chat, seq_len, packing, data.overlong) -> (rows of pairs, summary)``."""


def preference_pairs(path: str, tokenizer: Tokenizer, chat: ChatFormat | None, seq_len: int,
                     packing: bool, overlong: Overlong,
                     images: ImageEncoding | None = None) -> tuple[PreferenceDataset, PreferenceSummary]:
    """``prompt``/``chosen``/``rejected`` records to rows of pairs (DPO, ORPO, SimPO); ``images``: a
    vision-language model's image encoding, for prompts with image parts."""
    return build_preference_dataset(read_preference_records(path), path, tokenizer, chat, seq_len=seq_len,
                                    packing=packing, overlong=overlong, images=images)


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
    images = image_encoding_for(rt.model.args, rt.model.tokenizer)
    if images is not None and "images" in inspect.signature(build).parameters:  # prompts with images (DPO, ORPO,
        build = functools.partial(build, images=images)  # SimPO); the other builders read text

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
