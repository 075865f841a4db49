"""Routing replay: run a mixture-of-experts model with the experts another forward chose.

An RL trainer's forward over sampled tokens can route a token to other experts than the engine that
sampled it did (another precision, another kernel, weights a step newer): near-tied router scores flip,
the token goes through other experts, and the trainer's log-probs of the sampled tokens move far from
the behaviour policy's, which importance ratios and their clipping then misread (Megatron-LM's and
verl's routing replay; in Megatron-LM#4168 three of three baseline MoE GRPO runs collapsed without it).
:func:`recorded_routes` reads the experts every MoE layer chose in a model's last forward;
:func:`replay_routes` makes the next forwards send each token to those experts instead of choosing.
The router's weights over the replayed experts still come from the replaying model's own logits (the
family's rule, :meth:`lmforge.models.layers.moe.Router.route`), so the router is trained as usual.

Routes are kept per row and position of a ``[B, T]`` forward as ``[n_moe_layers, B, T, k]`` int16
(expert ids below 32768): a few bytes per token and layer.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor, nn

from lmforge.models.layers.moe import MoEFeedForward

__all__ = ["moe_layers", "recorded_routes", "replay_routes", "has_moe_layers", "replay_disagreement"]


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    """The model's MoE layers, in forward order."""
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def has_moe_layers(model: nn.Module) -> bool:
    """Whether ``model`` routes anything (a dense model has nothing to record or replay)."""
    return any(isinstance(m, MoEFeedForward) for m in model.modules())


def recorded_routes(model: nn.Module, rows: int) -> Tensor:
    """``[n_moe_layers, rows, T, k]`` int16 on the CPU: the experts every MoE layer sent each token of the
    model's last forward (of ``rows`` rows) to."""
    layers = moe_layers(model)
    if not layers or any(m.last_routing is None for m in layers):
        raise ValueError("recorded_routes: the model has no MoE layer or no forward ran yet")
    chosen = [m.last_routing.chosen for m in layers]  # type: ignore[union-attr]
    return torch.stack([c.reshape(rows, -1, c.shape[-1]) for c in chosen]).to("cpu", torch.int16)


@contextmanager
def replay_routes(model: nn.Module, routes: Tensor | None) -> Iterator[None]:
    """Within: every forward of ``model`` over ``[B, T]`` tokens sends token ``(b, t)`` of MoE layer ``l`` to
    the experts ``routes[l, b, t]`` (``routes`` as :func:`recorded_routes` gives them). None replays nothing."""
    if routes is None:
        yield
        return
    layers = moe_layers(model)
    if len(layers) != routes.shape[0]:
        raise ValueError(f"routing replay of {routes.shape[0]} MoE layers for a model with {len(layers)}")
    for m, r in zip(layers, routes):
        m.replay = r.reshape(-1, r.shape[-1])
    try:
        yield
    finally:
        for m in layers:
            m.replay = None


def replay_disagreement(model: nn.Module, shape: torch.Size) -> Tensor | None:
    """``[B, T]`` fp32: the share of MoE layers whose router would have sent each token of the last forward
    (of input ``shape``) to other experts than the ones it replayed; None when that forward replayed none."""
    flags = [m.router.disagreement for m in moe_layers(model)]
    if not flags or any(f is None for f in flags):
        return None
    return torch.stack([f.reshape(shape) for f in flags]).float().mean(0)  # type: ignore[union-attr]
