"""AdamW as every recipe builds it: decay on matrices only, torch's fused kernel where it exists."""

from __future__ import annotations

import torch
from torch import nn


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float],
                    eps: float) -> torch.optim.AdamW:
    """AdamW with decay on matrices only (norm weights and biases are not decayed), fused where it can be.

    The fused kernel updates each parameter in one pass with no temporaries; the foreach path makes
    about ten passes over every state and a temporary the size of the parameters. On a 2-core CPU
    fused took 129 ms for SmolLM2-135M's parameters against 603 ms for foreach (results agree to 1.5e-8
    after 3 steps; ``bench/adamw_kernels.py``), so it is used on CPU and CUDA alike (:func:`adamw_kernel`).
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, **adamw_kernel(decay + no_decay))


def adamw_kernel(params: list[torch.Tensor]) -> dict[str, bool]:
    """``fused=True`` for parameters on CPU or CUDA (torch's fused AdamW kernels), else ``foreach=True``."""
    if params and all(p.device.type in ("cpu", "cuda") for p in params):
        return {"fused": True}
    return {"foreach": True}
