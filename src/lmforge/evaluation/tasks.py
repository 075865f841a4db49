"""Held-out exact match on tasks with known answers: greedy decoding, overall and per task.

One evaluator for SFT and GRPO (``[tasks]`` config section): it runs with every eval, at the start
too when ``eval.at_start`` is on; :func:`record_task_summary` states the run's "before -> after".
"""

from __future__ import annotations

from typing import Sequence

from lmforge.config import TasksSection
from lmforge.data.tasks import TaskExample, is_correct, task_examples, task_share
from lmforge.inference import sample_texts
from lmforge.metrics.records import read_records
from lmforge.models.model import Transformer
from lmforge.models.tokenizer import Tokenizer
from lmforge.training.runtime import Runtime


def task_accuracy(model: Transformer, tokenizer: Tokenizer, examples: Sequence[TaskExample], *,
                  max_new_tokens: int = 32, batch_size: int = 32) -> dict[str, float]:
    """Greedy exact-match accuracy overall (``"all"``) and per task, from one generation pass."""
    if not examples:
        return {"all": 0.0}
    completions = sample_texts(model, tokenizer, [e.prompt for e in examples], max_new_tokens=max_new_tokens,
                               temperature=0.0, chat=True, batch_size=batch_size)
    hits: dict[str, list[bool]] = {"all": []}
    for c, e in zip(completions, examples):
        ok = is_correct(c, e.answer)
        hits["all"].append(ok)
        hits.setdefault(e.task, []).append(ok)
    return {k: sum(v) / len(v) for k, v in hits.items()}


def held_out_examples(tasks: TasksSection) -> list[TaskExample]:
    """The held-out embedded task examples a run is scored on: ``tasks.eval_examples`` of them, at most
    the selected tasks' share of the test split, so SFT and GRPO on the same tasks score the same set."""
    n = min(tasks.eval_examples, task_share("test", tasks.names))
    return task_examples("test", n, tasks.names) if n else []


class TaskEval:
    """``evaluate(rt, step) -> {"exact_match": ..., "exact_match_<task>": ...}`` on fixed held-out examples."""

    def __init__(self, examples: Sequence[TaskExample], max_new_tokens: int, batch_size: int = 32) -> None:
        self.examples = list(examples)
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size

    def __bool__(self) -> bool:
        return bool(self.examples)

    def __call__(self, rt: Runtime, step: int = 0) -> dict[str, float]:
        if not self.examples or (rt.cfg.parallel.mode == "fsdp" and rt.dist.world_size > 1):
            return {}  # generation needs the whole model; FSDP shards it
        # Every rank scores the same examples (identical results), so no collective is needed.
        acc = task_accuracy(rt.raw_model, rt.tokenizer, self.examples, max_new_tokens=self.max_new_tokens,
                            batch_size=self.batch_size)
        return {"exact_match": acc.pop("all")} | {f"exact_match_{task}": v for task, v in acc.items()}


def record_task_summary(rt: Runtime, step: int) -> None:
    """One ``task_accuracy`` event: exact match of the starting model (the step-0 eval) and the last one,
    read from the run's metrics, so a resumed run still reports its real "before"."""
    if not rt.dist.is_main:
        return
    scores = {r["step"]: r["exact_match"] for r in read_records(rt.run_dir, "eval") if "exact_match" in r}
    if 0 not in scores or step == 0 or len(scores) < 2:
        return
    before, after = scores[0], scores[max(scores)]
    rt.metrics.record_event("task_accuracy", step, f"held-out exact match (greedy): {before:.3f} before "
                            f"-> {after:.3f} after {step} steps", before=before, after=after)
