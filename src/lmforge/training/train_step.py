"""The modular train step: four named pieces that every trainer calls.

* :func:`gradient_computation` — forward/backward over one step's microbatches.
* :func:`run_optimizer_step` — clip, learning rate, AdamW step, zero grads.
* :func:`compute_global_loss` — token-weighted loss and ``total_weights`` across ranks.
* :func:`should_continue_training` — step, token, time, target-loss budgets and stop requests.

Loss normalization: a loss function returns the *sum* of its per-token (or per-sequence) terms.
:func:`gradient_computation` divides by one global normalizer (e.g. the number of target tokens over
all microbatches and all data-parallel ranks), so N microbatches on K ranks produce the same gradient
as one big batch on one rank. DDP and FSDP average gradients over ranks, so each rank multiplies its
objective by the world size to turn that average back into the global sum.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import TYPE_CHECKING, Callable, Protocol

import torch
from torch import nn

from lmforge import distributed as dist_utils
from lmforge.data.packing import IGNORE_INDEX, Batch
from lmforge.training.chunked_loss import DEFAULT_CHUNK_TOKENS, TargetLogprobSumHead

if TYPE_CHECKING:  # pragma: no cover
    from lmforge.training.state import TrainState

LossFn = Callable[[nn.Module, Batch], "tuple[torch.Tensor, dict[str, torch.Tensor]]"]
"""(model, microbatch) -> (objective summed over its terms, summed statistics as device tensors)."""


def cross_entropy_loss(model: nn.Module, batch: Batch,
                       chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Summed next-token cross-entropy over target tokens (labels != IGNORE_INDEX).

    Statistics: ``loss_sum``, ``total_weights`` (target tokens) and ``correct`` (argmax hits), all
    sums, so they add up exactly across microbatches and ranks.

    Logits exist only at target positions and only ``chunk_tokens`` rows at a time (fp32), in
    forward and backward (see :mod:`lmforge.training.chunked_loss`); the values equal the full
    ``F.cross_entropy`` over fp32 logits. Bind ``chunk_tokens`` with ``functools.partial``.
    """
    mask = batch.labels != IGNORE_INDEX
    head = TargetLogprobSumHead(batch.labels, mask, chunk_tokens=chunk_tokens)
    logprob_sum, hits = model(batch.input_ids, position_ids=batch.position_ids, document_ids=batch.document_ids,
                              head=head)
    loss_sum = -logprob_sum
    return loss_sum, {"loss_sum": loss_sum.detach(), "total_weights": mask.sum(), "correct": hits.sum()}


def gradient_computation(
    model: nn.Module,
    microbatches: list[Batch],
    loss_fn: LossFn,
    normalizer: torch.Tensor,
    autocast: torch.autocast | None = None,
) -> dict[str, torch.Tensor]:
    """Accumulate gradients of ``sum(objective) / normalizer`` over this rank's microbatches.

    ``normalizer`` must already be global (see :func:`global_target_count`). Gradient sync between
    ranks happens once, on the last microbatch: the backward pass runs inside the no-sync block
    too, because that is when DDP and FSDP2 read the flag (the reduction is launched by backward
    hooks). Returns the summed statistics (device tensors).
    """
    scale = dist_utils.world_size() / normalizer.clamp(min=1)
    totals: dict[str, torch.Tensor] = {}
    for i, mb in enumerate(microbatches):
        last = i == len(microbatches) - 1
        with dist_utils.no_grad_sync(model, enabled=not last):
            with autocast or nullcontext():
                objective, stats = loss_fn(model, mb)
            (objective * scale).backward()
        for k, v in stats.items():
            totals[k] = totals[k] + v if k in totals else v.detach().clone()
    return totals


def global_target_count(microbatches: list[Batch]) -> torch.Tensor:
    """Target tokens of this step summed over microbatches and all data-parallel ranks."""
    local = torch.stack([mb.num_targets for mb in microbatches]).sum().float()
    return dist_utils.all_reduce_sum(local)


def run_optimizer_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, lr: float, max_grad_norm: float
) -> torch.Tensor:
    """Clip to ``max_grad_norm`` (0: only measure), set ``lr``, step AdamW, zero grads.

    Returns the pre-clip global grad norm as a device tensor (no host sync).
    """
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):  # FSDP2 returns a DTensor
        norm = norm.full_tensor()
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def compute_global_loss(stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Token-weighted loss over all ranks: sum(loss_sum) / sum(total_weights), plus the weights.

    Every other statistic is summed across ranks too; ``correct`` becomes ``accuracy``.
    """
    keys = sorted(stats)
    summed = dist_utils.all_reduce_sum(torch.stack([stats[k].float() for k in keys]))
    total = dict(zip(keys, summed.unbind()))
    weights = total["total_weights"]
    out = {"loss": total["loss_sum"] / weights.clamp(min=1), "total_weights": weights}
    if "correct" in total:
        out["accuracy"] = total["correct"] / weights.clamp(min=1)
    for k, v in total.items():
        if k not in ("loss_sum", "total_weights", "correct"):
            out[k] = v
    return out


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


def learning_rate(step: int, *, base_lr: float, total_steps: int, kind: str, warmup_steps: int,
                  min_lr_ratio: float, decay_fraction: float = 0.2) -> float:
    """LR for optimizer step ``step`` (1-based): linear warmup, then cosine/linear/constant/wsd.

    A pure function of the step, so a resumed run needs nothing but the step to continue exactly.
    """
    if warmup_steps and step <= warmup_steps:
        return base_lr * step / warmup_steps
    min_lr = base_lr * min_lr_ratio
    if kind == "constant":
        return base_lr
    if kind == "wsd":
        decay_start = total_steps - int(decay_fraction * total_steps)
        if step <= decay_start:
            return base_lr
        frac = (step - decay_start) / max(total_steps - decay_start, 1)
        return base_lr - (base_lr - min_lr) * min(frac, 1.0)
    frac = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    if kind == "linear":
        return base_lr - (base_lr - min_lr) * frac
    return min_lr + 0.5 * (base_lr - min_lr) * (1 + math.cos(math.pi * frac))


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float],
                    eps: float) -> torch.optim.AdamW:
    """AdamW with decay on matrices only (norm weights and biases are not decayed).

    Uses the fused kernel on CUDA and the foreach (multi-tensor) path elsewhere.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    on_cuda = any(p.is_cuda for p in decay)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=on_cuda or None,
                             foreach=None if on_cuda else True)
