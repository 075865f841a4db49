"""Models named as on the Hugging Face Hub (``org/name`` or ``org/name@revision``), found in the
standard Hugging Face cache and downloaded into it only when that is allowed.

The cache is the one every Hugging Face library shares: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
``~/.cache/huggingface/hub``, laid out as ``models--org--name/refs/<revision>`` (a commit hash) and
``models--org--name/snapshots/<commit>/`` (the files). ``huggingface_hub`` reads it (``pip install
'lmforge[hub]'``). A name resolves to a commit hash, which is what lmforge records (``hub:org/name@<commit>``):
a branch such as ``main`` moves, a commit does not, so a resumed run and its reference model load
exactly the weights the run started from.

Downloading is allowed unless ``HF_HUB_OFFLINE`` is set; online, the Hub is asked for the revision's
current commit (as ``transformers`` does) and only the files lmforge reads are fetched. A name that
cannot be had is one line: the repository, the cache looked in, and how to get it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from lmforge.errors import UserError

__all__ = ["HubModel", "hub_cache_dir", "hub_offline", "is_hub_name", "resolve_hub_model", "split_hub_name"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_COMMIT = re.compile(r"[0-9a-f]{40}")
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]
"""What lmforge reads of a model repository: config, weights (and their index), tokenizer and chat template."""


@dataclass(frozen=True)
class HubModel:
    repo_id: str
    commit: str
    """The commit hash the revision resolved to."""
    directory: Path
    """The snapshot directory in the cache (config.json, weights, tokenizer files)."""

    @property
    def pinned(self) -> str:
        return f"{self.repo_id}@{self.commit}"


def split_hub_name(name: str) -> tuple[str, str | None]:
    """``org/name@rev`` -> (``org/name``, ``rev``); no ``@``: revision None (the Hub's default, ``main``)."""
    repo_id, at, revision = name.partition("@")
    return repo_id, (revision or None) if at else None


def is_hub_name(value: str | Path) -> bool:
    """Whether ``value`` is spelled like a Hub repository (``org/name`` with an optional ``@revision``).
    A local path that exists is never a Hub name: callers check the filesystem first."""
    repo_id, revision = split_hub_name(str(value))
    return bool(_NAME.fullmatch(repo_id)) and ".." not in repo_id and not str(value).endswith("@")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, by the same environment variables the Hugging Face libraries read."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` as the Hugging Face libraries read it (read now, not when they were imported)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def resolve_hub_model(name: str) -> HubModel:
    """The cached snapshot ``name`` (``org/name[@revision]``) resolves to, downloaded first where allowed.

    Offline (``HF_HUB_OFFLINE=1``) only the cache is read: ``refs/<revision>`` names the commit, or the
    revision is a commit hash with its snapshot present.
    """
    repo_id, revision = split_hub_name(name)
    cache, offline = hub_cache_dir(), hub_offline()
    shown = f"{repo_id}@{revision}" if revision else repo_id
    get = f"hf download {repo_id}" + (f" --revision {revision}" if revision else "")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise UserError(f"{shown}: a Hub model name needs huggingface_hub (pip install 'lmforge[hub]'), "
                        "or name a local directory") from None
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=str(cache), local_files_only=offline,
                                        allow_patterns=MODEL_FILES))
    except Exception as e:  # noqa: BLE001 - huggingface_hub raises many types; all become one line
        kind = type(e).__name__
        why = (str(e).strip().splitlines() or [kind])[0]
        if kind in ("RepositoryNotFoundError", "RevisionNotFoundError", "GatedRepoError"):
            raise UserError(f"{shown}: not available from the Hugging Face Hub ({why})") from None
        if offline:
            reason = "and HF_HUB_OFFLINE=1 forbids downloading it"
            how = f"run `{get}` where there is network, or set HF_HUB_OFFLINE=0"
        else:
            reason = f"and downloading it failed ({why})"
            how = f"run `{get}` where there is network and copy the cache here, or name a local directory"
        raise UserError(f"{shown}: not in the Hugging Face cache {cache} {reason}; {how}") from None
    commit = folder.name
    if not _COMMIT.fullmatch(commit) or not (folder / "config.json").is_file():
        raise UserError(f"{shown}: the cached snapshot {folder} has no config.json (an interrupted download?); "
                        f"run `{get}` again")
    return HubModel(repo_id, commit, folder)
