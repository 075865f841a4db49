"""Data: the embedded corpus, file readers, packing into samples, and step loading.

The names below load on first use (module ``__getattr__``), so importing one light submodule (say
:mod:`.tasks`, which the config reads) does not import torch through the loader.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOME = {
    "embedded_corpus": "corpus",
    "StepLoader": "loader", "eval_batches": "loader",
    "IGNORE_INDEX": "packing", "Batch": "packing", "PackedTokenDataset": "packing", "Sample": "packing",
    "SampleDataset": "packing", "collate": "packing",
    "read_documents": "sources", "read_jsonl_records": "sources",
}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
