"""Supervised fine-tuning: next-token loss on the assistant's tokens of chat (or completion) data.

Everything but the data is the shared training loop: the same train step, loss normalization,
metrics line, checkpoints and resume as pretraining. What differs lives here and in
:mod:`lmforge.data.sft_data`: records become loss-masked examples, packed without cross-example
attention; evaluation adds held-out exact-match accuracy on the embedded tasks (greedy decoding), also
measured once before the first step so every run reports its before/after.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from lmforge.training.checkpoint import STATE_FILE, Checkpointer
from lmforge.config import Config, RunSection, Section
from lmforge.data.chat import ChatFormat, chat_format_for
from lmforge.data.loader import eval_batches
from lmforge.data.sft_data import SFTDataset, build_sft_dataset, read_sft_records, task_records
from lmforge.data.tasks import TASK_NAMES, task_examples
from lmforge.errors import UserError
from lmforge.training.loop import do_eval, evaluate_loss, train
from lmforge.training.runtime import Runtime, build_runtime
from lmforge.training.train_step import Progress, cross_entropy_loss
from lmforge.trainers.pretrain import make_loader


class SFTSection(Section):
    loss_on: Literal["assistant", "all"] = "assistant"
    """``assistant``: loss on assistant turns / completions only; ``all``: on every token."""
    packing: bool = True
    """Pack several examples per sequence (isolated by document masks); false: one padded example each."""
    too_long: Literal["skip", "truncate"] = "skip"
    """Examples longer than ``data.seq_len + 1`` tokens are skipped, or cut to fit."""
    chat_template: str | None = None
    """A jinja file to use instead of the tokenizer's own chat template."""
    tasks: list[str] = list(TASK_NAMES)
    """Embedded tasks to train and evaluate on (when ``data.train`` is ``embedded``)."""
    train_examples: int = Field(0, ge=0)
    """Embedded training examples to use (0: the whole train split)."""
    eval_examples: int = Field(300, ge=0)
    """Held-out embedded task examples scored by greedy exact match at each eval (0: off)."""
    eval_max_new_tokens: int = Field(24, gt=0)

    @field_validator("tasks")
    @classmethod
    def _known_tasks(cls, v: list[str]) -> list[str]:
        unknown = [t for t in v if t not in TASK_NAMES]
        if unknown or not v:
            raise ValueError(f"unknown task(s) {unknown or '(none)'}; known: {', '.join(TASK_NAMES)}")
        return v


class SFTConfig(Config):
    sft: SFTSection = SFTSection()
    run: RunSection = RunSection(dir="runs/sft")


def _records(spec: str, split: str, cfg: SFTConfig):
    if spec == "embedded":
        n = (cfg.sft.train_examples or None) if split == "train" else None
        return task_records(task_examples(split, n, cfg.sft.tasks), split), f"embedded tasks ({split})"
    return read_sft_records(spec), spec


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


def _check_chat_tokens(rt: Runtime, chat: ChatFormat) -> None:
    """Refuse a tokenizer whose chat tokens fall outside the model's vocabulary (a mismatch)."""
    ids = chat.prompt_ids([{"role": "user", "content": "x"}])
    bad = [i for i in ids if i >= rt.model_args.vocab_size]
    if bad:
        raise UserError(f"chat template token id {bad[0]} is outside the model's vocabulary "
                        f"({rt.model_args.vocab_size}): model.tokenizer does not match the model")


def make_eval(cfg: SFTConfig, val_set: SFTDataset | None, history: dict[str, float]):
    tasks = (task_examples("test", min(cfg.sft.eval_examples, 600), cfg.sft.tasks)
             if cfg.data.train == "embedded" and cfg.sft.eval_examples else [])

    def run_eval(rt: Runtime) -> dict[str, float]:
        values: dict = {}
        if val_set is not None:
            W = rt.dist.world_size  # a small validation set still gives one (smaller) batch
            size = max(min(cfg.eval.batch_size, len(val_set)) // W * W, W)
            batches = eval_batches(val_set, size, cfg.eval.steps, rt.dist.rank, W)
            values.update(evaluate_loss(rt, batches, cross_entropy_loss))
        if tasks and not (cfg.parallel.mode == "fsdp" and rt.dist.world_size > 1):
            from lmforge.inference import task_accuracy

            # Every rank scores the same examples (identical results), so no collective is needed.
            acc = task_accuracy(rt.raw_model, rt.tokenizer, tasks, max_new_tokens=cfg.sft.eval_max_new_tokens)
            values["exact_match"] = acc.pop("all")
            values.update({f"exact_match_{k}": v for k, v in acc.items()})
            history["after"] = values["exact_match"]
        return values

    return run_eval if (val_set is not None or tasks) else None


def run(cfg: SFTConfig, trainer: str = "sft") -> Runtime:
    m = cfg.model
    if m.from_checkpoint and not m.from_hf:
        p = Path(m.from_checkpoint)
        if not (p / STATE_FILE).is_file() and Checkpointer(p).latest() is None:
            raise UserError(f"model.from_checkpoint={p}: no checkpoint there; train the starting model first "
                            f"(e.g. lmforge pretrain --config configs/debug.toml --run.dir={p})")
    rt = build_runtime(cfg, trainer)
    loader = None
    try:
        try:
            chat: ChatFormat | None = chat_format_for(rt.tokenizer, cfg.sft.chat_template)
        except UserError:  # only conversational records need one; they say so if they meet None
            if cfg.sft.chat_template:
                raise
            chat = None
        if chat is not None:
            _check_chat_tokens(rt, chat)
        train_set, val_set = build_datasets(cfg, rt, chat)
        loader = make_loader(rt, train_set)
        history: dict[str, float] = {}
        run_eval = make_eval(cfg, val_set, history)
        if run_eval and cfg.eval.interval and rt.checkpointer.latest() is None:
            do_eval(rt, Progress(), run_eval)  # the starting model's scores (step 0)
            if "after" in history:
                history["before"] = history["after"]
        progress = train(rt, loader, cross_entropy_loss, run_eval)
        if "before" in history and progress.step > 0:
            rt.metrics.record_event(
                "task_accuracy", progress.step, f"held-out exact match (greedy): {history['before']:.3f} before "
                f"-> {history['after']:.3f} after {progress.step} steps", **history)
    finally:
        if loader is not None:
            loader.close()
        rt.metrics.close()
    return rt
