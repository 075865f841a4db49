"""Guards around each step: non-finite loss/grad-norm checks, the loss-spike warning, stop signals."""

from __future__ import annotations

import math
import signal
from typing import Any

from lmforge.errors import UserError
from lmforge.metrics import to_python
from lmforge.training.runtime import Runtime
from lmforge.training.state import TrainState


class Guard:
    """Non-finite loss/grad-norm guard and loss-spike warning.

    ``training.nonfinite=stop`` checks the loss on log steps (no per-step sync), on every step on
    CPU, and before every checkpoint save; ``skip`` must look at the grad norm before every update, so
    the optimizer step reads it each step (``run_optimizer_step(skip_nonfinite=True)``) and the guard
    reports each skipped update.
    """

    def __init__(self, rt: Runtime, spike_factor: float) -> None:
        self.rt = rt
        self.mode = rt.cfg.training.nonfinite
        self.spike_factor = spike_factor
        self.every_step = rt.dist.device.type == "cpu" or self.mode == "skip"
        self.mean: float | None = None
        self.skipped = 0
        self.latest: tuple[int, dict[str, Any], dict[str, Any] | None] | None = None
        """(step, values, logged record) of the last finished step: what :meth:`before_save` checks."""
        self._checked = 0

    @property
    def skips_nonfinite(self) -> bool:
        """The optimizer step must drop updates with a non-finite grad norm (``training.nonfinite=skip``)."""
        return self.mode == "skip"

    def after_step(self, step: int, values: dict[str, Any], record: dict[str, Any] | None) -> None:
        self.latest = (step, values, record)
        if record is None and not self.every_step:
            return
        loss, grad_norm = self._read(values, record)
        self._checked = step
        if self.mode == "skip" and not math.isfinite(grad_norm):
            self.skipped += 1
            self.rt.metrics.record_event("nonfinite_skip", step, f"warning: step {step}: non-finite grad norm, "
                                         f"update skipped ({self.skipped} so far)", skipped_updates=self.skipped)
        if self.mode == "stop" and not (math.isfinite(loss) and math.isfinite(grad_norm)):
            where = f"at step {step}" if self.every_step else f"at step {step} (checked on log steps and before saves)"
            self._stop(step, loss, grad_norm, where)
        if math.isfinite(loss) and self.spike_factor and self.mean is not None and loss > self.spike_factor * self.mean:
            self.rt.metrics.record_event("loss_spike", step, f"warning: loss spike at step {step}: {loss:.4f} is "
                                         f"over {self.spike_factor:g}x the running mean {self.mean:.4f}", loss=loss)
        if math.isfinite(loss):
            self.mean = loss if self.mean is None else 0.9 * self.mean + 0.1 * loss

    def before_save(self) -> None:
        """Refuse to checkpoint a diverged model: with ``nonfinite=stop`` the latest step's loss and grad
        norm are read (one host transfer, unless that step was already checked) before every save, so
        every checkpoint on disk holds weights from finite steps."""
        if self.mode != "stop" or self.latest is None:
            return
        step, values, record = self.latest
        if self._checked == step:
            return  # after_step already read this step and let it pass
        loss, grad_norm = self._read(values, record)
        self._checked = step
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self._stop(step, loss, grad_norm, f"at step {step} (checked before saving it)")

    @staticmethod
    def _read(values: dict[str, Any], record: dict[str, Any] | None) -> tuple[float, float]:
        if record:
            return record["loss"], record.get("grad_norm", 0.0)
        read = to_python({"loss": values["loss"], "grad_norm": values.get("grad_norm", 0.0)})  # one transfer
        return read["loss"], read["grad_norm"]

    def _stop(self, step: int, loss: float, grad_norm: float, where: str) -> None:
        what = f"loss ({loss})" if not math.isfinite(loss) else f"grad norm ({grad_norm})"
        self.rt.metrics.record_event("nonfinite_stop", step, loss=loss, grad_norm=grad_norm)
        kept = (" Nothing was saved from this step on; every checkpoint written earlier was checked finite "
                "before it was saved." if self.rt.cfg.checkpoint.enabled else "")
        raise NonFiniteLoss(f"non-finite {what} {where}; stopping (set training.nonfinite=skip "
                            f"to skip such updates).{kept}")


class NonFiniteLoss(UserError):
    """The run diverged; reported in one line like a user error (exit 2), checkpoints untouched."""


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
