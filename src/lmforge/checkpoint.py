"""Checkpoints with torch.distributed.checkpoint (DCP): atomic, resumable at any world size.

Layout of ``RUN_DIR/checkpoints/step_00000100/``:

* DCP shards (``.metadata``, ``*.distcp``): model and optimizer state, resharded on load, so a run
  saved by 2 processes resumes on 1 and the reverse.
* ``trainer_state.json``: step, tokens seen, data position (a global sample index), trainer extras.
* ``rng_rank{R}.json``: each rank's torch/numpy/python RNG states.

A checkpoint is written into ``step_X.partial`` and renamed to ``step_X`` only after every rank has
finished writing and the files are flushed, so a crash mid-save leaves no directory that looks
complete; the previous checkpoint is only deleted after the new one is in place. Nothing is loaded
through unrestricted pickle: DCP tensors plus JSON.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from lmforge import distributed as dist_utils
from lmforge.errors import UserError

STATE_FILE = "trainer_state.json"

# A single process without a process group is a supported way to save and load: say nothing.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a ``.partial`` directory never counts)."""
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.iterdir()
             if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit() and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def capture_rng() -> dict[str, Any]:
    np_state = np.random.get_state()
    py_state = random.getstate()
    return {
        "torch": torch.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    p = state["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))


class Checkpointer:
    """Saves and restores full training state under ``run_dir/checkpoints``."""

    def __init__(self, run_dir: str | Path, keep: int = 2) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep

    def latest(self) -> Path | None:
        found = list_checkpoints(self.root)
        return found[-1] if found else None

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
             trainer_state: dict[str, Any]) -> Path:
        """Write a checkpoint of ``step`` atomically (collective: every rank must call it)."""
        final = self.root / step_dir_name(step)
        partial = self.root / (step_dir_name(step) + ".partial")
        rank = dist_utils.rank()
        if rank == 0:
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir(parents=True)
        dist_utils.barrier()
        if optimizer is not None:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
        else:
            state = {"model": get_model_state_dict(model)}
        dcp.save(state, checkpoint_id=str(partial))
        _write_json(partial / f"rng_rank{rank}.json", capture_rng())
        dist_utils.barrier()
        if rank == 0:
            _write_json(partial / STATE_FILE, {"step": step, **trainer_state})
            _fsync_dir(partial)
            if final.exists():  # an earlier run saved this step already: replace it atomically
                shutil.rmtree(final)
            os.replace(partial, final)
            _fsync_dir(self.root)
            self._prune()
        dist_utils.barrier()
        return final

    def _prune(self) -> None:
        for old in list_checkpoints(self.root)[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """Restore model (and optimizer) in place; returns the trainer state; restores this rank's RNG."""
        trainer_state = read_trainer_state(path)
        if optimizer is not None:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=str(path))
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        else:
            load_model_weights(path, model)
        rng_file = path / f"rng_rank{dist_utils.rank()}.json"
        if not rng_file.is_file():  # resumed on more ranks than saved: derive from rank 0's state
            rng_file = path / "rng_rank0.json"
        if rng_file.is_file():
            restore_rng(json.loads(rng_file.read_text()))
        return trainer_state


def read_trainer_state(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"checkpoint {path}: unreadable {STATE_FILE} ({e})") from None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory (its newest checkpoint)."""
    p = Path(path)
    if (p / STATE_FILE).is_file():
        return p
    latest = Checkpointer(p).latest()
    if latest is None:
        raise UserError(f"no complete checkpoint found in {p}")
    return latest


def load_model_weights(path: str | Path, model: nn.Module) -> None:
    """Load only the model weights of an lmforge checkpoint (e.g. to start SFT or GRPO from it)."""
    ckpt = resolve_checkpoint(path)
    model_sd = get_model_state_dict(model)
    state = {"model": model_sd}
    dcp.load(state, checkpoint_id=str(ckpt))
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
