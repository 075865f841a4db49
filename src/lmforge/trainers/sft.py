"""Supervised fine-tuning: next-token loss on the assistant's tokens of chat (or completion) data.

Everything but the data is the shared training loop: the same step source type, objective, metrics
line, checkpoints and resume as pretraining. What differs lives here and in
:mod:`lmforge.data.sft_data`: records become loss-masked examples, packed without cross-example
attention; evaluation adds held-out exact match on the embedded tasks (``[tasks]``), measured before
the first step too (``eval.at_start``), so every run reports its before/after.
"""

from __future__ import annotations

import functools
from typing import Literal


from lmforge.config import Config, StartEvalSection, RunSection, Section, TasksSection
from lmforge.data.chat import ChatFormat, chat_format_for
from lmforge.data.sft_data import Record, SFTDataset, build_sft_dataset, read_sft_records, task_records
from lmforge.data.tasks import task_examples
from lmforge.errors import UserError
from lmforge.evaluation.downstream import with_downstream
from lmforge.evaluation.loss import evaluate_loss, validation_batches
from lmforge.evaluation.tasks import TaskEval, held_out_examples, record_task_summary
from lmforge.training.loop import EvalFn, train
from lmforge.training.next_token import LoaderSource, NextTokenObjective
from lmforge.training.runtime import Runtime, build_runtime
from lmforge.training.train_step import cross_entropy_loss


class SFTSection(Section):
    loss_on: Literal["assistant", "all"] = "assistant"
    """``assistant``: loss on assistant turns / completions only; ``all``: on every token."""
    packing: bool = True
    """Pack several examples per sequence (isolated by document masks); false: one padded example each."""
    too_long: Literal["skip", "truncate"] = "skip"
    """Examples longer than ``data.seq_len + 1`` tokens are skipped, or cut to fit."""
    chat_template: str | None = None
    """A jinja file to use instead of the tokenizer's own chat template."""


class SFTConfig(Config):
    sft: SFTSection = SFTSection()
    tasks: TasksSection = TasksSection()
    eval: StartEvalSection = StartEvalSection()
    run: RunSection = RunSection(dir="runs/sft")


def _records(spec: str, split: str, cfg: SFTConfig) -> tuple[list[Record], str]:
    if spec == "embedded":
        n = (cfg.tasks.train_examples or None) if split == "train" else None
        return task_records(task_examples(split, n, cfg.tasks.names), split), f"embedded tasks ({split})"
    return read_sft_records(spec, cfg.data.format), spec


def build_datasets(cfg: SFTConfig, rt: Runtime, chat: ChatFormat | None) -> tuple[SFTDataset, SFTDataset | None]:
    """Train and validation sets; each summary (counts of skipped/truncated examples) is logged."""
    d, s = cfg.data, cfg.sft
    sets: list[SFTDataset | None] = []
    for spec, split in ((d.train, "train"), (d.validation, "test")):
        if split == "test" and (not spec or spec == "none" or (spec == "embedded" and d.train != "embedded")):
            sets.append(None)  # the embedded test split only fits the embedded training data
            continue
        records, source = _records(spec, split, cfg)
        dataset, summary = build_sft_dataset(records, source, rt.tokenizer, chat, seq_len=d.seq_len,
                                             loss_on=s.loss_on, too_long=s.too_long, packing=s.packing)
        rt.metrics.record_event("sft_data", 0, summary.line(), split=split, **summary.counts())
        sets.append(dataset)
    return sets[0], sets[1]  # type: ignore[return-value]


def chat_format(rt: Runtime, template_file: str | None) -> ChatFormat | None:
    """The chat format (``template_file`` or the tokenizer's own), or None when the tokenizer has none
    (only conversational records need one). Shared by SFT and DPO."""
    try:
        chat: ChatFormat | None = chat_format_for(rt.tokenizer, template_file)
    except UserError:
        if template_file:
            raise
        return None
    # The template's special tokens must exist in the model. Checked on the tokenizer's control tokens,
    # not by rendering a sample chat: a template may rightly refuse any given sample (e.g. one that
    # requires a system message), and the data's own chats are rendered and checked line by line.
    bad = sorted((i, t) for t, i in rt.tokenizer.control_tokens.items() if i >= rt.model_args.vocab_size)
    if bad:
        raise UserError(f"chat token {bad[0][1]!r} (id {bad[0][0]}) is outside the model's vocabulary "
                        f"({rt.model_args.vocab_size}): model.tokenizer does not match the model")
    return chat


def make_eval(cfg: SFTConfig, val_set: SFTDataset | None, tasks: TaskEval) -> EvalFn | None:
    """Eval loss on the validation set, plus held-out exact match when training on the embedded tasks."""
    if val_set is None and not tasks:
        return None

    def evaluate(rt: Runtime, step: int) -> dict:
        values: dict = {}
        if val_set is not None:
            batches = validation_batches(rt, val_set)
            values.update(evaluate_loss(rt, batches, functools.partial(
                cross_entropy_loss, chunk_tokens=cfg.training.loss_chunk_tokens)))
        return values | tasks(rt, step)

    return evaluate


def run(cfg: SFTConfig) -> Runtime:
    rt = build_runtime(cfg, "sft")
    source = None
    try:
        train_set, val_set = build_datasets(cfg, rt, chat_format(rt, cfg.sft.chat_template))
        source = LoaderSource(rt, train_set)
        tasks = TaskEval(held_out_examples(cfg.tasks) if cfg.data.train == "embedded" else [],
                         cfg.tasks.eval_max_new_tokens)
        evaluate = with_downstream(make_eval(cfg, val_set, tasks), cfg)
        state = train(rt, source, NextTokenObjective(cfg.training.loss_chunk_tokens), evaluate)
        record_task_summary(rt, state.step)
    finally:
        if source is not None:
            source.close()
        rt.metrics.close()
    return rt
