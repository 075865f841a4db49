"""Harness tasks scored inside training (``eval.tasks``), as part of the run's regular eval.

The scores come back from the trainer's eval function as ``eval/<task>/<metric>`` values, so the
shared loop times them as eval (goodput) and the MetricLogger writes them to the console, the JSONL
file and TensorBoard like any other eval value. ``lm-eval`` is imported only when tasks are asked for.
"""

from __future__ import annotations

from typing import Any, Sequence

from lmforge.errors import UserError


def with_downstream(evaluate: Any, cfg: Any) -> Any:
    """``evaluate(rt, step)`` plus the ``eval.tasks`` on their schedule (checked now, at start-up)."""
    if not cfg.eval.tasks:
        return evaluate
    downstream = DownstreamEval.from_config(cfg)

    def evaluate_with_tasks(rt: Any, step: int) -> dict:
        values = dict(evaluate(rt, step)) if evaluate else {}
        return values | downstream(rt, step)

    return evaluate_with_tasks


class DownstreamEval:
    """Harness tasks scored inside training (``eval.tasks``): at the evals of steps that are multiples of
    ``eval.tasks_interval`` (every eval if 0) and at the last step; values come back as
    ``eval/<task>/<metric>``, which the run's metric logger writes to the console, JSONL and TensorBoard."""

    def __init__(self, tasks: Sequence[str], interval: int, limit: int | None, total_steps: int,
                 batch_size: int = 16) -> None:
        self.tasks = list(tasks)
        self.interval = interval
        self.limit = limit or None
        self.total_steps = total_steps
        self.batch_size = batch_size

    @classmethod
    def from_config(cls, cfg: Any) -> "DownstreamEval":
        """From ``cfg.eval``; a schedule that would never score the tasks is refused at start-up."""
        e = cfg.eval
        if e.tasks:
            from lmforge.evaluation.harness import _task_manager, require_lm_eval

            require_lm_eval()
            if not e.interval:
                raise UserError("eval.tasks needs evals: set eval.interval > 0")
            if e.tasks_interval % e.interval:
                raise UserError(f"eval.tasks_interval={e.tasks_interval} must be a multiple of "
                                f"eval.interval={e.interval} (the tasks are scored at evals)")
            _task_manager(e.tasks, None)  # unknown task names fail now, not after training
        return cls(e.tasks, e.tasks_interval, e.tasks_limit, cfg.training.steps, e.batch_size)

    def __bool__(self) -> bool:
        return bool(self.tasks)

    def due(self, step: int) -> bool:
        return bool(self.tasks) and (not self.interval or step % self.interval == 0 or step >= self.total_steps)

    def __call__(self, rt: Any, step: int) -> dict[str, float]:
        if not self.due(step) or rt.world.layout.shards:
            return {}  # generation needs the whole model; FSDP shards it
        # Every rank scores the same examples (identical results), so no collective is needed.
        from lmforge.evaluation.harness import evaluate_tasks, flat_scores

        model = rt.model.raw
        was_training = model.training
        try:
            results = evaluate_tasks(model.eval(), rt.model.tokenizer, self.tasks, limit=self.limit,
                                     batch_size=self.batch_size, bootstrap_iters=0, quiet=True)
        finally:
            model.train(was_training)
        return {f"eval/{k}": v for k, v in flat_scores(results).items()}
