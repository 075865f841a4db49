"""What the MetricLogger prints and when the process began: the shared console line, float conversion
of device metrics (one transfer), and the process start time goodput counts from."""

from __future__ import annotations

import math
from typing import Any

import torch


from lmforge.process import PROCESS_START, process_start_time  # noqa: F401 - re-exported
"""Wall-clock time when this process started: the start of the ``setup`` goodput category."""


def to_python(metrics: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Convert a dict of scalars/tensors to floats with one device-to-host transfer."""
    tensors = {k: v for k, v in metrics.items() if isinstance(v, torch.Tensor)}
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, torch.Tensor)}
    if tensors:
        stacked = torch.stack([t.detach().float().reshape(()) for t in tensors.values()]).cpu().tolist()
        out.update(zip(tensors.keys(), stacked))
    return out


def format_value(v: Any) -> str:
    """A metric value for the console: counts as integers, others with 4 significant digits."""
    if isinstance(v, float):
        if v == 0 or math.isnan(v) or math.isinf(v):
            return str(v)
        if v.is_integer() and abs(v) < 1e12:  # counts such as total_weights
            return str(int(v))
        if abs(v) >= 1e4 or abs(v) < 1e-3:
            return f"{v:.3e}"
        return f"{v:.4g}"
    return str(v)


def format_train_line(rec: dict[str, Any], trainer_keys: tuple[str, ...] = ("accuracy",)) -> str:
    """The per-step console line shared by all trainers: the same fields first everywhere, then lr and
    grad norm, then at most a handful of the trainer's own (``trainer_keys``) and MFU."""
    line = (
        f"completed step: {rec['step']}, seconds: {rec['seconds']:.3f}, "
        f"TFLOP/s/device: {rec['tflops_per_device']:.3f}, "
        f"Tokens/s/device: {rec['tokens_per_sec_per_device']:.1f}, "
        f"total_weights: {int(rec.get('total_weights', 0))}, loss: {rec.get('loss', float('nan')):.4f}"
    )
    for k in ("lr", "grad_norm", *trainer_keys):
        if k in rec:
            line += f", {k}: {format_value(rec[k])}"
    line += f", mfu: {100 * rec['mfu']:.1f}%"
    if "memory_gb" in rec:
        line += f", mem: {rec['memory_gb']:.2f} GB"
    if rec.get("world_size", 1) > 1:
        line += f", world_size: {rec['world_size']}"
    if rec.get("first_step"):
        line += " (first step: warm-up, not representative)"
    elif rec.get("steps_averaged", 1) > 1:
        line += f" (time averaged over {rec['steps_averaged']} steps)"
    return line
