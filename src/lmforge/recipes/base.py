"""What a recipe is, and the registry of them.

A recipe says only what its trainer's job needs: its config class (the shared sections plus its own),
``check`` (every input the user can get wrong, read before anything is written), ``services`` (what it
adds to the shared runtime: step hooks, a fast checkpoint tier), ``build`` (its step source, objective
and evaluation, as a :class:`~lmforge.training.loop.Job`) and ``finish`` (anything after the last step). The shared loop,
metrics, checkpoints and the skeleton around them (:mod:`.skeleton`) are the same for every recipe.

Recipes are found by module: every module of the :mod:`lmforge.recipes` package is imported once and
each ``@register``-ed class in it is registered under its ``name``; then the ``lmforge.recipes`` entry
points of installed packages (:mod:`lmforge.plugins`): a module that registers its recipes, or a
``Recipe`` class. Recipe modules import nothing heavy at module level (torch, the model, the data
pipeline: inside ``check``/``build``), so listing them (``lmforge --help``) and checking a config stay fast.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING, Any, ClassVar

from lmforge.config import Config
from lmforge.errors import UserError

if TYPE_CHECKING:  # torch-free at import: ``lmforge --help`` and config errors answer without loading torch
    from lmforge.runtime import RecipeServices, Runtime
    from lmforge.training.loop import Job
    from lmforge.training.state import TrainState


class Recipe:
    name: ClassVar[str]
    config: ClassVar[type[Config]] = Config
    summary: ClassVar[str] = ""
    """One line for ``lmforge --help``."""
    splits_model: ClassVar[bool] = False
    """Runs with tensor, context, expert or pipeline parallelism (``parallel.tp/cp/ep/pp``): its step
    source yields packed :class:`~lmforge.data.packing.Batch` microbatches and its objective reaches the
    model only through ``model(..., head=...)``."""
    expert_parallel: ClassVar[bool] = False
    """Runs with expert parallelism (``parallel.ep``) though it splits nothing else: every rank keeps its
    own whole sequences (routing, the loss and any routing replay stay on the token's rank) and only the
    MoE layers' expert runs travel, so the step source may yield any batch type; its forwards must come in
    the same number on every rank (each MoE layer's all-to-all is a collective, as FSDP2's gathers are)."""

    def check(self, cfg: Any) -> Any:
        """Read and check the recipe's inputs before the runtime exists (nothing is written yet); what it
        returns is handed to ``services``, ``build`` and ``finish``."""
        return None

    def services(self, cfg: Any, inputs: Any) -> RecipeServices:
        from lmforge.runtime import RecipeServices

        return RecipeServices()

    def build(self, rt: Runtime, cfg: Any, inputs: Any) -> Job:
        raise NotImplementedError

    def finish(self, rt: Runtime, cfg: Any, inputs: Any, state: TrainState) -> None:
        """After the run's final save (e.g. a recipe removes files only its run needed)."""


_REGISTRY: dict[str, Recipe] = {}
_LOADED = False


def register(cls: type[Recipe]) -> type[Recipe]:
    """Class decorator: make ``cls`` the recipe called ``cls.name``."""
    if cls.name in _REGISTRY and type(_REGISTRY[cls.name]) is not cls:
        raise ValueError(f"two recipes are called {cls.name!r}")
    _REGISTRY[cls.name] = cls()
    return cls


def recipes() -> dict[str, Recipe]:
    """Every registered recipe by name: lmforge's own in the order their modules sort, then plugins'."""
    global _LOADED
    if not _LOADED:
        import lmforge.recipes as package

        for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
            if info.name not in ("base", "skeleton"):
                importlib.import_module(f"{package.__name__}.{info.name}")
        # a recipe module imported before this first call registered early: put lmforge's own back in module order
        own = sorted((r for r in _REGISTRY.values() if type(r).__module__.startswith(package.__name__ + ".")),
                     key=lambda r: type(r).__module__)
        rest = [r for r in _REGISTRY.values() if r not in own]
        _REGISTRY.clear()
        _REGISTRY.update({r.name: r for r in own + rest})
        from lmforge.plugins import load_entry_points

        for ep, obj in load_entry_points("lmforge.recipes"):
            if isinstance(obj, type) and issubclass(obj, Recipe) and type(_REGISTRY.get(obj.name)) is not obj:
                try:
                    register(obj)
                except ValueError as e:
                    raise UserError(f"plugin {ep.name} = {ep.value} of lmforge.recipes: {e}") from None
        _LOADED = True
    return dict(_REGISTRY)


def get_recipe(name: str) -> Recipe:
    known = recipes()
    if name not in known:
        raise UserError(f"unknown trainer {name!r}; known: {', '.join(known)}")
    return known[name]
