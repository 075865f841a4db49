"""Checkpoints with torch.distributed.checkpoint (DCP): atomic, verified, resumable at any world size.

Layout of ``RUN_DIR/checkpoints/step_00000100/``:

* DCP shards (``.metadata``, ``*.distcp``): model and optimizer state, resharded on load, so a run
  saved by 2 processes resumes on 1 and the reverse.
* ``trainer_state.json``: step, tokens seen, the step source's position (e.g. a global sample index),
  and the model's shape and tokenizer (see lmforge.training.state).
* ``rng_rank{R}.json``: each rank's torch/numpy/python RNG states.
* ``manifest.json``, written last: size and SHA-256 of every other file.

Atomicity: a checkpoint is written into ``step_X.partial`` and renamed to ``step_X`` only after every
rank has finished writing, the manifest is written and the files are flushed. A crash mid-save leaves
only a ``.partial`` directory, which never counts as a checkpoint and is removed by the next save; the
previous checkpoint is only pruned after the new one is in place.

Damage: before a checkpoint is loaded its files are checked against the manifest (missing, truncated
or altered files, or no manifest at all). The newest checkpoint that passes is used; a damaged one is
reported in one line and moved aside to ``step_X.damaged`` (``checkpoint.on_damaged=fallback``), or
the run stops with a one-line error (``on_damaged=stop``).

No code runs when a checkpoint is loaded: tensors go through ``torch.load(weights_only=True)``, the
small non-tensor values DCP stores (optimizer hyperparameters) are also read with ``weights_only=True``
(DCP's default planner would use unrestricted pickle), and DCP's ``.metadata`` file - a pickle - is
read by an unpickler that only admits DCP's own metadata classes, ``torch.Size``, dtypes and paths
(``lmforge/dcp_safe.py``).
Everything else is JSON. The checksums guard against damage, not against someone who can rewrite
the whole directory; the restricted loading is what makes a hostile checkpoint unable to run code.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from lmforge import distributed as dist_utils
from lmforge.checkpoint.dcp_safe import checkpoint_exception, one_line, quiet_dcp, safe_dcp_load
from lmforge.checkpoint.layout import (
    MANIFEST_FILE, STATE_FILE, RunDir, _step_of, fsync_dir, list_checkpoints, step_dir_name, write_json,
)
from lmforge.checkpoint.runlock import holds_run_lock
from lmforge.checkpoint.verify import cached_problem, checkpoint_problem, write_manifest
from lmforge.errors import UserError

_TRAINABLE_ONLY = StateDictOptions(ignore_frozen_params=True)
"""Leave frozen parameters out of a state dict (a no-op when every parameter trains; with LoRA the
checkpoint then holds only the adapters, and the frozen base comes from the base model it names)."""


# ---------------------------------------------------------------------------- RNG
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


# ---------------------------------------------------------------------------- the checkpointer
def _stderr_report(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Checkpointer:
    """Saves and restores full training state under ``run_dir/checkpoints``.

    ``report`` receives the one-line notice about a damaged checkpoint that was skipped (the runtime
    routes it to the MetricLogger); ``on_damaged="stop"`` raises a UserError instead. The run that
    owns the directory (its rank 0 holds the run lock) renames a damaged checkpoint to
    ``step_X.damaged``, so pruning can never keep it in place of intact ones; readers of another run's
    directory leave it as it is.
    """

    def __init__(self, run_dir: str | Path, keep: int = 2, on_damaged: str = "fallback",
                 report: Callable[[str], None] | None = None, *, root: str | Path | None = None) -> None:
        self.root = Path(root) if root is not None else RunDir(run_dir).checkpoints
        """Where the checkpoints go: ``run_dir/checkpoints``, or ``root`` (e.g. a fast memory-backed tier)."""
        self.keep = keep
        self.on_damaged = on_damaged
        self.report = report or _stderr_report
        self.run_dir = Path(run_dir)
        self._intact: set[Path] = set()
        """Checkpoints verified by a collective check on every rank (no cache shared with one-rank checks)."""

    def latest(self) -> Path | None:
        """The newest intact checkpoint, after dealing with damaged newer ones (collective)."""
        if dist_utils.rank() == 0:
            self._finish_interrupted_replace()
        dist_utils.barrier()
        for path in reversed(list_checkpoints(self.root)):
            problem = checkpoint_problem(path, collective=True)
            if problem is None:
                self._intact.add(path)
                return path
            if self.on_damaged == "stop":
                raise UserError(f"checkpoint {path} is damaged: {problem}; stopping (checkpoint.on_damaged=stop; "
                                f"set it to fallback to resume from the previous checkpoint)")
            done = "skipped it"
            if dist_utils.rank() == 0 and holds_run_lock(self.run_dir):
                aside = _unused_name(path.with_name(path.name + ".damaged"))
                os.replace(path, aside)
                done = f"moved to {aside.name}"
            dist_utils.barrier()
            self.report(f"warning: checkpoint {path.name} is damaged ({problem}); {done}, "
                        f"falling back to the previous checkpoint")
        return None

    def _finish_interrupted_replace(self) -> None:
        """A crash between the two renames of a replacing save leaves ``step_X.old`` alone: restore it."""
        if not self.root.is_dir():
            return
        for old in self.root.glob("step_*.old"):
            final = old.with_name(old.name[: -len(".old")])
            if final.exists():
                _remove(old)
            else:
                os.replace(old, final)

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
             trainer_state: dict[str, Any], rank_state: dict[str, Any] | None = None) -> Path:
        """Write a checkpoint of ``step`` atomically (collective: every rank must call it).

        ``rank_state``: tensors only this rank holds (e.g. the GRPO rollout being trained on), saved
        per rank and read back with ``weights_only`` loading by :meth:`load` at the same world size.

        Any failure (disk full, permissions) on any rank removes the ``.partial`` directory, leaves
        the previous checkpoints untouched and raises one UserError on every rank.
        """
        final = self.root / step_dir_name(step)
        partial = self.root / (step_dir_name(step) + ".partial")
        rank = dist_utils.rank()
        phases: list[tuple[bool, Callable[[], None]]] = [
            (rank == 0, lambda: self._start(partial)),
            (True, lambda: self._write_files(partial, step, model, optimizer, trainer_state, rank_state)),
            (True, lambda: write_manifest(partial, collective=True)),
            (rank == 0, lambda: self._commit(partial, final)),
        ]
        problem = None
        for mine, phase in phases:  # every rank takes part in every agreement, even with nothing to do
            problem = _agree(_attempt(phase) if mine else None)
            if problem is not None:
                break
        if problem is not None:
            problem += _full_disk_note(self.root, problem)  # measured before the .partial frees its space
            if rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
            dist_utils.barrier()
            previous = [p.name for p in list_checkpoints(self.root) if p != final]
            kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "no earlier checkpoint exists"
            raise UserError(f"checkpoint save at step {step} failed: {problem}; removed {partial.name}, {kept}")
        if rank == 0:
            self._prune()
        dist_utils.barrier()
        return final

    def _write_files(self, partial: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                     trainer_state: dict[str, Any], rank_state: dict[str, Any] | None = None) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        options = _save_options(model)
        if optimizer is not None:
            model_sd, optim_sd = get_state_dict(model, _parts(optimizer), options=options)
            state = {"model": model_sd, "optim": optim_sd}
        else:
            state = {"model": get_model_state_dict(model, options=options)}
        with quiet_dcp():
            dcp.save(state, checkpoint_id=str(partial))
        rank = dist_utils.rank()
        write_json(partial / f"rng_rank{rank}.json", capture_rng())
        if rank_state:
            torch.save(rank_state, partial / f"rank_state{rank}.pt")
        if rank == 0:
            write_json(partial / STATE_FILE, {"step": step, **trainer_state})

    def _start(self, partial: Path) -> None:
        self._remove_partials()
        partial.mkdir(parents=True)

    def _commit(self, partial: Path, final: Path) -> None:
        """The commit point: rename ``.partial`` into place (moving an older save of the same step aside)."""
        fsync_dir(partial)
        old = final.with_name(final.name + ".old")
        if final.exists():  # an earlier attempt saved this step already
            os.replace(final, old)
        os.replace(partial, final)
        fsync_dir(self.root)
        _remove(old)  # committed: clean-up of the replaced save can no longer fail the save

    def _remove_partials(self) -> None:
        """Leftovers of saves that were interrupted (only one run writes a run directory: see runlock)."""
        if self.root.is_dir():
            for p in self.root.glob("step_*.partial"):
                shutil.rmtree(p, ignore_errors=True)

    def _prune(self) -> None:
        for old in list_checkpoints(self.root)[: -self.keep]:
            _remove(old)

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """Verify, then restore model (and optimizer) in place; returns the trainer state; restores RNG."""
        path = Path(path)
        problem = None if path in self._intact else checkpoint_problem(path, collective=True)
        if problem is not None:
            raise UserError(f"checkpoint {path} is damaged: {problem}")
        trainer_state = read_trainer_state(path)
        if optimizer is not None:
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            model_sd, optim_sd = get_state_dict(model, _parts(optimizer), options=_TRAINABLE_ONLY)
            state = {"model": model_sd, "optim": optim_sd}
            safe_dcp_load(state, path)
            set_state_dict(model, _parts(optimizer), model_state_dict=state["model"], optim_state_dict=state["optim"],
                           options=_load_options(model))
        else:
            load_model_weights(path, model)
        rng_file = path / f"rng_rank{dist_utils.rank()}.json"
        if not rng_file.is_file():  # resumed on more ranks than saved: derive from rank 0's state
            rng_file = path / "rng_rank0.json"
        if rng_file.is_file():
            restore_rng(json.loads(rng_file.read_text()))
        trainer_state["rank_state"] = _read_rank_state(path)
        return trainer_state


def _full_disk_note(root: Path, problem: str) -> str:
    """Name a full disk that the error does not: torch's zip writer (``torch.save``) reports a short
    write as ``unexpected pos N vs M`` with no errno."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return ""
    return f" (its file system is full: {free:,} bytes free)" if free < (1 << 20) and "No space" not in problem else ""


def _remove(path: Path) -> None:
    """Remove a checkpoint directory, or only the link when it is a symlink (never what it points to)."""
    if path.is_symlink():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


def _read_rank_state(path: Path) -> dict[str, Any]:
    """This rank's own saved state, only if every rank of the saving run has one for this world size
    (at another world size the per-rank pieces no longer line up: the source starts afresh)."""
    files = list(path.glob("rank_state*.pt"))
    mine = path / f"rank_state{dist_utils.rank()}.pt"
    if len(files) != dist_utils.world_size() or not mine.is_file():
        return {}
    try:
        state = torch.load(mine, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - anything that is not plain tensors/containers is refused
        raise UserError(f"checkpoint {path}: refused {mine.name}: {type(e).__name__}") from None
    return state if isinstance(state, dict) else {}


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The checkpoint's JSON trainer state, checked before any tensor is loaded: a hand-edited or
    foreign file is refused with one line instead of failing half-way through a resume."""
    where = path / STATE_FILE
    try:
        state = json.loads(where.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"checkpoint {path}: unreadable {STATE_FILE} ({e})") from None
    if not isinstance(state, dict):
        raise UserError(f"{where}: expected a JSON object, found {type(state).__name__}")
    step = state.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise UserError(f"{where}: 'step' must be a non-negative integer, found {step!r}")
    named = _step_of(path)
    if named is not None and named != step:
        raise UserError(f"{where}: 'step' is {step} but the checkpoint directory is for step {named}")
    tokens = state.get("tokens_seen", 0)
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise UserError(f"{where}: 'tokens_seen' must be a non-negative integer, found {tokens!r}")
    for key in ("data", "model"):
        if key in state and not isinstance(state[key], dict):
            raise UserError(f"{where}: {key!r} must be a JSON object, found {type(state[key]).__name__}")
    return state


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run directory (its newest intact checkpoint); never collective.

    A damaged checkpoint named directly is an error; in a run directory damaged ones are skipped
    with a one-line warning (and left in place: this may be another run's directory).
    """
    p = Path(path)
    if (p / STATE_FILE).is_file() or (p / MANIFEST_FILE).is_file() or _step_of(p) is not None:
        problem = cached_problem(p)
        if problem is not None:
            raise UserError(f"checkpoint {p} is damaged: {problem}")
        return p
    for ckpt in reversed(list_checkpoints(RunDir(p).checkpoints)):
        problem = cached_problem(ckpt)
        if problem is None:
            return ckpt
        _stderr_report(f"warning: skipping damaged checkpoint {ckpt} ({problem})")
    raise UserError(f"no complete checkpoint found in {p}")


def load_model_weights(path: str | Path, model: nn.Module) -> None:
    """Load only the model weights of an lmforge checkpoint (e.g. to start SFT or GRPO from it).

    For a model with frozen parameters (LoRA) only the trainable ones are read: that is all a LoRA
    checkpoint holds; the frozen base comes from the base model it names.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    ckpt = resolve_checkpoint(path)
    model_sd = get_model_state_dict(model, options=_TRAINABLE_ONLY)
    state = {"model": model_sd}
    safe_dcp_load(state, ckpt)
    set_model_state_dict(model, state["model"], options=_load_options(model))


def _save_options(model: nn.Module) -> StateDictOptions:
    """What a save holds: with LoRA only what trains (the base is the model the run names); otherwise every
    weight, frozen parts (``model.freeze``: a vision tower kept as it started) included, so the checkpoint
    is the whole model. Loading reads what trains either way."""
    lora = any("lora_" in name for name, _ in model.named_parameters())
    return _TRAINABLE_ONLY if lora else StateDictOptions()


def _load_options(model: nn.Module) -> StateDictOptions:
    """Strict loading, except that frozen parameters (not in the checkpoint) are left as they are."""
    return StateDictOptions(strict=all(p.requires_grad for p in model.parameters()))


# ---------------------------------------------------------------------------- helpers
def _parts(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind the run's optimizer: Muon and AdamW side by side are two
    (``lmforge.optim.optimizers.OptimizerGroup``). DCP keys every state by parameter name, so the
    parts' states merge into one state dict and are split back on load."""
    return list(getattr(optimizer, "optimizers", [optimizer]))


def _attempt(fn: Callable[[], None]) -> str | None:
    """Run one save phase; a failure becomes a one-line reason instead of an exception."""
    try:
        fn()
        return None
    except (Exception, checkpoint_exception()) as e:
        return one_line(e)


def _agree(problem: str | None) -> str | None:
    """Every rank learns the first problem any rank had (a barrier as well)."""
    if not torch_dist.is_initialized() or torch_dist.get_world_size() == 1:
        return problem
    found: list[Any] = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(found, problem)
    return next((p for p in found if p is not None), None)


def _unused_name(p: Path) -> Path:
    n, candidate = 1, p
    while candidate.exists():
        n += 1
        candidate = p.with_name(f"{p.name}{n}")
    return candidate


