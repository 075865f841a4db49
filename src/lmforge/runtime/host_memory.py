"""Host memory that no tensor uses: glibc's malloc settings for large tensor buffers.

torch's CPU tensors come from ``malloc``. glibc serves a request above its mmap threshold with a
mapping of its own, unmapped when freed; anything smaller comes from a heap (an arena per thread),
which keeps what is freed for reuse. The threshold starts at 128 KiB but is *dynamic*: each freed
mapping raises it to that mapping's size, up to 32 MiB. So after the first frees of a train step,
the activation-sized buffers (a [2048, 576] fp32 tensor is 4.7 MB) all come from the heap, and at the
step's peak the holes between live tensors there are resident memory that no tensor uses: about 0.5 GB
of the 5.85 GB peak RSS of a SmolLM2-135M SFT step of 8 x 256 tokens in fp32 (``bench/sft_memory.py``),
and between steps the heap holds some 3 GB that no tensor uses.

:func:`map_large_buffers` fixes the threshold (``mallopt(M_MMAP_THRESHOLD)``, which also turns the
dynamic adjustment off): every buffer of 1 MiB or more is its own mapping and goes back to the OS when
freed, so resident memory follows the live tensors. The price is that a new buffer's pages are
zero-filled by the kernel on first touch instead of being reused warm: on that SFT step 6x the minor
page faults and about 3 s more system CPU time per step (hence ``training.release_host_memory`` is
opt-in: worth it where memory, not time, is short). Numerics are unaffected. Nothing is changed
where the user set ``MALLOC_MMAP_THRESHOLD_`` (their choice wins), nor off glibc (macOS, musl).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from functools import lru_cache
from typing import Any

__all__ = ["LARGE_BUFFER_BYTES", "map_large_buffers", "trim"]

LARGE_BUFFER_BYTES = 1 << 20
"""Buffers from this size up get their own mapping: far above the small objects of the interpreter
(which the heap serves best), below any activation of a model worth training."""
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


@lru_cache(maxsize=1)
def _glibc() -> Any | None:
    """The C library when it is glibc (it has ``mallopt`` and ``malloc_trim``), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


def map_large_buffers(threshold: int = LARGE_BUFFER_BYTES) -> str:
    """Serve every allocation of ``threshold`` bytes or more from its own mapping (see the module doc).

    Returns what was done, for the run's setup line: ``on``, or ``off (why)``.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return "off (MALLOC_MMAP_THRESHOLD_ set)"
    libc = _glibc()
    if libc is None:
        return "off (not glibc)"
    if libc.mallopt(_M_MMAP_THRESHOLD, threshold) != 1:
        return "off (mallopt refused)"
    return "on"


def trim() -> bool:
    """Hand the heap's free pages back to the OS (``malloc_trim``); False where nothing was returned
    or the C library is not glibc. Worth calling once after a phase that freed much (model loading)."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))
