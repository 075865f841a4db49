"""Entry points: how a package installed beside lmforge adds to it (a recipe, and in the same way a model
family, a rollout engine or a file reader: ``lmforge.families``, ``lmforge.engines``, ``lmforge.readers``)
without lmforge naming it.

A package declares, in its ``pyproject.toml``::

    [project.entry-points."lmforge.recipes"]
    my_recipe = "my_package.recipe"          # a module that registers with @register when imported
    # or "my_package.recipe:MyRecipe"        # the object itself (a Recipe class: registered here)

and :func:`load_entry_points` imports every entry of a group once. A plugin that fails to load stops
with one line naming it and its package, never a traceback from inside lmforge.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import Any

from lmforge.errors import UserError

_LOADED: dict[str, list[tuple[EntryPoint, Any]]] = {}


def load_entry_points(group: str) -> list[tuple[EntryPoint, Any]]:
    """Every entry point of ``group`` (``lmforge.recipes``, ...), loaded, sorted by name; the same list
    on later calls (each plugin is imported once per process)."""
    if group not in _LOADED:
        loaded = []
        for ep in sorted(entry_points(group=group), key=lambda e: e.name):
            try:
                loaded.append((ep, ep.load()))
            except Exception as e:  # noqa: BLE001 - a third-party module: say which one, in one line
                dist = f" (package {ep.dist.name})" if ep.dist is not None else ""
                raise UserError(f"plugin {ep.name} = {ep.value}{dist} of {group} failed to load: "
                                f"{type(e).__name__}: {e}") from None
        _LOADED[group] = loaded
    return _LOADED[group]
