"""The training loop shared by the pretraining, SFT and elastic trainers, and its helpers.

GRPO has its own loop (rollouts, then updates) but calls the same helpers: resume, checkpoint,
evaluate, stop signals, guards.
"""

from __future__ import annotations

import json
import math
import signal
import time
from typing import Any, Callable, Iterable, Iterator

import torch

from lmforge.training import distributed as dist_utils
from lmforge.data.loader import StepLoader
from lmforge.data.packing import Batch
from lmforge.errors import UserError
from lmforge.metrics import to_python
from lmforge.training.runtime import Runtime
from lmforge.training.train_step import (
    LossFn, Progress, compute_global_loss, global_target_count, gradient_computation,
    learning_rate, run_optimizer_step, should_continue_training,
)

EvalFn = Callable[[Runtime], "dict[str, torch.Tensor | float]"]


def train(rt: Runtime, loader: StepLoader, loss_fn: LossFn, run_eval: EvalFn | None) -> Progress:
    """Run steps until a budget or a stop request ends the run; eval and checkpoint on schedule."""
    metrics = rt.metrics
    progress = resume(rt, loader)
    guard = Guard(rt)
    with StopSignals(progress):
        for step in training_steps(rt, progress):
            t0 = time.perf_counter()
            microbatches = loader.next_step()
            data_wait = time.perf_counter() - t0
            normalizer = global_target_count(microbatches)
            stats = gradient_computation(rt.model, microbatches, loss_fn, normalizer, rt.autocast())
            grad_norm = guard.optimizer_step(step, lr := lr_at(rt, step))
            progress.step = step
            values = compute_global_loss(stats) | {"lr": lr, "grad_norm": grad_norm}
            record = metrics.record_step(step, tokens=sum(mb.input_ids.numel() for mb in microbatches),
                                         metrics=values, data_wait=data_wait, lost=step <= progress_redo(rt))
            guard.after_step(step, values, record)
            end_of_step(rt, progress, loader, values["total_weights"], record is not None, run_eval)
        finish(rt, progress, loader, run_eval)
    return progress


def training_steps(rt: Runtime, progress: Progress) -> Iterator[int]:
    """Start the training clock, then yield the next step number while no budget or stop says halt."""
    rt.metrics.start_clock()
    while should_continue_training(progress, rt.cfg.training)[0]:
        yield progress.step + 1


def lr_at(rt: Runtime, step: int) -> float:
    s, o = rt.cfg.schedule, rt.cfg.optimizer
    return learning_rate(step, base_lr=o.lr, total_steps=rt.cfg.training.steps, kind=s.kind,
                         warmup_steps=s.warmup_steps, min_lr_ratio=s.min_lr_ratio, decay_fraction=s.decay_fraction)


def progress_redo(rt: Runtime) -> int:
    return rt.extras.get("redo_until", 0)


def end_of_step(rt: Runtime, progress: Progress, loader: Any, total_weights: torch.Tensor, logged: bool,
                run_eval: EvalFn | None, extra_state: Callable[[], dict] | None = None) -> None:
    """Token count, periodic eval and checkpoint, and the cross-rank stop agreement."""
    cfg = rt.cfg
    pending = rt.extras.setdefault("pending_tokens", [])
    pending.append(total_weights)
    if logged or cfg.training.max_tokens:  # host transfer only where a decision needs it
        progress.tokens_seen += int(torch.stack(pending).sum().item())
        pending.clear()
    step = progress.step
    if run_eval and cfg.eval.interval and step % cfg.eval.interval == 0 and step < cfg.training.steps:
        do_eval(rt, progress, run_eval)
    if cfg.checkpoint.enabled and cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0 \
            and step < cfg.training.steps:
        save(rt, progress, loader, extra_state)
    if rt.dist.world_size == 1 or logged:
        progress.training_seconds = dist_utils.all_reduce_max(rt.metrics.training_seconds)
        stop = dist_utils.all_reduce_max(1.0 if progress.stop_requested else 0.0)
        if stop and not progress.stop_requested:
            progress.stop_requested = "another rank received a stop signal"
    for hook in rt.step_hooks:  # trainer additions, e.g. the elastic snapshot tier
        hook(progress, loader)


def finish(rt: Runtime, progress: Progress, loader: Any, run_eval: EvalFn | None,
           extra_state: Callable[[], dict] | None = None) -> None:
    """Log why the run stopped, final eval (unless asked to stop), final checkpoint, goodput summary."""
    reason = should_continue_training(progress, rt.cfg.training)[1]
    pending = rt.extras.get("pending_tokens", [])
    if pending:
        progress.tokens_seen += int(torch.stack(pending).sum().item())
        pending.clear()
    rt.metrics.record_event("stop", progress.step, f"stopping after step {progress.step}: {reason}",
                            reason=reason, tokens_seen=progress.tokens_seen)
    if run_eval and rt.cfg.eval.interval and not progress.stop_requested:
        do_eval(rt, progress, run_eval)
    if rt.cfg.checkpoint.enabled and progress.step > 0:
        path = save(rt, progress, loader, extra_state)
        rt.metrics.console(f"checkpoint: {path}")
    rt.metrics.log_goodput(progress.step, final=True)


def do_eval(rt: Runtime, progress: Progress, run_eval: EvalFn) -> dict[str, Any]:
    t0 = time.perf_counter()
    with rt.metrics.timed("eval"):
        values = run_eval(rt)
    rec = rt.metrics.record_eval(progress.step, values, time.perf_counter() - t0)
    if "loss" in rec:
        progress.last_eval_loss = rec["loss"]
    return rec


def evaluate_loss(rt: Runtime, batches: Iterable[Batch], loss_fn: LossFn) -> dict[str, torch.Tensor]:
    """Token-weighted loss over all eval batches and ranks; the sums start from zero every call."""
    model = rt.model
    was_training = model.training
    model.eval()
    totals: dict[str, torch.Tensor] = {}
    with torch.no_grad(), rt.autocast():
        for batch in batches:
            _, stats = loss_fn(model, batch.to(rt.dist.device))
            for k, v in stats.items():
                totals[k] = totals[k] + v if k in totals else v.detach().clone()
    model.train(was_training)
    if not totals:
        raise UserError("eval produced no batches: the validation set is smaller than one eval batch")
    return compute_global_loss(totals)


def save(rt: Runtime, progress: Progress, loader: Any, extra_state: Callable[[], dict] | None = None,
         checkpointer: Any = None):
    """Save the full training state with ``rt.checkpointer`` (or another one, e.g. a snapshot tier)."""
    checkpointer = checkpointer or rt.checkpointer
    with rt.metrics.timed("checkpoint_save"):
        state = {"tokens_seen": progress.tokens_seen, "data": loader.state_dict(),
                 "last_eval_loss": progress.last_eval_loss, "world_size": rt.dist.world_size}
        if extra_state:
            state["extra"] = extra_state()
        return checkpointer.save(progress.step, rt.model, rt.optimizer, state)


def resume(rt: Runtime, loader: Any) -> Progress:
    """Continue from the newest complete checkpoint of the run directory, if any."""
    progress = Progress()
    if rt.cfg.checkpoint.resume == "never":
        return progress
    path = rt.checkpointer.latest()
    if path is None:
        return progress
    with rt.metrics.timed("checkpoint_restore"):
        state = rt.checkpointer.load(path, rt.model, rt.optimizer)
        loader.load_state_dict(state["data"])
    progress.step = state["step"]
    progress.tokens_seen = state.get("tokens_seen", 0)
    progress.last_eval_loss = state.get("last_eval_loss")
    rt.extras["resumed_state"] = state
    rt.extras["redo_until"] = last_logged_step(rt)
    rt.metrics.record_event("resume", progress.step, f"resumed from {path} at step {progress.step}",
                            path=str(path), saved_world_size=state.get("world_size", 0))
    return progress


def last_logged_step(rt: Runtime) -> int:
    """The highest train step a previous attempt logged in this run directory (0 if none)."""
    f = rt.run_dir / "metrics.jsonl"
    last = 0
    if f.is_file():
        for line in f.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("kind") == "train":
                last = max(last, int(rec["step"]))
    return last


class Guard:
    """Non-finite loss/grad-norm guard and loss-spike warning.

    ``training.nonfinite=stop`` checks the loss on log steps (no per-step sync) and on every step on
    CPU; ``skip`` must look at the grad norm before every update, so it reads it each step.
    """

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.mode = rt.cfg.training.nonfinite
        self.spike_factor = rt.cfg.training.spike_factor
        self.every_step = rt.dist.device.type == "cpu" or self.mode == "skip"
        self.mean: float | None = None
        self.skipped = 0

    def optimizer_step(self, step: int, lr: float) -> torch.Tensor:
        rt = self.rt
        if self.mode != "skip":
            return run_optimizer_step(rt.model, rt.optimizer, lr, rt.cfg.optimizer.grad_clip)
        params = [p for p in rt.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        if not math.isfinite(float(norm)):
            rt.optimizer.zero_grad(set_to_none=True)
            self.skipped += 1
            rt.metrics.record_event("nonfinite_skip", step, f"warning: step {step}: non-finite grad norm, "
                                    f"update skipped ({self.skipped} so far)", skipped_updates=self.skipped)
            return norm
        return run_optimizer_step(rt.model, rt.optimizer, lr, rt.cfg.optimizer.grad_clip)

    def after_step(self, step: int, values: dict[str, Any], record: dict[str, Any] | None) -> None:
        if record is None and not self.every_step:
            return
        if record:
            loss, grad_norm = record["loss"], record.get("grad_norm", 0.0)
        else:  # one host transfer for both
            read = to_python({"loss": values["loss"], "grad_norm": values.get("grad_norm", 0.0)})
            loss, grad_norm = read["loss"], read["grad_norm"]
        if self.mode == "stop" and not (math.isfinite(loss) and math.isfinite(grad_norm)):
            what = f"loss ({loss})" if not math.isfinite(loss) else f"grad norm ({grad_norm})"
            where = f"at step {step}" if self.every_step else f"at step {step} (checked on log steps)"
            self.rt.metrics.record_event("nonfinite_stop", step, loss=loss, grad_norm=grad_norm)
            kept = " The last checkpoint is intact." if self.rt.cfg.checkpoint.enabled else ""
            raise NonFiniteLoss(f"non-finite {what} {where}; stopping (set training.nonfinite=skip "
                                f"to skip such updates).{kept}")
        if math.isfinite(loss) and self.spike_factor and self.mean is not None and loss > self.spike_factor * self.mean:
            self.rt.metrics.record_event("loss_spike", step, f"warning: loss spike at step {step}: {loss:.4f} is "
                                         f"over {self.spike_factor:g}x the running mean {self.mean:.4f}", loss=loss)
        if math.isfinite(loss):
            self.mean = loss if self.mean is None else 0.9 * self.mean + 0.1 * loss


class NonFiniteLoss(UserError):
    """The run diverged; reported in one line like a user error (exit 2), checkpoints untouched."""


class StopSignals:
    """SIGTERM/SIGINT ask the loop to stop after the current step, save, and exit 0."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.progress.stop_requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.progress.stop_requested = signal.Signals(signum).name

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
