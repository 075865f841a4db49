"""The guard around each step: non-finite loss/grad-norm checks and the loss-spike warning."""

from __future__ import annotations

import math
from typing import Any

from lmforge.config import CheckpointSection, TrainingSection
from lmforge.errors import UserError
from lmforge.metrics import MetricLogger, to_python


class Guard:
    """Non-finite loss/grad-norm guard and loss-spike warning.

    ``training.nonfinite=stop`` checks the loss on log steps (no per-step sync), on every step on
    CPU, and before every checkpoint save; ``skip`` must look at the grad norm before every update, so
    the optimizer step reads it each step (``run_optimizer_step(skip_nonfinite=True)``) and the guard
    reports each skipped update.
    """

    def __init__(self, metrics: MetricLogger, mode: str, spike_factor: float, device_type: str,
                 checkpoints_enabled: bool) -> None:
        self.metrics = metrics
        self.mode = mode
        self.spike_factor = spike_factor
        """0 turns the spike warning off (the loop does for objectives whose loss is not watched)."""
        self.every_step = device_type == "cpu" or self.mode == "skip"
        self.checkpoints_enabled = checkpoints_enabled
        self.mean: float | None = None
        self.skipped = 0
        self.latest: tuple[int, dict[str, Any], dict[str, Any] | None] | None = None
        """(step, values, logged record) of the last finished step: what :meth:`before_save` checks."""
        self._checked = 0

    @classmethod
    def from_section(cls, training: TrainingSection, checkpoint: CheckpointSection, metrics: MetricLogger,
                     device_type: str) -> "Guard":
        """The guard ``[training]`` asks for (``nonfinite``, ``spike_factor``), checking saves where
        ``[checkpoint]`` makes any."""
        return cls(metrics, training.nonfinite, training.spike_factor, device_type, checkpoint.enabled)

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
            self.metrics.record_event("nonfinite_skip", step, f"warning: step {step}: non-finite grad norm, "
                                         f"update skipped ({self.skipped} so far)", skipped_updates=self.skipped)
        if self.mode == "stop" and not (math.isfinite(loss) and math.isfinite(grad_norm)):
            where = f"at step {step}" if self.every_step else f"at step {step} (checked on log steps and before saves)"
            self._stop(step, loss, grad_norm, where)
        if math.isfinite(loss) and self.spike_factor and self.mean is not None and loss > self.spike_factor * self.mean:
            self.metrics.record_event("loss_spike", step, f"warning: loss spike at step {step}: {loss:.4f} is "
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
        self.metrics.record_event("nonfinite_stop", step, loss=loss, grad_norm=grad_norm)
        kept = (" Nothing was saved from this step on; every checkpoint written earlier was checked finite "
                "before it was saved." if self.checkpoints_enabled else "")
        raise NonFiniteLoss(f"non-finite {what} {where}; stopping (set training.nonfinite=skip "
                            f"to skip such updates).{kept}")


class NonFiniteLoss(UserError):
    """The run diverged; reported in one line like a user error (exit 2), checkpoints untouched."""
