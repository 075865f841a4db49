"""Datasets named as on the Hugging Face Hub (``data.train=org/name`` or ``org/name:split``), read through
``datasets`` from its cache (``pip install 'lmforge[data]'``).

The cache is the one ``datasets.load_dataset`` fills: ``HF_DATASETS_CACHE``, else ``HF_HOME/datasets``, else
``~/.cache/huggingface/datasets``. Offline (``HF_HUB_OFFLINE=1``, or no network) ``datasets`` reads the
newest version it prepared there; online it checks the Hub and downloads what is missing, as
``load_dataset`` always does. The rows are then read like a ``datasets`` directory's
(:func:`lmforge.data.sources.load_hf_dataset`): records for SFT, preference and GRPO data, the
``data.text_field`` column for pretraining.

A name is only a Hub name when no local path of that spelling exists (a local path always wins) and
it does not end in a data file suffix (``chats.jsonl`` that is missing is a missing file). Without
``:split`` the dataset must have exactly one split: so that a validation set never silently is the
training split, a dataset with several splits and no ``:split`` is refused with the split names.
"""

from __future__ import annotations

import os
from pathlib import Path

from lmforge.errors import UserError
from lmforge.models.hub import hub_offline, is_hub_name

__all__ = ["datasets_cache_dir", "hub_dataset_name", "load_hub_dataset"]

_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt", ".csv", ".arrow", ".gguf")


def hub_dataset_name(path: str | Path) -> tuple[str, str | None] | None:
    """(``org/name``, split or None) when ``path`` names a Hub dataset by the rule above, else None."""
    text = str(path)
    name, _, split = text.partition(":")
    if Path(text).expanduser().exists() or "@" in name or not is_hub_name(name):
        return None
    if Path(name).suffix.lower() in _FILE_SUFFIXES:
        return None
    return name, split or None


def datasets_cache_dir() -> Path:
    """The ``datasets`` cache, by the environment variables ``datasets`` reads."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "datasets"


def load_hub_dataset(path: str | Path):
    """The ``datasets.Dataset`` (memory-mapped from the cache) of the split ``path`` names."""
    named = hub_dataset_name(path)
    assert named is not None, path
    name, split = named
    cache = datasets_cache_dir()
    try:
        import datasets
    except ImportError:
        raise UserError(f"{path}: no such local file or directory; as a Hub dataset it needs datasets "
                        "(pip install 'lmforge[data]')") from None
    offline = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = offline or hub_offline()  # datasets read the variable when imported
    try:
        splits = datasets.load_dataset(name, cache_dir=str(cache))
    except Exception as e:  # noqa: BLE001 - datasets raises many types (ConnectionError, FileNotFoundError, ...)
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"{path}: no such local file or directory, and the Hub dataset {name} is not in the datasets "
                        f"cache {cache} ({why}); load it once where there is network (python -c \"import datasets; "
                        f"datasets.load_dataset('{name}')\"), or set HF_HUB_OFFLINE=0") from None
    finally:
        datasets.config.HF_HUB_OFFLINE = offline
    names = list(splits)
    if split is None and len(names) > 1:
        raise UserError(f"{path}: the Hub dataset {name} has splits {', '.join(names)}; name one, e.g. {name}:{names[0]}")
    chosen = split or names[0]
    if chosen not in splits:
        raise UserError(f"{path}: the Hub dataset {name} has no split {chosen!r} (splits: {', '.join(names)})")
    return splits[chosen]
