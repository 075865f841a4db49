"""Elastic pretraining: the pretraining trainer under torchrun's elastic agent.

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

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from lmforge.training import distributed as dist_utils
from lmforge.training import faults
from lmforge.training.checkpoint import Checkpointer
from lmforge.config import Config, Section
from lmforge.errors import UserError
from lmforge.training.loop import save
from lmforge.metrics import PROCESS_START
from lmforge.training.runtime import Runtime
from lmforge.trainers import pretrain

RUN_ID_FILE = "elastic_run_id"
SHM_ROOT = Path("/dev/shm")


class ElasticSection(Section):
    snapshot_interval: int = Field(5, ge=0)
    """Fast snapshot every this many steps (0: durable checkpoints only)."""
    snapshot_dir: str = ""
    """Where snapshots go ('' : /dev/shm/lmforge-<run id> when all ranks share one machine)."""
    snapshot_keep: int = Field(1, ge=1)
    adapt_micro_batch: bool = True
    """If the global batch does not split over the new world size, lower micro_batch_size until it does."""
    fault_rank: int = Field(0, ge=0)
    fault_step: int = Field(0, ge=0)
    """Inject a fault at the end of this step (0: none); ``LMFORGE_FAULT`` overrides (see lmforge.training.faults)."""
    fault_mode: Literal["kill", "raise"] = "kill"
    fault_attempt: int = Field(0, ge=0)
    """Fire only on this attempt (torchrun restart count), so the restarted group survives."""


class ElasticConfig(Config):
    elastic: ElasticSection = ElasticSection()


class TieredCheckpointer(Checkpointer):
    """Durable checkpoints (this class) plus an optional fast tier; ``latest`` picks the newest.

    Saving through this object always writes the durable tier; the fast tier is written with
    ``loop.save(..., checkpointer=tiers.fast)``. A snapshot is only chosen if every rank sees the
    same newest intact snapshot (node-local storage on several machines never qualifies), so all
    ranks always restore the same step.
    """

    def __init__(self, durable: Checkpointer, fast: Checkpointer | None) -> None:
        super().__init__(durable.root.parent, durable.keep, durable.on_damaged, durable.report, root=durable.root)
        self.fast = fast
        self.chosen: Path | None = None
        """What the last ``latest()`` returned (tells a snapshot resume from a checkpoint resume)."""

    def latest(self) -> Path | None:
        durable = super().latest()
        self.chosen = durable
        if self.fast is None:
            return durable
        snap = self.fast.latest()
        snap_step = _step_of(snap) if snap is not None else -1
        newest = dist_utils.all_reduce_max(float(snap_step))
        oldest = -dist_utils.all_reduce_max(float(-snap_step))
        if snap is not None and newest == oldest and (durable is None or snap_step > _step_of(durable)):
            self.chosen = snap
        return self.chosen

    def is_snapshot(self, path: Path | None) -> bool:
        return self.fast is not None and path is not None and Path(path).parent == self.fast.root

    def load(self, path: Path, model: Any, optimizer: Any) -> dict[str, Any]:
        if self.is_snapshot(path):
            return self.fast.load(path, model, optimizer)  # type: ignore[union-attr]
        return super().load(path, model, optimizer)


def _step_of(path: Path) -> int:
    return int(path.name[5:])


class ElasticHooks:
    """Per-step additions of the elastic trainer: the elastic event, fault injection, snapshots.

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

    def __init__(self, rt: Runtime, fast: Checkpointer | None, failure_time: float | None,
                 plans: list[faults.FaultPlan], notes: dict[str, Any]) -> None:
        self.rt = rt
        self.fast = fast
        self.failure_time = failure_time
        self.plans = plans
        self.notes = notes
        self.attempt = faults.current_attempt()
        self.reported = False

    def __call__(self, progress: Any, loader: Any) -> None:
        if not self.reported:
            self.report(progress.step)
            self.reported = True
        for plan in self.plans:
            if plan.due(self.rt.dist.rank, progress.step, self.attempt):
                print(f"fault injection on rank {self.rt.dist.rank}: {plan.describe()}", flush=True)
                faults.inject(plan)
        self.snapshot(progress, loader)

    def snapshot(self, progress: Any, loader: Any) -> None:
        """Save to the fast tier on schedule (collective: the decision uses only values every rank shares).

        A snapshot that cannot be written (e.g. ``/dev/shm`` too small: Docker gives 64 MiB) turns the
        fast tier off with a warning; the run goes on with its durable checkpoints.
        """
        cfg, step = self.rt.cfg, progress.step
        k = cfg.elastic.snapshot_interval
        if self.fast is None or not k or step % k or step >= cfg.training.steps:
            return
        if cfg.checkpoint.enabled and cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0:
            return  # the durable checkpoint of this step was just written
        try:
            save(self.rt, progress, loader, checkpointer=self.fast)
        except UserError as e:  # every rank gets the same error (the save agrees on failures)
            self.fast = None
            self.rt.metrics.record_event("snapshot_failed", step, f"warning: {e}; fast snapshots off for this "
                                         f"attempt, durable checkpoints continue")

    def report(self, first_step: int) -> None:
        rt = self.rt
        state = rt.extras.get("resumed_state")
        resumed = int(state["step"]) if state else 0
        tiers = rt.checkpointer
        source = "start" if not state else "snapshot" if isinstance(tiers, TieredCheckpointer) and \
            tiers.is_snapshot(tiers.chosen) else "checkpoint"
        fields: dict[str, Any] = {"restart_count": self.attempt, "world_size": rt.dist.world_size,
                                  "resumed_step": resumed, "resumed_from": source, **self.notes}
        if self.attempt > 0:
            lost = max(rt.extras.get("redo_until", 0) - resumed, 0)
            clock_start = time.time() - rt.metrics.training_seconds
            recovery = clock_start - self.failure_time if self.failure_time is not None else 0.0
            fields |= {"lost_steps": lost, "recovery_seconds": round(max(recovery, 0.0), 3)}
            msg = (f"elastic: restart {self.attempt}, world size {rt.dist.world_size}, resumed from {source} "
                   f"at step {resumed}, {lost} steps lost, recovered in {fields['recovery_seconds']:.1f} s")
        else:
            msg = f"elastic: attempt 0, world size {rt.dist.world_size}, starting at step {first_step - 1}"
        rt.metrics.record_event("elastic", first_step - 1, msg, **fields)


def last_record_time(metrics_file: Path) -> float | None:
    """The ``time`` of the last complete record of a metrics file (reads only its tail)."""
    if not metrics_file.is_file():
        return None
    with open(metrics_file, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(f.tell() - 65536, 0))
        lines = f.read().decode("utf-8", errors="replace").splitlines()
    for line in reversed(lines):
        try:
            return float(json.loads(line)["time"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def adapt_micro_batch(cfg: ElasticConfig, world: int) -> dict[str, Any]:
    """Keep the global batch when the world size changed: lower micro_batch_size if it must."""
    t = cfg.training
    G, m = t.global_batch_size, t.micro_batch_size
    if G % world:
        raise UserError(f"training.global_batch_size ({G}) cannot be split over {world} workers; "
                        f"choose a global batch divisible by every world size the job may run at")
    if cfg.elastic.adapt_micro_batch and G % (world * m):
        per_rank = G // world
        t.micro_batch_size = max(d for d in range(1, min(m, per_rank) + 1) if per_rank % d == 0)
    return {"micro_batch_size": t.micro_batch_size,
            "grad_accum_steps": G // (world * t.micro_batch_size)}


def _run_token(rt: Runtime) -> str:
    """A random id kept in the run directory, so a deleted and recreated run dir never finds old snapshots."""
    token = None
    if rt.dist.is_main:
        f = rt.run_dir / RUN_ID_FILE
        if not f.is_file():
            f.write_text(uuid.uuid4().hex[:16])
        token = f.read_text().strip()
    return str(dist_utils.broadcast_object(token))


def snapshot_root(rt: Runtime) -> tuple[Path | None, str]:
    """Where this run's fast snapshots live, or None (and why) when the fast tier is off."""
    e = rt.cfg.elastic
    token = _run_token(rt)  # collective: every rank calls it
    if not e.snapshot_interval:
        return None, "elastic.snapshot_interval=0"
    if not rt.cfg.checkpoint.enabled:
        return None, "checkpoint.enabled=false"
    if e.snapshot_dir:
        return Path(e.snapshot_dir) / f"lmforge-{token}", ""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", rt.dist.world_size))
    if local_world != rt.dist.world_size:
        return None, "ranks span several machines and /dev/shm is per machine: set elastic.snapshot_dir"
    if not (SHM_ROOT.is_dir() and os.access(SHM_ROOT, os.W_OK)):
        return None, f"{SHM_ROOT} is not writable: set elastic.snapshot_dir"
    return SHM_ROOT / f"lmforge-{token}", ""


def run(cfg: ElasticConfig) -> Runtime:
    attempt = faults.current_attempt()
    run_dir = Path(cfg.run.dir)
    # Read before this attempt appends its own setup record: the failed attempt's last sign of life.
    failure_time = last_record_time(run_dir / "metrics.jsonl") if attempt > 0 else None
    notes = adapt_micro_batch(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    e = cfg.elastic
    plans = faults.fault_plans(e.fault_rank, e.fault_step, e.fault_mode, e.fault_attempt)
    def setup(rt: Runtime) -> None:
        root, why_not = snapshot_root(rt)
        durable = rt.checkpointer
        fast = Checkpointer(rt.run_dir, e.snapshot_keep, durable.on_damaged, durable.report,
                            root=root / "checkpoints") if root else None
        if why_not:
            rt.metrics.console(f"elastic: fast snapshots off ({why_not})")
        rt.checkpointer = TieredCheckpointer(durable, fast)
        if failure_time is not None and failure_time < PROCESS_START:
            # Goodput of this attempt starts at the failure; the gap before this process is recovery.
            rt.metrics.process_start = failure_time
            rt.metrics.add_time("recovery", PROCESS_START - failure_time)
        notes["snapshot_dir"] = str(root) if root else ""
        rt.step_hooks.append(ElasticHooks(rt, fast, failure_time, plans, notes))

    rt = pretrain.run(cfg, "elastic", setup=setup)
    tiers = rt.checkpointer
    dist_utils.barrier()
    if isinstance(tiers, TieredCheckpointer) and tiers.fast is not None and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        shutil.rmtree(tiers.fast.root.parent, ignore_errors=True)  # the durable tier now holds the newest state
    return rt
