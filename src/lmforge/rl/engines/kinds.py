"""The rollout engines ``grpo.engine`` can name, and what each can do.

Each engine is one :class:`EngineKind`: how to build it (a callable, or ``"module:function"`` imported
only when a run builds it, so checking a config imports no engine) and capability flags that the config
checks, GRPO's pre-flight and the rollout code read instead of testing engine names. An installed package
adds an engine through the ``lmforge.engines`` entry point (:mod:`lmforge.plugins`)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from lmforge.errors import UserError

__all__ = ["ENGINES", "EngineKind", "engine_kind", "find_engine", "resolve"]


@dataclass(frozen=True)
class EngineKind:
    """A rollout engine ``grpo.engine`` can name: how to build it, and what the rest of GRPO may rely on."""

    name: str
    build: Callable[..., Any] | str
    """``build(rt, grpo_section, autocast, own_copy)``, or its ``"module:function"``."""
    live_weights: bool
    """Samples from the trainer's own modules (no weight sync; its log-probs are the policy's own), so it
    needs whole weights on every rank to sample ahead of training (``grpo.async_steps``)."""
    continues_rounds: bool = False
    """Continues a completion from its prompt and the tokens sampled so far under new weights, with each
    token's log-prob (``grpo.partial_rollouts``)."""
    records_routes: bool = False
    """Reports the experts every MoE layer sent each token to (``grpo.router_replay``)."""
    takes_images: bool = False
    """Samples from prompts with images (vision-language policies)."""
    syncs_in_memory: bool = False
    """Takes the policy's weights over a process group from the trainer (``grpo.weight_sync = "memory"``)."""
    preflight: Callable[[Any], None] | str | None = None
    """``preflight(grpo_section)``: the engine's own settings checked before the run directory is touched."""


def resolve(target: Callable[..., Any] | str) -> Callable[..., Any]:
    """A callable, or the one a ``"module:function"`` string names."""
    if callable(target):
        return target
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


ENGINES: dict[str, EngineKind] = {
    "lmforge": EngineKind("lmforge", "lmforge.rl.engines.factory:build_lmforge_engine", live_weights=True,
                          continues_rounds=True, records_routes=True, takes_images=True),
    "vllm": EngineKind("vllm", "lmforge.rl.engines.factory:build_vllm_engine", live_weights=False,
                       continues_rounds=True, syncs_in_memory=True,
                       preflight="lmforge.rl.engines.preflight:check_vllm_settings"),
}
"""Every engine ``grpo.engine`` can name (plugins join on the first lookup of a name not built in)."""


def find_engine(name: str) -> EngineKind | None:
    """The engine ``name`` names, or None: a built-in one, or an :class:`EngineKind` that an installed
    package offers through the ``lmforge.engines`` entry point (loaded only for a name not built in)."""
    if name not in ENGINES:
        from lmforge.plugins import load_entry_points

        for ep, kind in load_entry_points("lmforge.engines"):
            if not isinstance(kind, EngineKind):
                raise UserError(f"plugin {ep.name} = {ep.value} of lmforge.engines is not an EngineKind")
            ENGINES.setdefault(kind.name, kind)
    return ENGINES.get(name)


def engine_kind(name: str) -> EngineKind:
    """The engine ``grpo.engine`` names (see :func:`find_engine`); an unknown name is one line."""
    if find_engine(name) is None:
        raise UserError(f"grpo.engine={name!r}: unknown rollout engine; known: {', '.join(ENGINES)}")
    return ENGINES[name]
