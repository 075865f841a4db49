"""Recipes: every trainer is one module here that registers a :class:`~.base.Recipe`.

:func:`~.skeleton.run_recipe` is the only skeleton that runs them; the CLI, the config loader and the
tests enumerate :func:`~.base.recipes`, so adding a trainer is adding a module here.
"""

from lmforge.recipes.base import Recipe, get_recipe, recipes, register

__all__ = ["Recipe", "get_recipe", "recipes", "register"]
