"""The feed-forward block: a gated MLP, SwiGLU (Llama, Qwen, Mistral), GeGLU (Gemma) or gpt-oss's clamped
SwiGLU, with optional biases (gpt-oss).

The gated product ``act(g) * u`` is one autograd node (:func:`gated_activation`) that keeps only its
two inputs for the backward and recomputes ``act(g)`` there. Eager autograd of the same expression
keeps ``act(g)`` as well (the product's backward needs it), so the gated MLP would save four
hidden-size tensors per token (``g`` for the activation, ``act(g)`` and ``u`` for the product, the
product for ``w2``); it saves three. The forward runs the same ops in the same order as the
expression, so its values are the same bits in every dtype; the backward runs the ops eager autograd
runs (the product rule, then the activation's own backward kernel), so its values match it too.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmforge.models.configs import MLPConfig

__all__ = ["FeedForward", "activation", "clamped_swiglu", "gated_activation", "gated_unit"]


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"silu": F.silu, "gelu_tanh": _gelu_tanh}

_BACKWARDS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "silu": lambda grad, g: torch.ops.aten.silu_backward(grad, g),
    "gelu_tanh": lambda grad, g: torch.ops.aten.gelu_backward(grad, g, approximate="tanh"),
}
"""``d act(g) / dg`` applied to ``grad``: the fused kernels eager autograd itself calls."""


def activation(name: str) -> Callable[[Tensor], Tensor]:
    """The gate activation ``ModelArgs.hidden_act`` names."""
    return _ACTIVATIONS[name]


class _GatedActivation(torch.autograd.Function):
    """``act(g) * u`` saving ``g`` and ``u`` only; ``act(g)`` is recomputed in the backward."""

    @staticmethod
    def forward(ctx: Any, g: Tensor, u: Tensor, name: str) -> Tensor:
        ctx.name = name
        ctx.save_for_backward(g, u)
        return _ACTIVATIONS[name](g) * u

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        # At most three hidden-size tensors beside the saved ones, as in eager autograd's backward:
        # grad_g first (its product temporary is freed when the kernel returns), then grad_u written
        # over the recomputed act(g).
        g, u = ctx.saved_tensors
        grad_g = grad_u = None
        if ctx.needs_input_grad[0]:  # the product rule into act(g), then act's backward kernel
            grad_g = _BACKWARDS[ctx.name]((grad * u).to(g.dtype), g)
        if ctx.needs_input_grad[1]:
            act = _ACTIVATIONS[ctx.name](g)
            grad_u = act.mul_(grad) if act.dtype == grad.dtype == u.dtype else (grad * act).to(u.dtype)
        return grad_g, grad_u, None


def gated_activation(g: Tensor, u: Tensor, name: str) -> Tensor:
    """``activation(name)(g) * u``, the same bits; when a gradient is wanted, one autograd node that
    saves ``g`` and ``u`` (not ``act(g)``) and recomputes the activation in the backward. Elementwise,
    so it takes tensor-parallel shards (DTensors) of the hidden dimension as they are."""
    if name not in _ACTIVATIONS:
        raise KeyError(f"unknown activation {name!r}; known: {', '.join(_ACTIVATIONS)}")
    if torch.is_grad_enabled() and (g.requires_grad or u.requires_grad):
        return _GatedActivation.apply(g, u, name)
    return _ACTIVATIONS[name](g) * u


def clamped_swiglu(g: Tensor, u: Tensor, limit: float, alpha: float) -> Tensor:
    """gpt-oss's gated unit: the gate clamped above and the up projection on both sides at ``limit``,
    then ``(u + 1) * g * sigmoid(alpha * g)`` (plain autograd: its clamps keep more than the lean node)."""
    g = g.clamp(max=limit)
    u = u.clamp(min=-limit, max=limit)
    return (u + 1) * (g * torch.sigmoid(g * alpha))


def gated_unit(g: Tensor, u: Tensor, cfg: MLPConfig) -> Tensor:
    """The gated product of an MLP config's activation (SwiGLU, GeGLU or the clamped SwiGLU)."""
    if cfg.activation == "clamped_swiglu":
        return clamped_swiglu(g, u, float(cfg.limit), float(cfg.alpha))
    return gated_activation(g, u, cfg.activation)


def check_activation(cfg: MLPConfig) -> None:
    """Fail at build time on an activation name no kernel here knows."""
    if cfg.activation == "clamped_swiglu":
        if cfg.limit is None or cfg.alpha is None:
            raise ValueError("MLPConfig: clamped_swiglu needs limit and alpha")
    else:
        activation(cfg.activation)


class FeedForward(nn.Module):
    """Gated MLP: ``w2(act(w1 x) * w3 x)`` (w1 = gate, w3 = up, w2 = down); the gated product
    through :func:`gated_activation` (saves three hidden-size tensors per token, not four)."""

    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=cfg.bias)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=cfg.bias)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=cfg.bias)
        check_activation(cfg)
        self.cfg = cfg

    def weight_groups(self) -> tuple[list[Tensor], list[Tensor]]:
        """(matrices reading the block's input, matrices writing the residual stream), for the init."""
        return [self.w1.weight, self.w3.weight], [self.w2.weight]

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(gated_unit(self.w1(x), self.w3(x), self.cfg))
