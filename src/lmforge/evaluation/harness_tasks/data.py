"""Data and scoring of the shipped harness tasks, built from lmforge's embedded tasks.

The examples are the held-out test split that lmforge's own exact-match eval scores
(:func:`lmforge.evaluation.tasks.held_out_examples` with its default size), generated at load time from
:mod:`lmforge.data.tasks`, so nothing is downloaded and the harness scores the very same problems.
The YAML files next to this module refer to these functions with ``!function data.NAME``.
"""

from __future__ import annotations

from typing import Any

from lmforge.config import TasksSection
from lmforge.data.tasks import TASK_NAMES, TaskExample, is_correct, task_examples

CHOICES = 4


def held_out(task: str) -> list[TaskExample]:
    """The held-out examples of one task, in lmforge's order."""
    return [e for e in task_examples("test", TasksSection().eval_examples) if e.task == task]


def _dataset(rows: list[dict[str, Any]]) -> Any:
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def load_split(task: str, **_: Any) -> Any:
    """``{"test": Dataset}`` of one generation task: ``task``, ``prompt``, ``answer`` per row."""
    return _dataset([{"task": e.task, "prompt": e.prompt, "answer": e.answer} for e in held_out(task)])


def choice_rows(task: str) -> list[dict[str, Any]]:
    """Each problem with its answer among the answers of the next problems of the same task (the
    distractors are plausible answers of the same shape); the right answer's place cycles 0..3."""
    examples = held_out(task)
    rows = []
    for i, e in enumerate(examples):
        others: list[str] = []
        for k in range(1, len(examples)):
            a = examples[(i + k) % len(examples)].answer
            if a != e.answer and a not in others:
                others.append(a)
            if len(others) == CHOICES - 1:
                break
        label = i % CHOICES
        choices = others[:label] + [e.answer] + others[label:]
        rows.append({"task": e.task, "prompt": e.prompt, "choices": choices, "label": label})
    return rows


def load_choice_split(**_: Any) -> Any:
    """``{"test": Dataset}`` of the multiple-choice variant, every task interleaved."""
    per_task = [choice_rows(t) for t in TASK_NAMES]
    return _dataset([row for rows in zip(*per_task) for row in rows])


def exact_match_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """lmforge's exact match: the first non-empty line of the answer, stripped, equals the answer."""
    return {"exact_match": float(is_correct(results[0], doc["answer"]))}
