"""RMSNorm: the normalisation every supported family uses (blocks, final norm, Qwen3's q/k norms)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["RMSNorm", "rms_norm"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension (``RMSNorm.forward``; also used by the decode step)."""
    # Normalise in fp32 and cast back before the weight, as Llama does; this keeps
    # bf16 numerics identical to reference implementations.
    dtype = x.dtype
    if dtype == torch.float32:  # same math, one fused kernel
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)
