"""The gradient pieces the chunked losses share: the output weight's gradient per chunk (the loss kernel,
:mod:`.chunked_loss`), and the backward of a loss *sum* whose forward already computed both input
gradients (the kernel's log-prob sum and distillation's divergence, :mod:`.chunked_divergence`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def add_weight_grad(grad_w: Tensor, grad_z: Tensor, h: Tensor, cdtype: torch.dtype) -> None:
    """``grad_w += grad_z^T h``: in place in fp32; in low precision the matmul runs as autocast's Linear
    would and is summed into the fp32 gradient."""
    if cdtype == torch.float32:
        grad_w.addmm_(grad_z.t(), h)
    else:
        grad_w.add_(grad_z.t() @ h)


def save_precomputed_grads(ctx: Any, grad_h: Tensor | None, grad_w: Tensor | None, weight_dtype: torch.dtype) -> None:
    """Keep the gradients a loss sum computed in its forward for :func:`precomputed_grads`."""
    ctx.save_for_backward(*(g for g in (grad_h, grad_w) if g is not None))
    ctx.has = (grad_h is not None, grad_w is not None)
    ctx.weight_dtype = weight_dtype


def precomputed_grads(ctx: Any, grad_total: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """The backward of a loss sum whose forward already computed d/dhidden and d/dweight (saved in
    that order, ``ctx.has`` saying which): both scaled by the upstream gradient of the sum."""
    saved = iter(ctx.saved_tensors)
    grad_h = next(saved) * grad_total if ctx.has[0] else None
    grad_w = (next(saved) * grad_total).to(ctx.weight_dtype) if ctx.has[1] else None
    return grad_h, grad_w
