"""The elastic mode: any trainer under torchrun's elastic agent (``elastic.enabled = true``).

When a worker dies, torchrun stops the group and starts it again (possibly with fewer workers); each
new attempt resumes from the newest complete state and continues with the same global batch. State
lives in two tiers:

* durable checkpoints in ``RUN_DIR/checkpoints`` every ``checkpoint.interval`` steps (shared storage);
* fast snapshots every ``elastic.snapshot_interval`` steps in memory-backed storage
  (``/dev/shm/lmforge-<run id>`` by default), so a restart loses at most that many steps.

Both tiers use the same atomic DCP format; at restart the newest complete one wins (a snapshot only
if every rank can see the same newest snapshot). Snapshots are deleted when a run ends cleanly.

Each attempt records one ``elastic`` event on the shared MetricLogger: restart count, world size,
where it resumed from, the steps lost and the seconds spent recovering (see :class:`ElasticHooks`).
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from lmforge import distributed as dist_utils
from lmforge.checkpoint import RunDir
from lmforge.checkpoint.layout import write_text
from lmforge.config import Config, ElasticSection
from lmforge.distributed import DistInfo
from lmforge.errors import UserError
from lmforge.metrics import PROCESS_START
from lmforge.metrics.records import last_record_time
from lmforge.modes import faults
from lmforge.parallel.dims import ParallelDims
from lmforge.runtime import RecipeServices, Runtime
from lmforge.training.checkpointing import save
from lmforge.training.loop import Job, StepSource
from lmforge.training.state import TrainState
from lmforge.training.train_step import is_pipeline

RUN_ID_FILE = "elastic_run_id"
SHM_ROOT = Path("/dev/shm")


class ElasticHooks:
    """Per-step additions of the elastic mode: the elastic event, fault injection, snapshots.

    ``recovery_seconds`` of a restarted attempt is the wall time from the failure to the moment the
    new attempt starts its first training step. The failure time is taken as the time of the last
    record the failed attempt wrote to ``metrics.jsonl`` (its last sign of life, so the figure
    includes the partial step in flight when it died), and the end is the start of the training clock,
    so it covers failure detection, teardown, rendezvous, process start, setup and the restore. In
    the goodput breakdown the part before this process existed is ``recovery``; the rest is this
    process's ``setup`` and ``checkpoint_restore``. ``lost_steps`` is the newest step the failed
    attempt logged minus the step resumed from: those steps are computed again (goodput
    ``lost_progress``); with ``metrics.log_every > 1`` it is a lower bound.
    """

    def __init__(self, e: ElasticSection, failure_time: float | None, plans: list[faults.FaultPlan],
                 notes: dict[str, Any]) -> None:
        self.e = e
        self.failure_time = failure_time
        self.plans = plans
        self.notes = notes
        self.attempt = faults.current_attempt()
        self.reported = False

    def __call__(self, rt: Runtime, state: TrainState, source: StepSource) -> None:
        if not self.reported:
            self.report(rt, state)
            self.reported = True
        for plan in self.plans:
            if plan.when == "end" and plan.due(rt.world.dist.rank, state.step, self.attempt):
                self.fire(rt, plan)
        self.snapshot(rt, state, source)

    def fire(self, rt: Runtime, plan: faults.FaultPlan) -> None:
        print(f"fault injection on rank {rt.world.dist.rank}: {plan.describe()}", flush=True)
        faults.inject(plan)

    def arm_mid_step(self, rt: Runtime, step: int) -> None:
        """A ``when=mid`` fault due at ``step`` fires as the model's next forward pass starts (under
        ``parallel.pp``, the first of this rank's stages to run: the schedule calls them, not the model)."""
        modules = rt.model.module.parts if is_pipeline(rt.model.module) else [rt.model.module]
        for plan in self.plans:
            if plan.when == "mid" and plan.due(rt.world.dist.rank, step, self.attempt):
                for module in modules:
                    module.register_forward_pre_hook(lambda *_, plan=plan: self.fire(rt, plan))

    def snapshot(self, rt: Runtime, state: TrainState, source: StepSource) -> None:
        """Save to the fast tier on schedule (collective: the decision uses only values every rank shares).

        A snapshot that cannot be written (e.g. ``/dev/shm`` too small: Docker gives 64 MiB) turns the
        fast tier off with a warning; the run goes on with its durable checkpoints.
        """
        cfg, step = rt.cfg, state.step
        k = self.e.snapshot_interval
        if rt.checkpoints.fast is None or not k or step % k or step >= cfg.training.steps:
            return
        if cfg.checkpoint.enabled and cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0:
            return  # the durable checkpoint of this step was just written
        try:
            save(rt, state, source, tier="fast")
        except UserError as e:  # every rank gets the same error (the save agrees on failures)
            rt.checkpoints.disable_fast()
            rt.metrics.record_event("snapshot_failed", step, f"warning: {e}; fast snapshots off for this "
                                         f"attempt, durable checkpoints continue")

    def report(self, rt: Runtime, state: TrainState) -> None:
        first_step = state.step  # called at the end of the attempt's first step
        resumed = first_step - 1 if state.resumed_from else 0
        source = "start" if not state.resumed_from else \
            "snapshot" if rt.checkpoints.is_snapshot(state.resumed_from) else "checkpoint"
        fields: dict[str, Any] = {"restart_count": self.attempt, "world_size": rt.world.dist.world_size,
                                  "resumed_step": resumed, "resumed_from": source, **self.notes}
        if self.attempt > 0:
            lost = max(state.redo_until - resumed, 0)
            clock_start = time.time() - rt.metrics.training_seconds
            recovery = clock_start - self.failure_time if self.failure_time is not None else 0.0
            fields |= {"lost_steps": lost, "recovery_seconds": round(max(recovery, 0.0), 3)}
            msg = (f"elastic: restart {self.attempt}, world size {rt.world.dist.world_size}, resumed from {source} "
                   f"at step {resumed}, {lost} steps lost, recovered in {fields['recovery_seconds']:.1f} s")
        else:
            msg = f"elastic: attempt 0, world size {rt.world.dist.world_size}, starting at step {first_step - 1}"
        rt.metrics.record_event("elastic", first_step - 1, msg, **fields)


def adapt_micro_batch(cfg: Config, world: int) -> dict[str, Any]:
    """Keep the global batch when the world size changed: lower micro_batch_size if it must.

    The batch is split over the data ranks only: tensor, context and pipeline neighbours read the
    same share, so under ``tp=2`` on 2 workers each reads the whole global batch."""
    t = cfg.training
    G, m = t.global_batch_size, t.micro_batch_size
    data = ParallelDims.from_config(cfg.parallel, world).batch_shares
    if G % data:
        ranks = f"{world} workers" + ("" if data == world else f" ({data} data ranks)")
        raise UserError(f"training.global_batch_size ({G}) cannot be split over {ranks}; "
                        f"choose a global batch divisible by every number of data ranks the job may run at")
    if cfg.elastic.adapt_micro_batch and G % (data * m):
        per_rank = G // data
        t.micro_batch_size = max(d for d in range(1, min(m, per_rank) + 1) if per_rank % d == 0)
    return {"micro_batch_size": t.micro_batch_size, "grad_accum_steps": G // (data * t.micro_batch_size)}


def _run_token(run: RunDir, info: DistInfo) -> str:
    """A random id kept in the run directory, so a deleted and recreated run dir never finds old snapshots."""
    token = None
    if info.is_main:
        f = run.root / RUN_ID_FILE
        if not f.is_file():
            write_text(f, uuid.uuid4().hex[:16])
        token = f.read_text().strip()
    return str(dist_utils.broadcast_object(token))


def snapshot_root(cfg: Config, run: RunDir, info: DistInfo) -> tuple[Path | None, str]:
    """Where this run's fast snapshots live, or None (and why) when the fast tier is off."""
    e = cfg.elastic
    token = _run_token(run, info)  # collective: every rank calls it
    if not e.snapshot_interval:
        return None, "elastic.snapshot_interval=0"
    if not cfg.checkpoint.enabled:
        return None, "checkpoint.enabled=false"
    if e.snapshot_dir:
        return RunDir(Path(e.snapshot_dir) / f"lmforge-{token}").checkpoints, ""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    if local_world != info.world_size:
        return None, "ranks span several machines and /dev/shm is per machine: set elastic.snapshot_dir"
    if not (SHM_ROOT.is_dir() and os.access(SHM_ROOT, os.W_OK)):
        return None, f"{SHM_ROOT} is not writable: set elastic.snapshot_dir"
    return RunDir(SHM_ROOT / f"lmforge-{token}").checkpoints, ""


class MidStepFaults:
    """The job's step source, arming the ``when=mid`` faults of each step as its batch is read."""

    def __init__(self, source: StepSource, rt: Runtime, hooks: ElasticHooks) -> None:
        self.source, self.rt, self.hooks = source, rt, hooks

    def next_step(self, step: int) -> Any:
        batch = self.source.next_step(step)
        self.hooks.arm_mid_step(self.rt, step)
        return batch

    def __getattr__(self, name: str) -> Any:  # state_dict, rank_state, close, ...: the source's own
        return getattr(self.source, name)


class ElasticMode:
    """What the elastic mode adds to any recipe's run: checked before the runtime, applied to its
    services, its job and its end (:func:`lmforge.recipes.skeleton.run_recipe` calls these)."""

    def __init__(self, cfg: Config) -> None:
        attempt = faults.current_attempt()
        # Read before this attempt appends its own setup record: the failed attempt's last sign of life.
        failure_time = last_record_time(RunDir(cfg.run.dir).metrics) if attempt > 0 else None
        notes = adapt_micro_batch(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        e = cfg.elastic
        plans = faults.fault_plans(e.fault_rank, e.fault_step, e.fault_mode, e.fault_attempt, e.fault_when)
        self.hooks = ElasticHooks(e, failure_time, plans, notes)
        # Goodput of a restarted attempt starts at the failure; the gap before this process is recovery.
        self.process_start = failure_time if failure_time is not None and failure_time < PROCESS_START else None
        self.keep = e.snapshot_keep

    def services(self, services: RecipeServices) -> RecipeServices:
        return replace(services, step_hooks=(*services.step_hooks, self.hooks), snapshot_root=snapshot_root,
                       snapshot_keep=self.keep, process_start=self.process_start)

    def job(self, rt: Runtime, job: Job) -> Job:
        self.hooks.notes["snapshot_dir"] = str(rt.checkpoints.fast.root.parent) if rt.checkpoints.fast else ""
        if any(p.when == "mid" for p in self.hooks.plans):
            job.source = MidStepFaults(job.source, rt, self.hooks)
        return job

    def finish(self, rt: Runtime) -> None:
        dist_utils.barrier()
        fast = rt.checkpoints.fast
        if fast is not None and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            shutil.rmtree(fast.root.parent, ignore_errors=True)  # the durable tier now holds the newest state
