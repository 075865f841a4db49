"""Checkpoint integrity: a manifest of sizes and SHA-256 digests, written last by every save.

A checkpoint whose files do not match its manifest (missing, truncated, altered, or no manifest at
all) is damaged; :func:`checkpoint_problem` says why in one line.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch.distributed as torch_dist

from lmforge import distributed as dist_utils
from lmforge.checkpoint.layout import MANIFEST_FILE, STATE_FILE, write_json


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _hash_files(files: list[Path], collective: bool) -> dict[str, str]:
    """SHA-256 of each file by name. Collective: the ranks split the files and share the digests.

    Hashing runs at roughly 0.5-2 GB/s per process, so splitting it keeps large checkpoints cheap.
    """
    spread = collective and torch_dist.is_initialized() and torch_dist.get_world_size() > 1
    r, w = (torch_dist.get_rank(), torch_dist.get_world_size()) if spread else (0, 1)
    mine: dict[str, str] = {}
    for f in files[r::w]:
        try:
            mine[f.name] = _sha256(f)
        except OSError as e:
            mine[f.name] = f"unreadable ({e.strerror or e})"
    if not spread:
        return mine
    parts: list[Any] = [None] * w
    torch_dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def checkpoint_problem(path: Path, collective: bool = False) -> str | None:
    """Why ``path`` cannot be trusted (missing/truncated/altered files), or None if it is intact.

    With ``collective=True`` every rank must call it (the hashing is split across ranks).
    """
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))
        files: dict[str, dict[str, Any]] = manifest["files"]
    except FileNotFoundError:
        return f"no {MANIFEST_FILE} (written last by every save, so the save never finished)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable {MANIFEST_FILE} ({type(e).__name__})"
    if STATE_FILE not in files:
        return f"{MANIFEST_FILE} does not list {STATE_FILE}"
    for name, entry in sorted(files.items()):
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != entry.get("size"):
            what = "truncated" if size < entry.get("size", 0) else "longer than written"
            return f"{name} is {what} ({size} of {entry.get('size')} bytes)"
    digests = _hash_files([path / n for n in sorted(files)], collective)
    for name, entry in sorted(files.items()):
        if digests.get(name) != entry.get("sha256"):
            return f"{name} is corrupted (SHA-256 differs from {MANIFEST_FILE})"
    return None


_VERIFIED: dict[tuple[str, int, int], str | None] = {}


def cached_problem(path: Path) -> str | None:
    """A one-process checkpoint_problem, remembered per manifest file (committed checkpoints never change).

    Never used for collective checks: a rank with a cached answer would skip a collective the others enter.
    """
    try:
        st = (path / MANIFEST_FILE).stat()
        key: tuple[str, int, int] | None = (str(path.resolve()), st.st_ino, st.st_mtime_ns)
    except OSError:
        key = None
    if key is not None and key in _VERIFIED:
        return _VERIFIED[key]
    problem = checkpoint_problem(path)
    if key is not None:
        _VERIFIED[key] = problem
    return problem


def write_manifest(path: Path, collective: bool) -> None:
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name != MANIFEST_FILE)
    digests = _hash_files(files, collective)
    if dist_utils.rank() == 0:
        entries = {p.name: {"size": p.stat().st_size, "sha256": digests[p.name]} for p in files}
        write_json(path / MANIFEST_FILE, {"format": 1, "files": entries})


