"""Direct preference optimization on ``prompt``/``chosen``/``rejected`` records.

The loss and its logged values are :mod:`lmforge.objectives.dpo`; the reference is the run's starting
model, frozen (:class:`~lmforge.training.reference.FrozenReference`). The step source is SFT's packed
loader over rows of whole pairs (:mod:`lmforge.data.preference_data`), so a pair never straddles
microbatches; each step's FLOPs include the reference's forward pass, and checkpoints record the
reference's source, so a resume scores against the same reference.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from lmforge.config import Config, RunSection, Section, StartEvalSection, TasksSection
from lmforge.data.chat import training_chat_format
from lmforge.data.inputs import DataSpec, train_and_validation, train_spec
from lmforge.data.preference_data import (
    PreferenceDataset,
    build_preference_dataset,
    read_preference_records,
)
from lmforge.errors import UserError
from lmforge.evaluation.loss import validation_eval
from lmforge.evaluation.tasks import TaskEval, held_out_examples
from lmforge.objectives.dpo import DPOObjective, LossType
from lmforge.recipes.base import Recipe, register
from lmforge.training.loop import Job, StepBatch
from lmforge.training.next_token import LoaderSource
from lmforge.training.reference import FrozenReference
from lmforge.training.runtime import Runtime


class DPOSection(Section):
    beta: float = Field(0.1, gt=0)
    """Strength of the pull towards the reference (the reward scale: reward = beta * log-ratio)."""
    loss_type: LossType = "sigmoid"
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """cDPO: the assumed share of flipped preference labels (sigmoid loss only)."""
    nll_weight: float = Field(0.0, ge=0)
    """Weight of the chosen response's per-token negative log-likelihood added to each pair's loss (RPO)."""
    packing: bool = True
    """Pack several pairs per row (isolated by document masks); false: one pair per row."""
    chat_template: str | None = None
    """A jinja file to use instead of the tokenizer's own chat template."""
    task_eval: bool = False
    """Also score held-out exact match on the embedded tasks at every eval (for pairs built from them)."""

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


class PreferenceSource(LoaderSource):
    """SFT's packed loader over rows of pairs, plus the reference's forward pass in each step's FLOPs
    and the reference's source in each checkpoint."""

    def __init__(self, rt: Runtime, dataset: PreferenceDataset, reference: FrozenReference) -> None:
        super().__init__(rt, dataset)
        self.rt, self.reference = rt, reference

    def next_step(self, step: int) -> StepBatch:
        batch = super().next_step(step)
        # plus the reference's forward pass: a third of full training FLOPs (2 of 6 per parameter and
        # token, 4 of 12 for attention), whatever the policy's backward costs (LoRA's is cheaper)
        lengths = [n for mb in batch.microbatches for n in mb.real_document_lengths()]
        batch.flops += self.rt.spec.training_flops(self.rt.model_args, lengths) / 3
        return batch

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | self.reference.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.reference.load_state_dict(state)


def build_datasets(cfg: DPOConfig, rt: Runtime) -> tuple[PreferenceDataset, PreferenceDataset | None]:
    """Train and validation pairs; each summary (pairs kept, skipped) is logged."""
    d = cfg.data
    chat = training_chat_format(rt.tokenizer, rt.model_args.vocab_size, cfg.dpo.chat_template)

    def build(spec: DataSpec, split: str) -> PreferenceDataset:
        dataset, summary = build_preference_dataset(read_preference_records(spec.value), spec.value, rt.tokenizer,
                                                    chat, seq_len=d.seq_len, packing=cfg.dpo.packing)
        rt.metrics.record_event("dpo_data", 0, summary.line(), split=split, **summary.counts())
        return dataset

    return train_and_validation(d, build)


@register
class DPO(Recipe):
    name = "dpo"
    config = DPOConfig
    summary = "direct preference optimization (sigmoid, cDPO, IPO; RPO's NLL term) on preference pairs"

    def check(self, cfg: DPOConfig) -> None:
        if train_spec(cfg.data).kind != "path":
            raise UserError(f"data.train={cfg.data.train}: DPO trains on preference records (.jsonl/.parquet with "
                            "prompt, chosen, rejected); examples/dpo_demo.py builds them from the embedded tasks")

    def build(self, rt: Runtime, cfg: DPOConfig, inputs: None) -> Job:
        train_set, val_set = build_datasets(cfg, rt)
        d = cfg.dpo
        reference = FrozenReference.for_run(rt)
        objective = DPOObjective(reference, beta=d.beta, loss_type=d.loss_type, label_smoothing=d.label_smoothing,
                                 nll_weight=d.nll_weight, chunk_tokens=cfg.training.loss_chunk_tokens)
        tasks = TaskEval(held_out_examples(cfg.tasks) if d.task_eval else [], cfg.tasks.eval_max_new_tokens)
        return Job(PreferenceSource(rt, train_set, reference), objective, validation_eval(objective, val_set, tasks))
