"""Supervised fine-tuning: next-token loss on the assistant's tokens of chat (or completion) data.

Everything but the data is shared with pretraining: the same step source type, objective, metrics
line, checkpoints and resume. What differs lives here and in :mod:`lmforge.data.sft_data`: records
become loss-masked examples, packed without cross-example attention; evaluation adds held-out exact
match on the embedded tasks (``[tasks]``), measured before the first step too (``eval.at_start``), so
every run reports its before/after.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmforge.config import Config, RunSection, StartEvalSection, TasksSection
from lmforge.data.inputs import train_spec
from lmforge.data.sft_inputs import SFTSection
from lmforge.errors import UserError
from lmforge.recipes.base import Recipe, register

if TYPE_CHECKING:  # recipe modules import no torch until a run starts (lmforge --help stays fast)
    from lmforge.data.chat import ChatFormat
    from lmforge.data.image_tokens import ImageEncoding
    from lmforge.data.sft_data import SFTDataset
    from lmforge.runtime import Runtime
    from lmforge.training.loop import Job


class SFTConfig(Config):
    sft: SFTSection = SFTSection()
    tasks: TasksSection = TasksSection()
    eval: StartEvalSection = StartEvalSection()
    run: RunSection = RunSection(dir="runs/sft")


def build_datasets(cfg: SFTConfig, rt: Runtime, chat: ChatFormat | None,
                   images: ImageEncoding | None = None) -> tuple[SFTDataset, SFTDataset | None]:
    """Train and validation sets; each summary (counts of skipped/truncated examples) is logged."""
    from lmforge.data.sft_inputs import sft_datasets

    return sft_datasets(cfg, rt.model.tokenizer, chat, lambda split, summary: rt.metrics.record_event(
        "sft_data", 0, summary.line(), split=split, **summary.counts()), images)


def _task_eval(cfg: SFTConfig, rt: Runtime, chat: ChatFormat | None, images: ImageEncoding | None) -> Any:
    """The held-out exact match of the embedded tasks: greedy generation for the text tasks, the
    teacher-forced equivalent with images for the image task."""
    from lmforge.evaluation.tasks import TaskEval, held_out_examples

    if cfg.data.train != "embedded":
        return TaskEval([], cfg.tasks.eval_max_new_tokens)
    if cfg.tasks.images:
        from lmforge.data.shape_task import shape_examples
        from lmforge.evaluation.image_tasks import ImageTaskEval

        if chat is None or not cfg.tasks.eval_examples:
            return None
        return ImageTaskEval(shape_examples("test", cfg.tasks.eval_examples), rt.model.tokenizer, chat, images)
    return TaskEval(held_out_examples(cfg.tasks), cfg.tasks.eval_max_new_tokens)


@register
class SFT(Recipe):
    name = "sft"
    config = SFTConfig
    summary = "supervised fine-tuning on chats, completions or the embedded tasks"
    splits_model = True

    def check(self, cfg: SFTConfig) -> None:
        if train_spec(cfg.data).kind == "none":
            raise UserError("data.train=none: SFT needs training records (embedded, or a .jsonl/.parquet file)")

    def build(self, rt: Runtime, cfg: SFTConfig, inputs: None) -> Job:
        from lmforge.data.chat import training_chat_format
        from lmforge.data.image_tokens import image_encoding_for
        from lmforge.evaluation.loss import validation_eval
        from lmforge.objectives.next_token import NextTokenObjective
        from lmforge.recipes.jobs.next_token import LoaderSource
        from lmforge.training.loop import Job

        chat = training_chat_format(rt.model.tokenizer, rt.model.args.vocab_size, cfg.sft.chat_template)
        images = image_encoding_for(rt.model.args, rt.model.tokenizer, cfg.sft.max_image_pixels)
        layout = rt.world.layout
        if images is not None and (layout.cp > 1 or layout.pp > 1):
            raise UserError("a vision-language model trains with data, FSDP or tensor parallelism: context and "
                            "pipeline parallelism do not carry images yet (parallel.cp = parallel.pp = 1)")
        train_set, val_set = build_datasets(cfg, rt, chat, images)
        objective = NextTokenObjective.for_run(cfg.training, rt.model.args)
        tasks = _task_eval(cfg, rt, chat, images)
        return Job(LoaderSource(rt, train_set), objective, validation_eval(objective, val_set, tasks))
