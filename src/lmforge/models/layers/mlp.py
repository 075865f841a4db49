"""The feed-forward block: a gated MLP, SwiGLU (Llama, Qwen, Mistral) or GeGLU (Gemma)."""

from __future__ import annotations

from typing import Callable

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FeedForward", "activation"]


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"silu": F.silu, "gelu_tanh": _gelu_tanh}


def activation(name: str) -> Callable[[Tensor], Tensor]:
    """The gate activation ``ModelArgs.hidden_act`` names."""
    return _ACTIVATIONS[name]


class FeedForward(nn.Module):
    """Gated MLP: ``w2(act(w1 x) * w3 x)`` (w1 = gate, w3 = up, w2 = down)."""

    def __init__(self, dim: int, hidden_dim: int, hidden_act: str = "silu") -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.act = activation(hidden_act)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))
