"""Eval loss: token-weighted over all eval batches and ranks, from zero at every eval."""

from __future__ import annotations

from typing import Iterable

import torch

from lmforge.data.loader import eval_batches
from lmforge.data.packing import Batch, SampleDataset
from lmforge.errors import UserError
from lmforge.training.runtime import Runtime
from lmforge.training.train_step import LossFn, compute_global_loss


def validation_batches(rt: Runtime, dataset: SampleDataset) -> Iterable[Batch]:
    """This rank's share of ``eval.steps`` batches of ``eval.batch_size`` rows; a validation set smaller
    than one batch still gives one (smaller) batch, at least one row per rank."""
    W = rt.dist.world_size
    size = max(min(rt.cfg.eval.batch_size, len(dataset)) // W * W, W)
    return eval_batches(dataset, size, rt.cfg.eval.steps, rt.dist.rank, W)


def evaluate_loss(rt: Runtime, batches: Iterable[Batch], loss_fn: LossFn) -> dict[str, torch.Tensor]:
    """``Σ loss / Σ total_weights`` over ``batches`` on every rank; the sums start from zero every call,
    so the same eval set always reports the same ``total_weights``."""
    model = rt.model
    was_training = model.training
    model.eval()
    totals: dict[str, torch.Tensor] = {}
    with torch.no_grad(), rt.autocast():
        for batch in batches:
            _, stats = loss_fn(model, batch.to(rt.dist.device))
            for k, v in stats.items():
                totals[k] = totals[k] + v if k in totals else v.detach().clone()
    model.train(was_training)
    if not totals:
        raise UserError("eval produced no batches: the validation set is smaller than one eval batch")
    return compute_global_loss(totals)
