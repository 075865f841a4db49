"""Checkpoints with torch.distributed.checkpoint (DCP): atomic, verified, resumable at any world size.

Layout of ``RUN_DIR/checkpoints/step_00000100/``:

* DCP shards (``.metadata``, ``*.distcp``): model and optimizer state, resharded on load, so a run
  saved by 2 processes resumes on 1 and the reverse.
* ``trainer_state.json``: step, tokens seen, data position (a global sample index), trainer extras.
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

import hashlib
import json
import os
import random
import re
import shutil
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as torch_dist
from torch import nn

from lmforge.training import distributed as dist_utils
from lmforge.training.dcp_safe import safe_loading_classes
from lmforge.errors import UserError
from lmforge.training.runlock import holds_run_lock

STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
_STEP_DIR = re.compile(r"step_(\d+)")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _step_of(p: Path) -> int | None:
    m = _STEP_DIR.fullmatch(p.name)
    return int(m.group(1)) if m else None


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Committed checkpoint directories, oldest first, damaged or not.

    ``.partial`` (interrupted save), ``.old`` (being replaced) and ``.damaged`` (set aside) never count.
    """
    if not ckpt_root.is_dir():
        return []
    found = [p for p in ckpt_root.iterdir() if p.is_dir() and _step_of(p) is not None]
    return sorted(found, key=lambda p: _step_of(p))


# ---------------------------------------------------------------------------- verification
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


def _cached_problem(path: Path) -> str | None:
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


def _write_manifest(path: Path, collective: bool) -> None:
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name != MANIFEST_FILE)
    digests = _hash_files(files, collective)
    if dist_utils.rank() == 0:
        entries = {p.name: {"size": p.stat().st_size, "sha256": digests[p.name]} for p in files}
        _write_json(path / MANIFEST_FILE, {"format": 1, "files": entries})


# ---------------------------------------------------------------------------- code-free loading
def _checkpoint_exception() -> type[BaseException]:
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
    return CheckpointException


@contextmanager
def _quiet_dcp() -> Iterator[None]:
    with warnings.catch_warnings():  # single-process saves/loads are intended here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def safe_dcp_load(state: dict[str, Any], path: str | Path) -> None:
    """``dcp.load`` into ``state`` without executing code from the checkpoint (see module doc)."""
    import torch.distributed.checkpoint as dcp

    reader, planner = safe_loading_classes()
    try:
        with _quiet_dcp():
            dcp.load(state, storage_reader=reader(str(path)), planner=planner())
    except (Exception, _checkpoint_exception()) as e:
        if isinstance(e, UserError):
            raise
        raise UserError(f"checkpoint {path} could not be loaded: {_one_line(e)}") from None


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
        self.root = Path(root) if root is not None else Path(run_dir) / "checkpoints"
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
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(old, final)

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None,
             trainer_state: dict[str, Any]) -> Path:
        """Write a checkpoint of ``step`` atomically (collective: every rank must call it).

        Any failure (disk full, permissions) on any rank removes the ``.partial`` directory, leaves
        the previous checkpoints untouched and raises one UserError on every rank.
        """
        final = self.root / step_dir_name(step)
        partial = self.root / (step_dir_name(step) + ".partial")
        rank = dist_utils.rank()
        phases: list[tuple[bool, Callable[[], None]]] = [
            (rank == 0, lambda: self._start(partial)),
            (True, lambda: self._write_files(partial, step, model, optimizer, trainer_state)),
            (True, lambda: _write_manifest(partial, collective=True)),
            (rank == 0, lambda: self._commit(partial, final)),
        ]
        problem = None
        for mine, phase in phases:  # every rank takes part in every agreement, even with nothing to do
            problem = _agree(_attempt(phase) if mine else None)
            if problem is not None:
                break
        if problem is not None:
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
                     trainer_state: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if optimizer is not None:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
        else:
            state = {"model": get_model_state_dict(model)}
        with _quiet_dcp():
            dcp.save(state, checkpoint_id=str(partial))
        rank = dist_utils.rank()
        _write_json(partial / f"rng_rank{rank}.json", capture_rng())
        if rank == 0:
            _write_json(partial / STATE_FILE, {"step": step, **trainer_state})

    def _start(self, partial: Path) -> None:
        self._remove_partials()
        partial.mkdir(parents=True)

    def _commit(self, partial: Path, final: Path) -> None:
        """The commit point: rename ``.partial`` into place (moving an older save of the same step aside)."""
        _fsync_dir(partial)
        old = final.with_name(final.name + ".old")
        if final.exists():  # an earlier attempt saved this step already
            os.replace(final, old)
        os.replace(partial, final)
        _fsync_dir(self.root)
        if old.exists():
            shutil.rmtree(old)

    def _remove_partials(self) -> None:
        """Leftovers of saves that were interrupted (only one run writes a run directory: see runlock)."""
        if self.root.is_dir():
            for p in self.root.glob("step_*.partial"):
                shutil.rmtree(p, ignore_errors=True)

    def _prune(self) -> None:
        for old in list_checkpoints(self.root)[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """Verify, then restore model (and optimizer) in place; returns the trainer state; restores RNG."""
        path = Path(path)
        problem = None if path in self._intact else checkpoint_problem(path, collective=True)
        if problem is not None:
            raise UserError(f"checkpoint {path} is damaged: {problem}")
        trainer_state = read_trainer_state(path)
        if optimizer is not None:
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            safe_dcp_load(state, path)
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
    """A checkpoint directory, or a run directory (its newest intact checkpoint); never collective.

    A damaged checkpoint named directly is an error; in a run directory damaged ones are skipped
    with a one-line warning (and left in place: this may be another run's directory).
    """
    p = Path(path)
    if (p / STATE_FILE).is_file() or (p / MANIFEST_FILE).is_file() or _step_of(p) is not None:
        problem = _cached_problem(p)
        if problem is not None:
            raise UserError(f"checkpoint {p} is damaged: {problem}")
        return p
    for ckpt in reversed(list_checkpoints(p / "checkpoints")):
        problem = _cached_problem(ckpt)
        if problem is None:
            return ckpt
        _stderr_report(f"warning: skipping damaged checkpoint {ckpt} ({problem})")
    raise UserError(f"no complete checkpoint found in {p}")


def load_model_weights(path: str | Path, model: nn.Module) -> None:
    """Load only the model weights of an lmforge checkpoint (e.g. to start SFT or GRPO from it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    ckpt = resolve_checkpoint(path)
    model_sd = get_model_state_dict(model)
    state = {"model": model_sd}
    safe_dcp_load(state, ckpt)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))


# ---------------------------------------------------------------------------- helpers
def _attempt(fn: Callable[[], None]) -> str | None:
    """Run one save phase; a failure becomes a one-line reason instead of an exception."""
    try:
        fn()
        return None
    except (Exception, _checkpoint_exception()) as e:
        return _one_line(e)


def _agree(problem: str | None) -> str | None:
    """Every rank learns the first problem any rank had (a barrier as well)."""
    if not torch_dist.is_initialized() or torch_dist.get_world_size() == 1:
        return problem
    found: list[Any] = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(found, problem)
    return next((p for p in found if p is not None), None)


def _one_line(e: BaseException) -> str:
    """The root cause of an error in one line: DCP wraps the real OSError in per-rank tracebacks."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        return _one_line(inner[0] if isinstance(inner, tuple) else inner)
    while isinstance(e.__cause__, BaseException) and not isinstance(e, OSError):
        e = e.__cause__
    if isinstance(e, OSError) and e.strerror:
        where = f" ({e.filename})" if e.filename else ""
        return f"{e.strerror}{where}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}".strip()


def _unused_name(p: Path) -> Path:
    n, candidate = 1, p
    while candidate.exists():
        n += 1
        candidate = p.with_name(f"{p.name}{n}")
    return candidate


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


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
