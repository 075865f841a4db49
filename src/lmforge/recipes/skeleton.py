"""The one skeleton every recipe runs in: check, build the runtime, build the job, train, close."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from lmforge.data.inputs import validation_spec
from lmforge.errors import UserError
from lmforge.evaluation.downstream import with_downstream
from lmforge.evaluation.tasks import record_task_summary
from lmforge.modes.elastic import ElasticMode
from lmforge.recipes.base import Recipe, recipes
from lmforge.objectives.router import router_setup_note
from lmforge.runtime import RecipeServices, Runtime, build_runtime
from lmforge.training.loop import Job, train


def run_recipe(recipe: Recipe, cfg: Any) -> Runtime:
    """Run ``recipe`` on its validated config ``cfg``.

    Inputs are checked before the runtime touches the run directory; the step source and the metrics
    are closed however the run ends. A ``data.validation=embedded`` that means no validation set (see
    :mod:`lmforge.data.inputs`) is said once. ``eval.tasks`` (harness tasks) join every recipe's eval, and a run
    scored on held-out tasks ends with its before/after summary. ``elastic.enabled`` runs the recipe in
    the elastic mode (:mod:`lmforge.modes.elastic`).
    """
    check_recipe_layout(recipe, cfg)
    elastic = ElasticMode(cfg) if cfg.elastic.enabled else None
    inputs = recipe.check(cfg)
    services = with_router_note(recipe.services(cfg, inputs), cfg, recipe.name)
    rt = build_runtime(cfg, recipe.name, elastic.services(services) if elastic else services)
    note = validation_spec(cfg.data)[1]
    if note:
        rt.metrics.record_event("no_validation", 0, f"note: {note}")
    job: Job | None = None
    try:
        job = recipe.build(rt, cfg, inputs)
        if elastic:
            job = elastic.job(rt, job)
        state = train(rt, job.source, job.objective, with_downstream(job.evaluate, cfg))
        record_task_summary(rt, state.step)
        recipe.finish(rt, cfg, inputs, state)
        if elastic:
            elastic.finish(rt)
    finally:
        if job is not None:
            job.source.close()
        rt.metrics.close()
    return rt


def with_router_note(services: RecipeServices, cfg: Any, trainer: str) -> RecipeServices:
    """Adds the setup line's ``router_losses`` entry (MoE models only): which router terms this run
    trains with."""
    t = cfg.training

    def notes(args: Any) -> dict[str, str]:
        note = router_setup_note(trainer, t.router_aux_loss_coef, t.router_z_loss_coef, args)
        return {**services.notes_for(args), **({} if note is None else {"router_losses": note})}

    return replace(services, setup_notes=notes)


def check_recipe_layout(recipe: Recipe, cfg: Any) -> None:
    """Tensor, context, expert and pipeline parallelism only for the recipes built for them (expert
    parallelism alone also for those that keep whole sequences per rank: ``Recipe.expert_parallel``)."""
    p = cfg.parallel
    split = [f"parallel.{k}={getattr(p, k)}" for k in ("tp", "cp", "ep", "pp") if getattr(p, k) > 1]
    refused = [] if recipe.splits_model else [
        d for d in split if not (recipe.expert_parallel and d.startswith("parallel.ep="))]
    if refused:
        able = ", ".join(name for name, r in recipes().items() if r.splits_model)
        also = [name for name, r in recipes().items() if r.expert_parallel and not r.splits_model]
        runs = ("data and expert parallelism only (parallel.dp_replicate / parallel.dp_shard / parallel.ep)"
                if recipe.expert_parallel else "data parallelism only (parallel.dp_replicate / parallel.dp_shard)")
        ep = "" if recipe.expert_parallel or not also else f" ({', '.join(also)} also parallel.ep)"
        raise UserError(f"{', '.join(refused)}: `lmforge {recipe.name}` runs with {runs}; {able} take the other "
                        f"degrees{ep}")
    if split and cfg.lora.enabled:
        raise UserError(f"{', '.join(split)} with lora.enabled: adapters train with data parallelism only")
