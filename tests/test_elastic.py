"""The elastic mode under torchrun's agent: injected faults, restarts, preemption.

Faults run through the real launcher: ``torchrun --max-restarts`` restarts the worker group, the
new attempt resumes from the newest snapshot in /dev/shm, and the losses stay those of an
uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from _helpers import (STEPS, assert_losses_match, child_pids, cli_env, losses, run_lmforge, tail, tiny_run_args,
                      torchrun, torchrun_cmd)
from lmforge.metrics.records import iter_records, read_records
from lmforge.checkpoint.checkpointer import Checkpointer
from lmforge.config import validate_config
from lmforge.errors import UserError
from lmforge.modes.faults import FaultPlan, InjectedFault, inject, parse_fault
from lmforge.checkpoint.tiers import CheckpointTiers
from lmforge.config import Config
from lmforge.modes.elastic import adapt_micro_batch


def test_fault_specs_parse_and_fire_only_where_due():
    plan = parse_fault("rank=1,step=5,mode=raise,attempt=1")
    assert plan == FaultPlan(rank=1, step=5, mode="raise", attempt=1)
    assert plan.due(1, 5, 1) and not plan.due(0, 5, 1) and not plan.due(1, 5, 0) and not plan.due(1, 4, 1)
    assert parse_fault("rank=0,step=2") == FaultPlan(0, 2, "kill", 0)
    assert parse_fault("rank=1,step=4,when=mid") == FaultPlan(1, 4, "kill", 0, "mid")
    for bad in ("rank=1", "rank=1,step=x", "rank=1,step=2,mode=boom", "step=2,when=3", "rank=1,step=2,when=soon"):
        with pytest.raises(UserError):
            parse_fault(bad)
    with pytest.raises(InjectedFault):
        inject(FaultPlan(0, 1, "raise"))


def test_newest_complete_state_wins_across_tiers(tmp_path):
    model = torch.nn.Linear(2, 2)
    durable = Checkpointer(tmp_path / "run", keep=2)
    fast = Checkpointer(tmp_path / "run", keep=1, root=tmp_path / "shm" / "checkpoints")
    tiers = CheckpointTiers(durable, fast)
    assert tiers.latest() is None
    durable.save(4, model, None, {})
    fast.save(2, model, None, {})
    chosen = tiers.latest()
    assert chosen == durable.root / "step_00000004" and not tiers.is_snapshot(chosen)
    tiers.save(6, model, None, {}, tier="fast")
    (fast.root / "step_00000008.partial").mkdir()  # a snapshot cut off mid-write never counts
    chosen = tiers.latest()
    assert chosen == fast.root / "step_00000006" and tiers.is_snapshot(chosen)
    assert [p.name for p in fast.root.iterdir() if not p.name.endswith(".partial")] == ["step_00000006"]
    assert tiers.load(chosen, model, None)["step"] == 6
    assert CheckpointTiers(durable, None).latest() == durable.root / "step_00000004"


def test_elastic_is_a_mode_of_any_recipe(tmp_path):
    """SFT in the elastic mode on one process: the elastic event is recorded, snapshots are taken on
    schedule in their own tier and removed when the run ends cleanly; without the mode, no event."""
    run = tmp_path / "sft"
    args = tiny_run_args(None, training_steps=3, elastic_snapshot_interval=1, elastic_snapshot_dir=str(tmp_path / "snaps"),
                         data_train=None, data_validation=None)
    proc = run_lmforge("sft", "--elastic.enabled=true", *args, "--tasks.train_examples=32", "--tasks.eval_examples=4",
                       f"--run.dir={run}")
    assert proc.returncode == 0, tail(proc)
    event = read_records(run, "elastic")[0]
    assert event["restart_count"] == 0 and event["world_size"] == 1
    assert event["snapshot_dir"].startswith(str(tmp_path / "snaps"))
    assert not Path(event["snapshot_dir"]).exists()  # removed once the durable tier held the final state
    plain = tmp_path / "plain"
    proc = run_lmforge("sft", *args, "--tasks.train_examples=32", "--tasks.eval_examples=4", f"--run.dir={plain}")
    assert proc.returncode == 0, tail(proc)
    assert read_records(plain, "elastic") == []


def test_global_batch_survives_another_world_size():
    def cfg():
        return validate_config(Config, {"training": {"global_batch_size": 12, "micro_batch_size": 4}})

    assert adapt_micro_batch(cfg(), 3) == {"micro_batch_size": 4, "grad_accum_steps": 1}
    assert adapt_micro_batch(cfg(), 2) == {"micro_batch_size": 3, "grad_accum_steps": 2}  # 4 does not split 6
    assert adapt_micro_batch(cfg(), 1) == {"micro_batch_size": 4, "grad_accum_steps": 3}
    with pytest.raises(UserError, match="cannot be split over 5 workers"):
        adapt_micro_batch(cfg(), 5)

    def split(tp: int):  # tensor-parallel neighbours read the same share: the batch splits over data ranks
        return validate_config(Config, {"training": {"global_batch_size": 6, "micro_batch_size": 6},
                                               "parallel": {"tp": tp}})

    assert adapt_micro_batch(split(2), 2) == {"micro_batch_size": 6, "grad_accum_steps": 1}
    assert adapt_micro_batch(split(2), 4) == {"micro_batch_size": 3, "grad_accum_steps": 1}
    with pytest.raises(UserError, match=r"over 8 workers \(4 data ranks\)"):
        adapt_micro_batch(split(2), 8)


@pytest.fixture(scope="module")
def faulted(tmp_path_factory, corpus):
    """2 ranks, snapshots every 2 steps; attempt 0 loses rank 1 to SIGKILL after step 3, attempt 1
    has rank 0 raise after step 6; torchrun restarts the group twice."""
    run = tmp_path_factory.mktemp("elastic") / "faulted"
    start = time.time()
    proc = torchrun("pretrain", "--elastic.enabled=true", *tiny_run_args(corpus, training_micro_batch_size=4, elastic_snapshot_interval=2),
                    f"--run.dir={run}", max_restarts=2,
                    extra_env={"LMFORGE_FAULT": "rank=1,step=3,mode=kill;rank=0,step=6,mode=raise,attempt=1"})
    return run, proc, time.time() - start


def test_killed_and_crashed_workers_restart_and_finish(faulted, reference_losses):
    run, proc, _ = faulted
    assert proc.returncode == 0, tail(proc)
    assert "fault injection on rank 1: rank=1,step=3,mode=kill" in proc.stdout
    assert "InjectedFault: injected fault (rank=0,step=6,mode=raise,attempt=1)" in proc.stderr
    assert read_records(run, "stop")[-1]["step"] == STEPS
    assert (run / "checkpoints" / f"step_{STEPS:08d}").is_dir()
    # redone steps reproduce their first losses (checked in losses()) and the uninterrupted run
    assert_losses_match(losses(run), reference_losses, range(1, STEPS + 1))


def test_metrics_record_restarts_lost_steps_and_recovery(faulted):
    run, _, wall = faulted
    events = read_records(run, "elastic")
    assert [e["restart_count"] for e in events] == [0, 1, 2]
    first, second = events[1], events[2]
    # killed after step 3 with the newest snapshot at 2; crashed after 6 with the newest at 4
    assert (first["resumed_from"], first["resumed_step"], first["lost_steps"]) == ("snapshot", 2, 1)
    assert (second["resumed_from"], second["resumed_step"], second["lost_steps"]) == ("snapshot", 4, 2)
    for e in (first, second):
        assert e["world_size"] == 2
        assert 0.5 < e["recovery_seconds"] < wall
    goodput = [g for g in read_records(run, "goodput") if g["final"]][-1]
    assert goodput["recovery"] > 0 and goodput["lost_progress"] > 0
    token = (run / "elastic_run_id").read_text().strip()
    assert not Path(f"/dev/shm/lmforge-{token}").exists(), "snapshots must be removed after a clean end"
    print(f"\nmeasured: recovery {first['recovery_seconds']:.1f} s and {second['recovery_seconds']:.1f} s, "
          f"lost steps {first['lost_steps']} and {second['lost_steps']}, whole job {wall:.1f} s")


def _rank_of(pid: int) -> int:
    """A torchrun worker's rank, from its environment."""
    env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
    return int(env["RANK"])


def test_sigterm_makes_every_rank_save_and_exit_cleanly_then_resume(tmp_path, corpus):
    """SIGTERM to ONE worker (rank 1, not the one that logs): the stop must reach rank 0 through the
    ranks' agreement, both stop after the same step, save together and exit 0. A rank acting on its
    own signal alone would save while the other trained on, and both would wait forever."""
    run = tmp_path / "preempted"
    cmd = torchrun_cmd("pretrain", "--elastic.enabled=true", *tiny_run_args(corpus, training_micro_batch_size=4, training_steps=100000),
                       f"--run.dir={run}")
    agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env())
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(_train_steps(run)) < 3:
            time.sleep(0.2)
        assert len(_train_steps(run)) >= 3, "the run did not start"
        workers = child_pids(agent.pid)
        assert len(workers) == 2
        [signalled] = [pid for pid in workers if _rank_of(pid) == 1]
        os.kill(signalled, signal.SIGTERM)  # a scheduler signals every process; one is the harder case
        out, _ = agent.communicate(timeout=120)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, out[-4000:]  # torchrun exits 0 only if every worker exited 0
    stop = read_records(run, "stop")[-1]
    assert stop["reason"] == "stop requested (another rank received a stop signal)"  # rank 0 was not signalled
    saved = stop["step"]
    assert (run / "checkpoints" / f"step_{saved:08d}").is_dir()

    proc = run_lmforge("pretrain", "--elastic.enabled=true", *tiny_run_args(corpus, training_micro_batch_size=4, training_steps=saved + 2),
                       f"--run.dir={run}")
    assert proc.returncode == 0, tail(proc)
    assert read_records(run, "resume")[-1]["step"] == saved
    assert max(losses(run)) == saved + 2


def _train_steps(run: Path) -> list[int]:
    return [r["step"] for r in iter_records(run, "train")]


def test_rank_killed_mid_step_under_tensor_parallel_resumes_with_the_same_losses(tmp_path, corpus, reference_losses):
    """tp=2 on 2 workers (one data rank: each reads the whole batch): rank 1 dies inside step 6's
    forward pass, with rank 0 inside the same step waiting on its half of every matrix product.
    torchrun restarts the group, which resumes from the newest state of either tier (the durable
    checkpoint of step 4, newer than the snapshot of step 3) and ends with one process's losses."""
    run = tmp_path / "tp"
    proc = torchrun("pretrain", "--elastic.enabled=true", *tiny_run_args(corpus, training_micro_batch_size=8, parallel_tp=2, checkpoint_interval=4,
                                              elastic_snapshot_interval=3), f"--run.dir={run}", max_restarts=1,
                    extra_env={"LMFORGE_FAULT": "rank=1,step=6,mode=kill,when=mid"})
    assert proc.returncode == 0, tail(proc)
    assert "fault injection on rank 1: rank=1,step=6,mode=kill,attempt=0,when=mid" in proc.stdout
    assert [r["parallel"] for r in read_records(run, "setup")] == ["tp", "tp"]
    events = read_records(run, "elastic")
    assert [e["restart_count"] for e in events] == [0, 1]
    for e in events:  # the batch splits over the data ranks, not over the tensor-parallel pair
        assert (e["world_size"], e["micro_batch_size"], e["grad_accum_steps"]) == (2, 8, 1)
    restart = events[1]
    assert (restart["resumed_from"], restart["resumed_step"], restart["lost_steps"]) == ("checkpoint", 4, 1)
    assert max(r["step"] for r in read_records(run, "train") if r["time"] < restart["time"]) == 5  # died in 6
    assert_losses_match(losses(run), reference_losses, range(1, STEPS + 1))
    assert (run / "checkpoints" / f"step_{STEPS:08d}").is_dir()
