"""Eval loss: weighted over all eval batches and ranks, from zero at every eval; and the eval function
every recipe with a validation set uses (its objective's logged values, plus held-out task scores)."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from lmforge.data.loader import eval_batches
from lmforge.data.packing import Batch, SampleDataset
from lmforge.errors import UserError
from lmforge.runtime import Runtime
from lmforge.losses.stats import LossStats, accumulate
from lmforge.training.train_step import LossFn, compute_global_loss, is_pipeline


def validation_batches(rt: Runtime, dataset: SampleDataset) -> Iterable[Batch]:
    """This rank's share of ``eval.steps`` batches of ``eval.batch_size`` rows; a validation set smaller
    than one batch still gives one (smaller) batch, at least one row per rank."""
    W = rt.world.dist.batch_shares
    size = max(min(rt.cfg.eval.batch_size, len(dataset)) // W * W, W)
    return eval_batches(dataset, size, rt.cfg.eval.steps, rt.world.dist.batch_share, W)


def evaluate_loss(rt: Runtime, batches: Iterable[Batch], loss_fn: LossFn) -> dict[str, torch.Tensor]:
    """``Σ loss_sum / Σ loss_weight`` over ``batches`` on every rank, with every summed statistic; the
    sums start from zero every call, so the same eval set always reports the same ``total_weights``."""
    model = rt.model.module
    was_training = model.training
    model.eval()
    totals: LossStats | None = None
    if is_pipeline(model):  # the stages run the batches as one forward-only schedule
        from lmforge.parallel.pipeline_step import pipeline_eval_forward

        totals = pipeline_eval_forward(model, [rt.world.shard_batch(b.to(rt.world.dist.device)) for b in batches],  # type: ignore[arg-type]
                                       loss_fn, rt.model.autocast())
    with torch.no_grad(), rt.model.autocast():
        for batch in batches if totals is None else ():
            _, stats = loss_fn(model, rt.world.shard_batch(batch.to(rt.world.dist.device)))
            totals = accumulate(totals, stats)
    model.train(was_training)
    if totals is None:
        raise UserError("eval produced no batches: the validation set is smaller than one eval batch")
    return compute_global_loss(totals, rt.world.dist.reduce)


def validation_eval(objective: Any, val_set: SampleDataset | None, tasks: Any = None,
                    batches: Callable[[Runtime, SampleDataset], Iterable[Batch]] = validation_batches) -> Any:
    """``evaluate(rt, step)``: the objective's logged values on ``val_set`` (eval loss and the rest),
    plus ``tasks(rt, step)`` (held-out exact match) when given; None when there is nothing to score."""
    if val_set is None and not tasks:
        return None

    def evaluate(rt: Runtime, step: int) -> dict:
        values: dict = {}
        if val_set is not None:
            values |= objective.log_values(evaluate_loss(rt, batches(rt, val_set), objective.loss_fn))
        return values | (tasks(rt, step) if tasks else {})

    return evaluate
