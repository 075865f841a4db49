"""lmforge: compact, PyTorch-native training of Llama-style language models.

The Python API (:mod:`lmforge.api`: ``train``, ``Trainer``, ``Run``, ``load``, ``generate``, ``export``)
loads on first use, so ``import lmforge`` stays cheap (no torch until a model is needed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_API = ("Run", "Trainer", "Loaded", "train", "load", "generate", "export")
__all__ = ["__version__", *_API]

if TYPE_CHECKING:
    from lmforge.api import Loaded, Run, Trainer, export, generate, load, train  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in _API:
        from lmforge import api

        return getattr(api, name)
    raise AttributeError(f"module 'lmforge' has no attribute {name!r}")
