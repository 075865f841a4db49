"""The one skeleton every recipe runs in: check, build the runtime, build the job, train, close."""

from __future__ import annotations

from typing import Any

from lmforge.data.inputs import validation_spec
from lmforge.evaluation.downstream import with_downstream
from lmforge.evaluation.tasks import record_task_summary
from lmforge.recipes.base import Recipe
from lmforge.training.loop import Job, train
from lmforge.training.runtime import Runtime, build_runtime


def run_recipe(recipe: Recipe, cfg: Any) -> Runtime:
    """Run ``recipe`` on its validated config ``cfg``.

    Inputs are checked before the runtime touches the run directory; the step source and the metrics
    are closed however the run ends. A ``data.validation=embedded`` that means no validation set (see
    :mod:`lmforge.data.inputs`) is said once. ``eval.tasks`` (harness tasks) join every recipe's eval, and a run
    scored on held-out tasks ends with its before/after summary.
    """
    inputs = recipe.check(cfg)
    rt = build_runtime(cfg, recipe.name, recipe.services(cfg, inputs))
    note = validation_spec(cfg.data)[1]
    if note:
        rt.metrics.record_event("no_validation", 0, f"note: {note}")
    job: Job | None = None
    try:
        job = recipe.build(rt, cfg, inputs)
        state = train(rt, job.source, job.objective, with_downstream(job.evaluate, cfg))
        record_task_summary(rt, state.step)
        recipe.finish(rt, cfg, inputs, state)
    finally:
        if job is not None:
            job.source.close()
        rt.metrics.close()
    return rt
