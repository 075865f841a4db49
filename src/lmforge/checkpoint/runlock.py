"""One live run per run directory: an advisory lock on ``RUN_DIR/.lock``, held by rank 0.

Two runs writing the same directory would interleave metrics and delete each other's checkpoints
(pruning, ``.partial`` cleanup). The lock is ``fcntl.flock`` on an open file: the kernel releases it
when the holding process dies, however it dies (SIGKILL included), so a stale ``.lock`` file left by
a crashed run never blocks a restart. The file holds the holder's pid and host, only to name it in
the refusal message.

:func:`claim_run_dir` is how a run takes its directory: rank 0 creates and locks it, and every rank
learns whether that worked.

Within one process the lock is re-entrant: sequential runs in the same Python process (tests,
notebooks) may reuse a run directory; a different process is refused.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from lmforge.distributed import broadcast_object
from lmforge.errors import UserError

LOCK_FILE = ".lock"

_HELD: dict[str, int] = {}
"""Resolved run directory -> file descriptor of the lock this process holds."""


def hold_run_lock(run_dir: str | Path) -> Path:
    """Take the run directory's lock for the rest of this process (or until :func:`release_run_lock`).

    Raises a UserError naming the holder when another live process holds it.
    """
    run_dir = Path(run_dir)
    key = str(run_dir.resolve())
    path = run_dir / LOCK_FILE
    if key in _HELD:
        return path
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise UserError(f"run.dir={run_dir}: cannot create {LOCK_FILE} ({e.strerror or e})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise UserError(f"run.dir={run_dir} is in use by another live run ({holder}); wait for it to end "
                        f"or choose another run.dir") from None
    except OSError as e:  # e.g. a file system without flock support
        os.close(fd)
        raise UserError(f"run.dir={run_dir}: cannot lock {LOCK_FILE} ({e.strerror or e})") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    _HELD[key] = fd
    return path


def holds_run_lock(run_dir: str | Path) -> bool:
    """Whether this process holds the run directory's lock (it owns the directory)."""
    return str(Path(run_dir).resolve()) in _HELD


def release_run_lock(run_dir: str | Path) -> None:
    """Give the lock back before the process ends (it is released at exit anyway)."""
    fd = _HELD.pop(str(Path(run_dir).resolve()), None)
    if fd is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text or "holder unknown"


def _prepare_run_dir(run_dir: Path) -> None:
    """Create the run directory, or fail with one line when it cannot be written."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write_test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise UserError(f"run.dir={run_dir}: cannot write the run directory ({e.strerror or e})") from None


def claim_run_dir(run_dir: Path, is_main: bool) -> None:
    """Rank 0 creates the run directory and locks it for this run (see the module docstring); if either fails,
    every rank raises the same one-line error instead of the others waiting in a collective."""
    problem = None
    if is_main:
        try:
            _prepare_run_dir(run_dir)
            hold_run_lock(run_dir)
        except UserError as e:
            problem = str(e)
    problem = broadcast_object(problem)
    if problem:
        raise UserError(problem)
