"""RMSNorm: the normalisation every supported family uses (blocks, final norm, q/k norms).

Three conventions exist and differ in low-precision rounding, so each family gets its own: Llama's
scales by ``weight`` after casting the normalised activations back to their dtype; Gemma's
(``unit_offset``) scales by ``1 + weight`` in fp32 and casts last, and its weights start at zero;
gpt-oss's (``weight_in_fp32``) scales by ``weight`` in fp32 and casts last.

When a gradient is wanted, each convention is one autograd node that keeps only its input, the
weight and ``1/rms`` (one fp32 value per row) for the backward, which recomputes the normalised
values from them. Eager autograd of the same arithmetic (``F.rms_norm`` on a CPU decomposes into
pow, mean, rsqrt and two products) keeps the fp32 normalised values too, one more ``dim``-sized
fp32 tensor per token and norm. The forward runs the very ops it ran before (``F.rms_norm``'s own
kernel, or the same expression), so its values are the same bits; the backward is the textbook one,
``rstd * (dy_hat - x_hat * mean(dy_hat * x_hat))``, equal to eager autograd's up to rounding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmforge.models.configs import NormConfig

__all__ = ["RMSNorm", "rms_norm", "unit_offset_rms_norm"]

_FP32, _LOW, _UNIT_OFFSET, _FP32_SCALE = "fp32", "low", "unit_offset", "fp32_scale"
"""The four forwards: Llama's on fp32 inputs (``F.rms_norm``'s kernel), Llama's on bf16/fp16 inputs
(normalised in fp32, cast back, then scaled), Gemma's (scaled by ``1 + weight`` in fp32, cast last),
gpt-oss's on bf16/fp16 inputs (scaled by ``weight`` in fp32, cast last)."""


_FUSED_RMS_NORM = getattr(torch.ops.aten, "_fused_rms_norm", None)
"""``F.rms_norm``'s kernel, returning ``1/rms`` too (torch >= 2.8; on a CPU the composite, elsewhere
the device's fused kernel where it has one)."""


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, in the convention its :class:`NormConfig` names."""

    def __init__(self, cfg: NormConfig) -> None:
        super().__init__()
        self.eps = cfg.eps
        self.unit_offset = cfg.unit_offset
        self.weight_in_fp32 = cfg.weight_in_fp32
        self.weight = nn.Parameter(torch.zeros(cfg.dim) if cfg.unit_offset else torch.ones(cfg.dim))

    def reset_parameters(self) -> None:
        """The identity scale: weight 1, or 0 under ``unit_offset``."""
        with torch.no_grad():
            self.weight.fill_(0.0 if self.unit_offset else 1.0)

    def forward(self, x: Tensor) -> Tensor:
        if self.unit_offset:
            return unit_offset_rms_norm(x, self.weight, self.eps)
        if self.weight_in_fp32 and x.dtype != torch.float32:
            return _norm(x, self.weight, self.eps, _FP32_SCALE)
        return rms_norm(x, self.weight, self.eps)


def _rstd(h: Tensor, eps: float) -> Tensor:
    """``1/rms`` of each row of the fp32 ``h``, as the composite forwards compute it."""
    return torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def _forward(x: Tensor, weight: Tensor, eps: float, kind: str) -> tuple[Tensor, Tensor]:
    """(output, 1/rms [..., 1] fp32) of one convention."""
    if kind == _FP32 and _FUSED_RMS_NORM is not None:  # what F.rms_norm runs for matching dtypes
        out, rstd = _FUSED_RMS_NORM(x, [x.shape[-1]], weight, eps)
        return out, rstd
    if kind == _FP32:  # torch < 2.8: F.rms_norm is this composite
        rstd = _rstd(x, eps)
        return x * rstd * weight, rstd
    h = x.float()
    rstd = _rstd(h, eps)
    if kind == _LOW:
        return weight * (h * rstd).to(x.dtype), rstd
    if kind == _FP32_SCALE:
        return (h * rstd * weight.float()).to(x.dtype), rstd
    return (h * rstd * (1.0 + weight.float())).to(x.dtype), rstd


class _RMSNormFunction(torch.autograd.Function):
    """One convention's forward, saving ``x``, ``1/rms`` and the weight; the normalised values are
    recomputed in the backward (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float, kind: str) -> Tensor:
        out, rstd = _forward(x, weight, eps, kind)
        ctx.kind = kind
        ctx.save_for_backward(x, rstd, weight)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        x, rstd, weight = ctx.saved_tensors
        x_hat = x.float() * rstd  # the forward's fp32 normalised values
        scale = weight
        if ctx.kind == _UNIT_OFFSET:  # out = (x_hat * (1 + w)).to(dtype): the scale is applied in fp32
            grad, scale = grad.float(), 1.0 + weight.float()
        elif ctx.kind == _FP32_SCALE:  # out = (x_hat * w).to(dtype), in fp32
            grad, scale = grad.float(), weight.float()
        grad_weight = grad_x = None
        if ctx.needs_input_grad[1]:  # Llama's on bf16 input scales the normalised values cast to bf16
            scaled = x_hat.to(x.dtype) if ctx.kind == _LOW else x_hat
            grad_weight = (grad * scaled).sum_to_size(weight.shape).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            grad_hat = grad * scale
            if ctx.kind == _LOW:  # back through the cast to x's dtype
                grad_hat = grad_hat.to(x.dtype).float()
            # rstd * (grad_hat - x_hat * mean(grad_hat * x_hat)), in place on the fresh temporaries
            dot = (grad_hat * x_hat).mean(-1, keepdim=True)
            grad_x = grad_hat.sub_(x_hat.mul_(dot)).mul_(rstd).to(x.dtype)
        return grad_x, grad_weight, None, None


def _norm(x: Tensor, weight: Tensor, eps: float, kind: str) -> Tensor:
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNormFunction.apply(x, weight, eps, kind)
    if kind == _FP32:  # nothing saved: the plain call (the decode step, evaluation)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return _forward(x, weight, eps, kind)[0]


def unit_offset_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Gemma's RMSNorm: ``normalise(x) * (1 + weight)`` computed in fp32, then cast to x's dtype.
    Saves ``x`` and ``1/rms`` for the backward."""
    return _norm(x, weight, eps, _UNIT_OFFSET)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension (``RMSNorm.forward``; also used by the decode step).
    Saves ``x`` and ``1/rms`` for the backward."""
    # Normalise in fp32 and cast back before the weight, as Llama does; this keeps
    # bf16 numerics identical to reference implementations.
    dtype = x.dtype
    if dtype == torch.float32:
        if weight.dtype != dtype:  # F.rms_norm's own fallback for mixed dtypes: not its fused kernel
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        return _norm(x, weight, eps, _FP32)  # F.rms_norm's kernel: same math, one fused kernel
    return _norm(x, weight, eps, _LOW)
