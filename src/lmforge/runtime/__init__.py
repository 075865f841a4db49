"""The runtime: what a recipe's job trains on, built in phases (check, world, model, services); see
:mod:`.build`."""

from lmforge.runtime.build import Runtime, build_runtime
from lmforge.runtime.services import RecipeServices

__all__ = ["RecipeServices", "Runtime", "build_runtime"]
