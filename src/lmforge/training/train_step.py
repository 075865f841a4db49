"""The modular train step: four named pieces that every trainer calls.

* :func:`gradient_computation` — forward/backward over one step's microbatches.
* :func:`run_optimizer_step` — clip, learning rate, AdamW step, zero grads.
* :func:`compute_global_loss` — the loss and every summed statistic across ranks.
* :func:`should_continue_training` — step, token, time, target-loss budgets and stop requests.

Loss normalization: a loss function returns the *sum* of its per-token (or per-sequence) terms.
:func:`gradient_computation` divides by one global normalizer (e.g. the number of target tokens over
all microbatches and all data-parallel ranks), so N microbatches on K ranks produce the same gradient
as one big batch on one rank. DDP and FSDP average gradients over ranks, so each rank multiplies its
objective by the size of the gradient group (the ranks holding different tokens: data and context
shards, not tensor or pipeline neighbours, see lmforge.parallel.dims) to turn that average back into
the global sum.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lmforge import distributed as dist_utils
from lmforge.distributed import EVERY_RANK, ReduceGroup
from lmforge.data.packing import Batch
from lmforge.parallel.pipeline import Pipeline
from lmforge.losses.stats import LossStats, accumulate

if TYPE_CHECKING:  # pragma: no cover
    from lmforge.training.state import TrainState

LossFn = Callable[[nn.Module, Any], "tuple[torch.Tensor, LossStats]"]
"""(model, microbatch) -> (objective summed over its terms, summed statistics as device tensors)."""


def gradient_computation(
    model: nn.Module,
    microbatches: list[Any],
    loss_fn: LossFn,
    normalizer: torch.Tensor,
    autocast: torch.autocast | None = None,
    reduce: ReduceGroup = EVERY_RANK,
) -> LossStats:
    """Accumulate gradients of ``sum(objective) / normalizer`` over this rank's microbatches.

    ``normalizer`` must already be global over ``reduce``, the run's ``world.dist.reduce`` (see
    :func:`global_target_count`), and the objective is scaled by its size. Gradient sync between
    ranks happens once, on the last microbatch: the backward pass runs inside the no-sync block
    too, because that is when DDP and FSDP2 read the flag (the reduction is launched by backward
    hooks). Returns the summed statistics (device tensors).

    Under pipeline parallelism (``model`` a :class:`~lmforge.parallel.pipeline.Pipeline`) the
    microbatches are the pipeline's: the schedule runs their forwards and backwards interleaved over
    the stages, with the same objective, normalizer and scale.
    """
    if is_pipeline(model):
        from lmforge.parallel.pipeline_step import pipeline_gradient_computation

        return pipeline_gradient_computation(model, microbatches, loss_fn, normalizer, autocast,  # type: ignore[arg-type]
                                             reduce.size)
    scale = reduce.size / normalizer.clamp(min=1)
    totals: LossStats | None = None
    for i, mb in enumerate(microbatches):
        last = i == len(microbatches) - 1
        with dist_utils.no_grad_sync(model, enabled=not last):
            with autocast or nullcontext():
                objective, stats = loss_fn(model, mb)
            (objective * scale).backward()
        totals = accumulate(totals, stats)
    assert totals is not None, "a step has at least one microbatch"
    return totals


def is_pipeline(model: nn.Module) -> bool:
    """``model`` is this rank's stages of a pipeline (``parallel.pp`` > 1)."""
    return isinstance(model, Pipeline)


def global_target_count(microbatches: list[Batch], reduce: ReduceGroup = EVERY_RANK) -> torch.Tensor:
    """Target tokens of this step summed over microbatches and the ranks of ``reduce``."""
    local = torch.stack([mb.num_targets for mb in microbatches]).sum().float()
    return reduce.sum(local)


def run_optimizer_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, lr: float, max_grad_norm: float,
    skip_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip to ``max_grad_norm`` (0: only measure), set ``lr``, step the optimizer, zero grads.

    Each param group's lr is ``lr`` times the group's ``lr_scale`` where it has one (Muon's share in
    ``optimizer.name=muon``, see training.optimizers), so one schedule drives every group.

    Returns the pre-clip global grad norm as a device tensor (no host sync), unless
    ``skip_nonfinite``: then the norm is read on the host, and a non-finite one drops the update
    (gradients zeroed, no optimizer step); the caller sees the non-finite norm it returns.
    """
    if is_pipeline(model):  # the norm over every stage of the pipeline
        from lmforge.parallel.pipeline_step import pipeline_clip_grad_norm_

        norm = pipeline_clip_grad_norm_(model, max_grad_norm)  # type: ignore[arg-type]
    elif _on_several_meshes(params := [p for p in model.parameters() if p.grad is not None]):
        from lmforge.parallel.expert_parallel import clip_grad_norm  # experts and the rest on two meshes

        norm = clip_grad_norm(model.parameters(), max_grad_norm if max_grad_norm > 0 else float("inf"))
    else:
        norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):  # FSDP2 and tensor parallelism return a DTensor
            norm = norm.full_tensor()
    if skip_nonfinite and not math.isfinite(float(norm)):
        optimizer.zero_grad(set_to_none=True)
        return norm
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_scale"] if "lr_scale" in group else lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def _on_several_meshes(params: list[torch.Tensor]) -> bool:
    """Whether the gradients live on more than one device mesh (expert parallelism). One pass over the
    parameters per step, shared with the clip, and none at all for plain tensors (the common case)."""
    meshes = {g.device_mesh for p in params if isinstance(g := p.grad, DTensor)}
    return len(meshes) > 1 or (len(meshes) == 1 and any(not isinstance(p.grad, DTensor) for p in params))


def compute_global_loss(stats: LossStats, reduce: ReduceGroup = EVERY_RANK) -> dict[str, torch.Tensor]:
    """The loss over the ranks of ``reduce``, ``Σ loss_sum / Σ loss_weight``, with ``total_weights`` (the
    target tokens), ``loss_weight`` and every other summed statistic summed over them (one all-reduce)."""
    return stats.global_totals(reduce)


class Budgets(Protocol):
    steps: int
    max_tokens: int
    max_seconds: float
    target_eval_loss: float


def should_continue_training(progress: "TrainState", budgets: Budgets) -> tuple[bool, str]:
    """Decide whether to run another step; the reason is logged when it says stop.

    All inputs are host values, so calling this every step costs no device sync.
    """
    if progress.stop_requested:
        return False, f"stop requested ({progress.stop_requested})"
    if progress.step >= budgets.steps:
        return False, f"reached training.steps={budgets.steps}"
    if budgets.max_tokens and progress.tokens_seen >= budgets.max_tokens:
        return False, f"reached training.max_tokens={budgets.max_tokens} ({progress.tokens_seen} tokens)"
    if budgets.max_seconds and progress.training_seconds >= budgets.max_seconds:
        return False, f"reached training.max_seconds={budgets.max_seconds:g}"
    if budgets.target_eval_loss and progress.last_eval_loss is not None:
        if progress.last_eval_loss <= budgets.target_eval_loss:
            return False, (f"eval loss {progress.last_eval_loss:.4f} reached "
                           f"training.target_eval_loss={budgets.target_eval_loss:g}")
    return True, ""
