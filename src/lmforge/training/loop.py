"""The training loop: the only one, run by every recipe (pretraining, SFT, preference methods, GRPO, distillation, reward models).

A trainer hands :func:`train` two things and nothing else:

* a **step source** (:class:`StepSource`): what yields each step's microbatches. The packed data
  loader for every recipe but GRPO; for GRPO a rollout buffer that samples a new rollout
  every ``num_iterations`` steps (its sampling time is its own goodput category, ``rollout``).
* an **objective** (:class:`Objective`): the loss function, its global normalizer, and how the
  summed statistics become logged values.

Everything else (resume, stop signals, guards, the train-step pieces, metrics, eval and checkpoint
schedule, the stop agreement across ranks, the final save) is here, once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from lmforge import distributed as dist_utils
from lmforge.distributed import EVERY_RANK, ReduceGroup
from lmforge.training.checkpointing import resume, save
from lmforge.training.signals import StopSignals
from lmforge.runtime import Runtime
from lmforge.optim.schedule import learning_rate
from lmforge.training.state import TrainState
from lmforge.training.train_step import (
    LossFn, compute_global_loss, gradient_computation, run_optimizer_step, should_continue_training,
)

EvalFn = Callable[[Runtime, int], "dict[str, torch.Tensor | float]"]
"""``evaluate(rt, step)``: the eval values after ``step`` optimizer steps."""


@dataclass
class StepBatch:
    """One optimizer step's input on this rank."""

    microbatches: list[Any]
    tokens: int
    """Input tokens this rank processes in the step (padding included): the throughput numerator."""
    flops: float = 0.0
    """Training FLOPs of the step's real tokens on this rank (:func:`lmforge.models.flops.training_flops`),
    computed on the host when the batch is built: the TFLOP/s and MFU numerator."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """Values the source measured for this step (e.g. rollout rewards), logged with the step."""


@dataclass
class Job:
    """What a recipe hands the loop: its step source, its objective and its eval function."""

    source: "StepSource"
    objective: "Objective"
    evaluate: EvalFn | None = None
    """``evaluate(rt, step) -> values``, or None: no eval of the recipe's own."""


class StepSource(Protocol):
    def next_step(self, step: int) -> StepBatch: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def rank_state(self) -> dict[str, Any]:
        """Tensors only this rank holds that a resume needs (GRPO: the rollout still being trained on)."""
    def load_rank_state(self, state: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class Objective(Protocol):
    loss_fn: LossFn
    console_keys: tuple[str, ...]
    """Trainer fields shown on the console line after the shared ones (all fields go to JSONL/TB)."""
    watch_spikes: bool
    """Whether a loss far above its running mean means trouble (not for losses near 0 of either sign)."""

    def normalizer(self, microbatches: list[Any], reduce: ReduceGroup = EVERY_RANK) -> torch.Tensor:
        """The step's global normalizer: summed over the microbatches and the ranks of ``reduce``."""
    def log_values(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


def train(rt: Runtime, source: StepSource, objective: Objective, evaluate: EvalFn | None) -> TrainState:
    """Run steps until a budget or a stop request ends the run; eval and checkpoint on schedule."""
    state = resume(rt, source)
    rt.open_run_dir()  # every start-up check has passed: only now is the run directory written
    guard, reduce = rt.guard, rt.world.dist.reduce
    if not objective.watch_spikes:
        guard.spike_factor = 0.0
    with StopSignals(state):
        if evaluate and rt.cfg.eval.at_start and rt.cfg.eval.interval and state.step == 0:
            do_eval(rt, state, evaluate)  # the starting model's scores, before the clock starts
        rt.metrics.start_clock()
        while should_continue_training(state, rt.cfg.training)[0]:
            step = state.step + 1
            with rt.metrics.waiting_for_data() as wait:
                batch = source.next_step(step)
            normalizer = objective.normalizer(batch.microbatches, reduce)
            stats = gradient_computation(rt.model.module, batch.microbatches, objective.loss_fn, normalizer,
                                         rt.model.autocast(), reduce)
            grad_norm = run_optimizer_step(rt.model.module, rt.optimizer, lr := lr_at(rt, step), rt.cfg.optimizer.grad_clip,
                                           skip_nonfinite=guard.skips_nonfinite)
            state.step = step
            totals = compute_global_loss(stats, reduce)
            if rt.model.spec.after_optimizer_step is not None:  # the family's own update, e.g. MoE bias balancing
                rt.model.spec.after_optimizer_step(rt.model.raw, rt.model.args, totals)
            values = objective.log_values(totals) | batch.metrics | {"lr": lr, "grad_norm": grad_norm}
            record = rt.metrics.record_step(step, tokens=batch.tokens, flops=batch.flops, metrics=values, data_wait=wait.seconds,
                                            lost=step <= state.redo_until, console_keys=objective.console_keys)
            guard.after_step(step, values, record)
            end_of_step(rt, state, source, values["total_weights"], logged=record is not None, evaluate=evaluate)
        finish(rt, state, source, evaluate)
    return state


def lr_at(rt: Runtime, step: int) -> float:
    s, o = rt.cfg.schedule, rt.cfg.optimizer
    return learning_rate(step, base_lr=o.lr, total_steps=rt.cfg.training.steps, kind=s.kind,
                         warmup_steps=s.warmup_steps, min_lr_ratio=s.min_lr_ratio, decay_fraction=s.decay_fraction)


def end_of_step(rt: Runtime, state: TrainState, source: StepSource, total_weights: torch.Tensor, *, logged: bool,
                evaluate: EvalFn | None) -> None:
    """Token count, periodic eval and checkpoint, the cross-rank stop agreement, the runtime's hooks."""
    cfg, step = rt.cfg, state.step
    state.count_tokens(total_weights, read_now=logged or bool(cfg.training.max_tokens))
    if evaluate and cfg.eval.interval and step % cfg.eval.interval == 0 and step < cfg.training.steps:
        do_eval(rt, state, evaluate)
    if cfg.checkpoint.enabled and cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0 \
            and step < cfg.training.steps:
        save(rt, state, source)
    if rt.world.dist.world_size == 1 or logged:  # collectives only where every rank takes part
        # A stop signal counts once every rank has agreed on it, here at the same step everywhere; a rank
        # acting on its own signal would save while the others train on, and both would wait forever.
        state.training_seconds = dist_utils.all_reduce_max(rt.metrics.training_seconds)
        stop = dist_utils.all_reduce_max(1.0 if state.stop_signal else 0.0)
        if stop and not state.stop_requested:
            state.stop_requested = state.stop_signal or "another rank received a stop signal"
    for hook in rt.step_hooks:  # given at construction, e.g. the elastic mode's snapshots
        hook(rt, state, source)


def finish(rt: Runtime, state: TrainState, source: StepSource, evaluate: EvalFn | None) -> None:
    """Log why the run stopped, final eval (unless asked to stop), final checkpoint, goodput summary."""
    reason = should_continue_training(state, rt.cfg.training)[1]
    state.flush_tokens()
    rt.metrics.record_event("stop", state.step, f"stopping after step {state.step}: {reason}",
                            reason=reason, tokens_seen=state.tokens_seen)
    if evaluate and rt.cfg.eval.interval and not state.stop_requested:
        do_eval(rt, state, evaluate)
    if rt.cfg.checkpoint.enabled and state.step > 0:
        path = save(rt, state, source)
        rt.metrics.console(f"checkpoint: {path}")
    rt.metrics.log_goodput(state.step, final=True)


def do_eval(rt: Runtime, state: TrainState, evaluate: EvalFn) -> dict[str, Any]:
    t0 = time.perf_counter()
    with rt.metrics.timed("eval"):
        values = evaluate(rt, state.step)
    rec = rt.metrics.record_eval(state.step, values, time.perf_counter() - t0)
    if "loss" in rec:
        state.last_eval_loss = rec["loss"]
    return rec
