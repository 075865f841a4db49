"""Soak test: a pretraining job killed, preempted and starved of disk at random moments, restarted
by a supervisor until it finishes, then compared with the same job run without interruption.

    python bench/soak.py --minutes 20            # rounds of faulted runs until 20 minutes have passed
    python bench/soak.py --minutes 0 --rounds 1  # one round (what tests/test_soak.py runs, shorter)

Each round runs one job (same command, same run directory) under a supervisor that injects one fault
per attempt at a seeded random moment after the attempt's first step:

* ``kill``: SIGKILL of the process (with ``--nproc 2``: of one rank; torchrun then stops the other);
* ``term``: SIGTERM, a preemption: the run must save its step and exit 0;
* ``disk``: the run directory's file system fills up. As root the run directory is on a small tmpfs
  and a ballast file fills it (a real ENOSPC, wherever the job writes next: metrics or checkpoint);
  the supervisor frees it before restarting. Without root, the test fault runner
  (tests/_helpers.py) makes a checkpoint write fail with ENOSPC after a random number of bytes.

After every death the same command is started again, until the job reaches its final step. The
uninterrupted reference (run once per world size) must match bit for bit: every step's loss and
grad norm, every attempt's logging of a redone step included, and every tensor of the final
checkpoint (weights and optimizer state).
"""

from __future__ import annotations

import argparse
import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import ROOT, cpu_name, loadavg, markdown_table

sys.path.insert(0, str(ROOT / "tests"))
from _helpers import child_pids, write_fault_runner  # noqa: E402  (the test fault runner: simulated ENOSPC)

from lmforge.metrics.records import iter_records, last_logged_step  # noqa: E402

KINDS = ("kill", "term", "disk")
TMPFS_MB = 48  # two kept checkpoints (~11 MB each), one being written, metrics


def job_args(run_dir: Path, steps: int) -> list[str]:
    """The debug model's shapes on shorter sequences: a step is ~0.25 s on one CPU thread."""
    return ["pretrain", "--config", "configs/debug.toml", "--data.seq_len=128", "--training.global_batch_size=8",
            "--training.micro_batch_size=4", f"--training.steps={steps}", "--training.threads=1",
            "--training.dtype=float32", "--checkpoint.interval=5", "--checkpoint.keep=2", "--eval.interval=0",
            "--metrics.log_every=1", "--metrics.tensorboard=false", "--metrics.progress=off", f"--run.dir={run_dir}"]


def command(run_dir: Path, steps: int, nproc: int, runner: Path | None = None) -> list[str]:
    entry = [str(runner)] if runner else ["-m", "lmforge"]
    if nproc == 1:
        return [sys.executable, *entry, *job_args(run_dir, steps)]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                "--max-restarts=0", "--monitor-interval=0.2"]
    return [*launcher, *entry, *job_args(run_dir, steps)]


def env(extra: dict[str, str] | None = None) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in ("LMFORGE_FAULT", "LMFORGE_TEST_FAULT")}
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    return e | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"} | (extra or {})


class Disk:
    """Where faulted runs live, and how their disk fills up (see the module docstring)."""

    def __init__(self, base: Path) -> None:
        self.root = base / "disk"
        self.root.mkdir(parents=True, exist_ok=True)
        self.ballast = self.root / "ballast"
        self.runner: Path | None = None
        ok = os.geteuid() == 0 and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_MB}m", "tmpfs", str(self.root)],
            capture_output=True).returncode == 0
        self.mounted = ok
        if not ok:
            self.runner = write_fault_runner(base)
        self.how = f"tmpfs {TMPFS_MB} MiB filled by a ballast file" if ok else \
            "fault runner: ENOSPC in a checkpoint write"

    def fill(self) -> None:
        chunk = b"\0" * (1 << 20)
        with open(self.ballast, "ab") as f:
            try:
                while True:
                    f.write(chunk)
                    f.flush()
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise

    def free(self) -> None:
        self.ballast.unlink(missing_ok=True)

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", str(self.root)], check=False)


@dataclass
class Attempt:
    kind: str
    delay: float
    injected: bool = False
    rc: int | None = None
    outcome: str = ""


@dataclass
class Round:
    nproc: int
    attempts: list[Attempt] = field(default_factory=list)
    wall: float = 0.0
    lost_steps: int = 0
    result: str = ""


def _train_count(run: Path) -> int:
    return sum(1 for _ in iter_records(run, "train"))


def run_attempt(cmd: list[str], run: Path, log: Path, a: Attempt, disk: Disk, nproc: int, rng: random.Random,
                steps: int) -> None:
    """Start the job, inject ``a``'s fault ``a.delay`` seconds after its first step, wait for the end."""
    extra = {}
    if a.kind == "disk" and disk.runner is not None:  # armed at launch: fails once this many bytes are written
        extra["LMFORGE_TEST_FAULT"] = f"disk_full:{rng.randrange(0, 3 * 11_000_000)}"
        a.injected = True
    before = _train_count(run)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env(extra), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        first = None
        while proc.poll() is None:
            time.sleep(0.1)
            if a.injected:
                continue
            if first is None and _train_count(run) > before:
                first = time.time()
            if first is not None and time.time() >= first + a.delay:
                a.injected = True
                workers = child_pids(proc.pid) if nproc > 1 else [proc.pid]
                if a.kind == "kill":
                    os.kill(rng.choice(workers), signal.SIGKILL)
                elif a.kind == "term":  # what a scheduler does to every process of a preempted job
                    for pid in workers:
                        os.kill(pid, signal.SIGTERM)
                else:
                    disk.fill()
        try:
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    a.rc = proc.returncode
    text = log.read_text(errors="replace")
    stop = ([None] + list(iter_records(run, "stop")))[-1]
    if a.rc == 0 and stop and stop["step"] == steps and stop["reason"].startswith("reached"):
        a.outcome = "finished" + (" (the fault came too late to matter)" if a.injected else "")
        a.injected = False
    elif not a.injected:
        a.outcome = f"UNEXPECTED exit {a.rc} without a fault"
    elif a.kind == "kill":
        a.outcome = "killed" if a.rc != 0 else "UNEXPECTED exit 0 after SIGKILL"
    elif a.kind == "term" and stop and stop["step"] == steps and stop["reason"].startswith("reached") and \
            (run / "checkpoints" / f"step_{steps:08d}").is_dir():  # the job was done, only tearing down
        a.outcome = f"SIGTERM after the final checkpoint (rc {a.rc})"
    elif a.kind == "term":
        saved = stop["step"] if stop else -1
        ok = a.rc == 0 and stop and "stop requested" in stop["reason"] and \
            (run / "checkpoints" / f"step_{saved:08d}").is_dir()
        a.outcome = f"preempted, saved step {saved}, exit 0" if ok else f"UNEXPECTED preemption outcome (rc {a.rc})"
    else:
        named = "No space left on device" in text or "file system is full" in text
        a.outcome = "disk full: exited on ENOSPC" if a.rc != 0 and named \
            else f"UNEXPECTED disk-full outcome (rc {a.rc})"
    if a.kind == "disk":
        disk.free()


def lost_steps(run: Path) -> int:
    """Steps computed again after restarts: the newest step logged before each restart minus the step
    it resumed from (0 without a checkpoint)."""
    lost, newest, attempt_start = 0, 0, False
    for r in iter_records(run):
        if r["kind"] == "setup":
            attempt_start = newest > 0
        elif r["kind"] == "resume" and attempt_start:
            lost += newest - r["step"]
            attempt_start = False
        elif r["kind"] == "train":
            if attempt_start:  # restarted from scratch: no checkpoint was complete
                lost += newest
                attempt_start = False
            newest = max(newest, r["step"])
    return lost


def step_values(run: Path) -> dict[int, list[tuple[float, float]]]:
    """(loss, grad_norm) of every logging of every step, redone ones included."""
    out: dict[int, list[tuple[float, float]]] = {}
    for r in iter_records(run, "train"):
        out.setdefault(r["step"], []).append((r["loss"], r["grad_norm"]))
    return out


def final_tensors(run: Path, steps: int) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(run / "checkpoints" / f"step_{steps:08d}", Path(tmp) / "all.pt")
        state = torch.load(Path(tmp) / "all.pt", weights_only=False)

    def walk(d: dict, prefix: str = ""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from walk(v, f"{prefix}{k}.")
            elif isinstance(v, torch.Tensor):
                yield f"{prefix}{k}", v
    return dict(walk(state))


def compare(ref: Path, run: Path, steps: int) -> str:
    """'identical (...)' or what differs: every logging of every step, then every final tensor."""
    import torch

    want, got = step_values(ref), step_values(run)
    missing = [s for s in range(1, steps + 1) if s not in got]
    differ = [s for s, vals in got.items() if any(v != want.get(s, [None])[0] for v in vals)]
    a, b = final_tensors(ref, steps), final_tensors(run, steps)
    tensors = [k for k in a if k not in b or not torch.equal(a[k], b[k])] + [k for k in b if k not in a]
    if missing or differ or tensors:
        return (f"DIFFERENT: {len(missing)} steps missing, {len(differ)} steps differ (first {sorted(differ)[:3]}), "
                f"{len(tensors)} of {len(a)} tensors differ (first {tensors[:2]})")
    redone = sum(len(v) - 1 for v in got.values())
    return f"identical: {steps} steps (+{redone} redone), {len(a)} tensors"


def soak(out: Path, minutes: float, rounds: int, steps: int, nprocs: list[int], seed: int,
         max_delay: float, kinds: tuple[str, ...] = KINDS) -> tuple[list[Round], float, str]:
    """Faulted rounds (cycling through ``nprocs``) until ``minutes`` have passed and at least
    ``rounds`` rounds are done; returns the rounds, the wall time and how the disk fills."""
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    disk = Disk(out)
    start = time.time()
    refs: dict[int, Path] = {}
    done: list[Round] = []
    try:
        while len(done) < rounds or time.time() - start < minutes * 60:
            nproc = nprocs[len(done) % len(nprocs)]
            if nproc not in refs:
                refs[nproc] = out / f"reference_{nproc}"
                shutil.rmtree(refs[nproc], ignore_errors=True)
                ref_log = out / f"reference_{nproc}.log"
                with open(ref_log, "w") as log:
                    rc = subprocess.run(command(refs[nproc], steps, nproc), cwd=ROOT, env=env(), stdout=log,
                                        stderr=subprocess.STDOUT).returncode
                if rc != 0:
                    raise SystemExit(f"the uninterrupted reference failed (rc {rc}), see {ref_log}")
            rnd = Round(nproc)
            run = disk.root / f"round_{len(done) + 1}"
            logs = out / f"round_{len(done) + 1}"
            logs.mkdir(exist_ok=True)
            t0 = time.time()
            while not rnd.attempts or not rnd.attempts[-1].outcome.startswith("finished"):
                if len(rnd.attempts) >= 100:
                    raise SystemExit(f"round {len(done) + 1} did not finish in 100 attempts, see {logs}")
                a = Attempt(rng.choice(kinds), rng.uniform(0.5, max_delay))
                runner = disk.runner if a.kind == "disk" else None
                run_attempt(command(run, steps, nproc, runner), run, logs / f"attempt_{len(rnd.attempts) + 1}.log",
                            a, disk, nproc, rng, steps)
                rnd.attempts.append(a)
                print(f"round {len(done) + 1} attempt {len(rnd.attempts)}: {a.kind} at +{a.delay:.1f} s -> "
                      f"{a.outcome} (newest step {last_logged_step(run)})", flush=True)
            rnd.wall = time.time() - t0
            rnd.lost_steps = lost_steps(run)
            rnd.result = compare(refs[nproc], run, steps)
            shutil.copy(run / "metrics.jsonl", logs / "metrics.jsonl")
            shutil.rmtree(run)
            done.append(rnd)
            print(f"round {len(done)}: {rnd.result}", flush=True)
    finally:
        disk.free()
        disk.close()
    return done, time.time() - start, disk.how


def summary(rounds: list[Round], wall: float, how: str) -> str:
    rows = []
    for i, r in enumerate(rounds, 1):
        faults = {k: sum(a.injected and a.kind == k for a in r.attempts) for k in KINDS}
        bad = sum(a.outcome.startswith("UNEXPECTED") for a in r.attempts)
        rows.append([str(i), str(r.nproc), str(faults["kill"]), str(faults["term"]), str(faults["disk"]),
                     str(len(r.attempts) - 1), str(r.lost_steps), f"{r.wall:.0f}", str(bad), r.result])
    total = {k: sum(a.injected and a.kind == k for r in rounds for a in r.attempts) for k in KINDS}
    bad = sum(a.outcome.startswith("UNEXPECTED") for r in rounds for a in r.attempts)
    rows.append(["all", "", str(total["kill"]), str(total["term"]), str(total["disk"]),
                 str(sum(len(r.attempts) - 1 for r in rounds)), str(sum(r.lost_steps for r in rounds)),
                 f"{wall:.0f}", str(bad),
                 "ALL IDENTICAL" if all(r.result.startswith("identical") for r in rounds) else "MISMATCH"])
    table = markdown_table(["round", "ranks", "SIGKILL", "SIGTERM", "disk full", "restarts", "lost steps",
                            "wall s", "unexpected", "vs uninterrupted (losses, grad norms, final tensors)"], rows)
    return f"{table}\n\ndisk faults: {how}; wall includes the uninterrupted references; load average {loadavg()}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=20.0, help="keep starting rounds until this much wall time")
    p.add_argument("--rounds", type=int, default=1, help="at least this many rounds")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--nproc", default="1,2", help="world sizes the rounds cycle through (2: torchrun)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-delay", type=float, default=20.0,
                   help="a fault lands 0.5..this many s after an attempt's first step")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "soak")
    args = p.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')}  {cpu_name()} ({os.cpu_count()} CPUs)  load {loadavg()}", flush=True)
    print("command: " + " ".join(job_args(Path("RUN_DIR"), args.steps)), flush=True)
    rounds, wall, how = soak(args.out, args.minutes, args.rounds, args.steps,
                             [int(n) for n in args.nproc.split(",")], args.seed, args.max_delay)
    print(summary(rounds, wall, how))
    return 0 if all(r.result.startswith("identical") for r in rounds) and \
        not any(a.outcome.startswith("UNEXPECTED") for r in rounds for a in r.attempts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
