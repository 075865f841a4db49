"""What the MetricLogger asks of the training device: a wait for its queued work, and its peak memory."""

from __future__ import annotations

import resource
import sys
from typing import Callable

import torch


def device_synchronizer(device: torch.device | str | None) -> Callable[[], None] | None:
    """A function that waits for ``device``'s queued work, or None on CPU (work there is synchronous)."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cpu":
        return None
    accel = getattr(torch, "accelerator", None)
    if accel is not None and hasattr(accel, "synchronize"):
        return lambda: accel.synchronize(device)
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return None


def peak_memory_bytes(device: torch.device | str | None, reset: bool = False) -> int:
    """Peak memory since the last reset: GPU bytes allocated by tensors, or CPU peak resident set size."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return peak
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return int(rss if sys.platform == "darwin" else rss * 1024)
