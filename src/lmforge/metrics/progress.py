"""A progress bar with an ETA for interactive runs, drawn below the per-step log lines.

The bar is a tqdm bar on stdout. Every console line of the run goes through :meth:`ProgressBar.write`
(tqdm clears the bar, prints the line, redraws the bar), so log lines are never cut or mixed with
bar text. ``metrics.progress=auto`` shows the bar only when stdout is a terminal: redirected to a
file or a pipe, the output stays plain lines.

The bar counts optimizer steps. Its total is the step budget or, when ``training.max_tokens`` ends
the run sooner, the step at which the token budget will be reached at the tokens per step seen so
far; tqdm's ETA follows from that total and the recent step rate.
"""

from __future__ import annotations

import math
import sys
from typing import Any, TextIO

import torch

_BAR_FORMAT = "{desc}{percentage:3.0f}%|{bar}| step {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]"


def progress_wanted(mode: str, stream: TextIO) -> bool:
    """``on``/``off`` as said; ``auto``: only when ``stream`` is an interactive terminal."""
    if mode == "on":
        return True
    if mode == "off":
        return False
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # closed stream
        return False


class ProgressBar:
    """Step progress with an ETA from the step budget or the token budget, whichever ends first.

    Implements what :class:`lmforge.metrics.MetricLogger` expects of its ``progress`` observer
    (``update(step, metrics)``, ``close()``) and serves as its console function (``write``).
    """

    def __init__(self, steps: int, max_tokens: int = 0, stream: TextIO | None = None) -> None:
        self.steps = steps
        self.max_tokens = max_tokens
        self.stream = stream or sys.stdout
        self.tokens = 0.0
        self._bar: Any = None

    def write(self, line: str) -> None:
        """Print one log line above the bar (console function of the MetricLogger)."""
        from tqdm import tqdm

        tqdm.write(line, file=self.stream)
        self.stream.flush()

    def expected_total(self, step: int) -> int:
        """The step at which the run will end: step budget, or token budget at the rate so far."""
        total = self.steps
        if self.max_tokens and self.tokens > 0 and step > 0:
            per_step = self.tokens / step
            remaining = max(self.max_tokens - self.tokens, 0.0)
            total = min(total, step + math.ceil(remaining / per_step))
        return max(total, step)

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        """Advance to ``step`` (called after every optimizer step)."""
        if self.max_tokens:
            # With a token budget the loop reads the step's token count every step anyway, so this
            # read adds no device synchronization of its own.
            weights = metrics.get("total_weights", 0.0)
            n = float(weights.item() if isinstance(weights, torch.Tensor) else weights)
            if self._bar is None and step > 1:  # resumed: assume earlier steps were the same size
                self.tokens = n * (step - 1)
            self.tokens += n
        if self._bar is None:
            from tqdm import tqdm

            # The bar starts after this process's first step: neither steps done before a resume nor
            # the warm-up of the first step count towards the rate the ETA is computed from.
            self._bar = tqdm(total=self.expected_total(step), initial=step, file=self.stream,
                             desc="train ", unit="step", bar_format=_BAR_FORMAT, dynamic_ncols=True,
                             leave=True, smoothing=0.1)
            return
        self._bar.total = self.expected_total(step)
        self._bar.update(step - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def progress_bar(mode: str, steps: int, max_tokens: int = 0, *, is_main: bool = True,
                 stream: TextIO | None = None) -> ProgressBar | None:
    """The bar for this run, or None where it is off (not a terminal, ``off``, or not rank 0)."""
    stream = stream or sys.stdout
    if not is_main or not progress_wanted(mode, stream):
        return None
    return ProgressBar(steps, max_tokens, stream)
