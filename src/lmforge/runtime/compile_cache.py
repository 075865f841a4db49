"""``training.compile``: persistent compilation caches, and ``"auto"``, which compiles when it pays.

**Caches.** Inductor's FX-graph cache and AOT-autograd's cache let a second compile of the same graphs
load the generated kernels instead of rebuilding them. torch keeps them under ``/tmp/torchinductor_$USER``
by default: shared by every program, and gone after a reboot. lmforge points them
(``TORCHINDUCTOR_CACHE_DIR``) at a directory it owns, ``~/.cache/lmforge/compile/torch-<version>``
(``$LMFORGE_CACHE_DIR`` replaces ``~/.cache/lmforge``; a ``TORCHINDUCTOR_CACHE_DIR`` already set is
kept): one directory per torch version, so an upgrade never reads another version's artifacts (the
caches' own keys also hash torch, the graph, the shapes and the config; a mismatch is a miss, never a
wrong kernel). Both caches are switched on explicitly, whatever torch's defaults are.

**``auto``.** Compiling costs seconds up front and saves a share of every step after, so it pays when

    estimated run seconds x (1 - 1 / SPEEDUP) > compile seconds

with the run's seconds estimated as ``steps`` x (training FLOPs of a step / (the device's peak x
``ASSUMED_MFU``)), capped by ``training.max_seconds``; the compile cost is ``WARM_SECONDS`` when this
cache already holds a compile of the same model shape, sequence length, micro-batch, dtype and layout
(a marker lmforge writes after a compiled block's first forward), else ``COLD_SECONDS``. The constants
are measured (docs/performance.md, BENCHMARKS.md). The setup line gives the decision and its numbers.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

import torch

__all__ = ["choose_compile", "compile_cache_dir", "enable_compile_caches", "mark_compiled", "shape_key"]

SPEEDUP = 1.2
"""Step-time speedup of compiled blocks (measured 1.20x on ``debug``, 1.27x on ``small`` bf16, CPU)."""

COLD_SECONDS = 45.0
"""Compile cost with an empty cache (measured 13-55 s on the CPU, blocks of the decoder plan)."""

WARM_SECONDS = 8.0
"""Compile cost when the cache holds the same shapes (Dynamo still traces; kernels are loaded)."""

ASSUMED_MFU = 0.3
"""Share of the device's peak a step is assumed to reach, to turn FLOPs into seconds before any step."""


def compile_cache_dir() -> Path:
    """The directory of this torch version's caches (see the module docstring)."""
    base = Path(os.environ.get("LMFORGE_CACHE_DIR") or Path.home() / ".cache" / "lmforge")
    version = re.sub(r"[^A-Za-z0-9._+-]", "_", torch.__version__)
    return base / "compile" / f"torch-{version}"


def enable_compile_caches() -> str:
    """Point Inductor's caches at lmforge's directory (unless ``TORCHINDUCTOR_CACHE_DIR`` is set) and switch
    the FX-graph and AOT-autograd caches on. Returns the directory in use."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache_dir())
    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def shape_key(*parts: Any) -> str:
    """A short, filesystem-safe key of what a compile depends on (model shape, lengths, dtype, layout)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def _marker(key: str) -> Path:
    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or compile_cache_dir()) / "lmforge" / key


def mark_compiled(key: str) -> None:
    """Record that this cache holds a compile of ``key``'s shapes (best effort: a read-only cache is fine)."""
    try:
        path = _marker(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError:
        pass


def choose_compile(setting: bool | str, steps: int, step_flops: float, peak_flops: float, max_seconds: float,
                   key: str) -> tuple[bool, str]:
    """Whether to compile for ``training.compile = setting``, and why (the setup line's ``compile_reason``).

    ``step_flops``: training FLOPs of one optimizer step on this device; ``peak_flops``: the device's peak.
    """
    if setting is not True and setting is not False and setting != "auto":
        raise ValueError(f"training.compile={setting!r}")
    if setting != "auto":
        return bool(setting), "training.compile"
    step_s = step_flops / max(peak_flops * ASSUMED_MFU, 1.0)
    run_s = steps * step_s if not max_seconds else min(steps * step_s, max_seconds)
    saved = run_s * (1 - 1 / SPEEDUP)
    warm = _marker(key).exists()
    cost = WARM_SECONDS if warm else COLD_SECONDS
    numbers = (f"~{run_s:,.0f} s estimated ({steps} steps x {step_s:.3g} s at {ASSUMED_MFU:g} MFU), "
               f"{SPEEDUP:g}x saves ~{saved:,.0f} s")
    cache = "cache warm for these shapes" if warm else "cache cold"
    if saved > cost:
        return True, f"auto: {numbers} > ~{cost:g} s to compile ({cache})"
    return False, f"auto: {numbers} <= ~{cost:g} s to compile ({cache})"
