"""The learning-rate schedule: a pure function of the optimizer step."""

from __future__ import annotations

import math


def learning_rate(step: int, *, base_lr: float, total_steps: int, kind: str, warmup_steps: int,
                  min_lr_ratio: float, decay_fraction: float = 0.2) -> float:
    """LR for optimizer step ``step`` (1-based): linear warmup, then cosine/linear/constant/wsd.

    A pure function of the step, so a resumed run needs nothing but the step to continue exactly.
    """
    if warmup_steps and step <= warmup_steps:
        return base_lr * step / warmup_steps
    min_lr = base_lr * min_lr_ratio
    if kind == "constant":
        return base_lr
    if kind == "wsd":
        decay_start = total_steps - int(decay_fraction * total_steps)
        if step <= decay_start:
            return base_lr
        frac = (step - decay_start) / max(total_steps - decay_start, 1)
        return base_lr - (base_lr - min_lr) * min(frac, 1.0)
    frac = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    if kind == "linear":
        return base_lr - (base_lr - min_lr) * frac
    return min_lr + 0.5 * (base_lr - min_lr) * (1 + math.cos(math.pi * frac))
