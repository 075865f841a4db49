"""RMSNorm: the normalisation every supported family uses (blocks, final norm, q/k norms).

Two conventions exist and differ in low-precision rounding, so each family gets its own: Llama's
scales by ``weight`` after casting the normalised activations back to their dtype; Gemma's
(``unit_offset``) scales by ``1 + weight`` in fp32 and casts last, and its weights start at zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["RMSNorm", "rms_norm", "unit_offset_rms_norm"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def reset_parameters(self) -> None:
        """The identity scale: weight 1, or 0 under ``unit_offset``."""
        with torch.no_grad():
            self.weight.fill_(0.0 if self.unit_offset else 1.0)

    def forward(self, x: Tensor) -> Tensor:
        if self.unit_offset:
            return unit_offset_rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


def unit_offset_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Gemma's RMSNorm: ``normalise(x) * (1 + weight)`` computed in fp32, then cast to x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


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
