"""SIGTERM and SIGINT as requests to stop after the current step."""

from __future__ import annotations

import signal
from typing import Any

from lmforge.training.state import TrainState


class StopSignals:
    """SIGTERM/SIGINT ask the loop to stop after the current step, save, and exit 0."""

    def __init__(self, state: TrainState) -> None:
        self.state = state
        self.previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if (self.state.stop_signal or self.state.stop_requested) and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.state.stop_signal = signal.Signals(signum).name  # acted on once the ranks agree

    def __enter__(self) -> "StopSignals":
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self.previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
