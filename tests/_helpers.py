"""Plain helpers shared by the test modules (pytest fixtures are in conftest.py).

* tiny runs through the real CLI: their arguments (:func:`tiny_run_args`), the command and
  environment (:func:`lmforge_cmd`, :func:`cli_env`), running one to the end (:func:`run_lmforge`,
  :func:`torchrun`; :func:`lmforge_in_process` for one that stops at a config or start-up check)
  or starting one to watch or kill it (:func:`start_lmforge`, :func:`finish`);
* the fault runner, which injects faults into a CLI run, and the finished reliability run;
* what the runs train on, and what their losses must be;
* the model and batches of the train-step gradient tests (also run under torchrun by _ddp_grad_check.py).

A run's metrics are read with the library's own reader, ``lmforge.metrics.records.read_records``.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lmforge.data.packing import IGNORE_INDEX, Batch
from lmforge.metrics.records import read_records
from lmforge.models.model import ModelArgs

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"

# ---------------------------------------------------------------------------- tiny run arguments
STEPS = 8
GLOBAL_BATCH = 8
SEQ_LEN = 32
TOKENS_PER_STEP = GLOBAL_BATCH * SEQ_LEN  # every packed token is a target

TINY_RUN: dict[str, Any] = {
    "model.size": "debug", "model.n_layers": 2, "model.dim": 64, "model.n_heads": 4, "model.n_kv_heads": 2,
    "data.seq_len": SEQ_LEN, "training.global_batch_size": GLOBAL_BATCH, "training.steps": STEPS,
    "training.threads": 1, "metrics.log_every": 1, "metrics.tensorboard": False, "metrics.peak_tflops": 1,
    "metrics.progress": "off", "eval.interval": 0, "checkpoint.interval": 1000, "schedule.warmup_steps": 2,
    "training.dtype": "float32",
}
"""The base of every tiny run: a ~140k-parameter model (setup, not compute, dominates these runs),
STEPS steps of GLOBAL_BATCH sequences of SEQ_LEN tokens, a line per step, no eval, no periodic
checkpoint (only the final one), one thread, and no TensorBoard, measured peak or progress bar."""

SECTIONS = frozenset({"model", "data", "training", "optimizer", "schedule", "eval", "checkpoint", "metrics",
                      "run", "parallel", "elastic", "grpo", "sft", "tasks", "lora", "dpo", "distill", "kto", "orpo",
                      "simpo", "rm"})


def tiny_run_args(data_file: str | Path | None = None, **overrides: Any) -> list[str]:
    """``--section.key=value`` flags of a tiny run: :data:`TINY_RUN` with ``overrides``.

    ``data_file`` is both the training and the validation data (else the config file's or the
    trainer's default, the embedded corpus). An override is named ``section_key`` (the first
    underscore stands for the dot): ``training_steps=12`` gives ``--training.steps=12``; ``None``
    drops a flag, so the config file's or the trainer's default applies. Booleans are written
    ``true``/``false``.
    """
    values = dict(TINY_RUN)
    if data_file is not None:
        values |= {"data.train": data_file, "data.validation": data_file}
    for name, value in overrides.items():
        section, _, key = name.partition("_")
        if section not in SECTIONS or not key:
            raise TypeError(f"tiny_run_args: {name!r} is not section_key (e.g. training_steps=12)")
        values[f"{section}.{key}"] = value
    return [f"--{key}={str(v).lower() if isinstance(v, bool) else v}" for key, v in values.items() if v is not None]


RELIABLE_RUN = {"training_global_batch_size": 4, "training_micro_batch_size": 2, "training_steps": 12,
                "checkpoint_interval": 2, "checkpoint_keep": 2, "data_prefetch": 1}
"""Overrides of the reliability runs (on the embedded corpus): 12 steps of 4 sequences in 2
microbatches, a checkpoint every 2 steps and the newest 2 kept (steps 10 and 12 once finished)."""
RELIABLE_STEPS = RELIABLE_RUN["training_steps"]


def small_corpus(folder: Path) -> dict[str, Path]:
    """``data_train``/``data_validation`` overrides: a few hundred documents of the embedded corpus
    (quicker to prepare than all of it), written into ``folder``."""
    from lmforge.data.corpus import embedded_corpus

    out = {}
    for split, n in (("train", 400), ("validation", 60)):
        out[f"data_{split}"] = folder / f"{split}.txt"
        out[f"data_{split}"].write_text("\n\n".join(embedded_corpus(split, num_docs=n)))
    return out


def write_corpus(path: Path) -> Path:
    """A small text file of 80 documents (what the distributed and elastic runs train on)."""
    words = ("the model learns to predict the next token from text with many small words and a few "
             "longer sentences about training language models on a laptop").split()
    docs = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(50 + i % 20)) for i in range(80)]
    path.write_text("\n\n".join(docs))
    return path


# ---------------------------------------------------------------------------- running the CLI
FAULT_ENVS = ("LMFORGE_FAULT", "LMFORGE_TEST_FAULT")
"""Fault injection (the trainer's drills, the fault runner's): never inherited by a test's CLI run."""


def cli_env(extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every CLI run: this checkout's src/ first on PYTHONPATH (the code under
    test, in the subprocess too), one OpenMP thread (several processes share a few cores),
    unbuffered output (a killed run's lines still arrive), no fault injection unless ``extra_env``
    asks for it."""
    env = {k: v for k, v in os.environ.items() if k not in FAULT_ENVS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH")) if p)
    env |= {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return env | (extra_env or {})


def lmforge_cmd(*args: str | Path, runner: Path | None = None) -> list[str]:
    """``python -m lmforge ARGS``, or ``python RUNNER ARGS`` (the fault runner)."""
    entry = [str(runner)] if runner else ["-m", "lmforge"]
    return [sys.executable, *entry, *map(str, args)]


def run_lmforge(*args: str | Path, timeout: float = 240, cwd: Path = REPO,
                extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``lmforge ARGS`` to the end in the repository root (text output captured)."""
    return subprocess.run(lmforge_cmd(*args), capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=cli_env(extra_env))


def lmforge_in_process(*args: str | Path, cwd: Path = REPO) -> int:
    """Run ``lmforge ARGS`` in this process (``lmforge.cli.main``) as :func:`run_lmforge` would in a
    subprocess: in ``cwd``, without fault injection; the exit status is returned and what it prints
    is read with pytest's ``capfd``. For runs that stop in config loading or start-up checks, and
    for short one-process runs and exports that need no process of their own (a subprocess costs
    seconds of imports): the run locks the call took are released on return, as
    the end of a process releases them. The test's autouse fixture restores the thread count and RNG
    states the run set (conftest.py)."""
    from lmforge.checkpoint import runlock
    from lmforge.cli import main

    held, faults = set(runlock._HELD), {k: os.environ.pop(k) for k in FAULT_ENVS if k in os.environ}
    here = os.getcwd()
    os.chdir(cwd)
    try:
        return main([str(a) for a in args])
    except SystemExit as e:  # argparse, or `raise SystemExit` somewhere: what `python -m lmforge` exits with
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        os.chdir(here)
        os.environ.update(faults)
        for run_dir in set(runlock._HELD) - held:
            runlock.release_run_lock(run_dir)


def start_lmforge(*args: str | Path, runner: Path | None = None, fault: str | None = None, cwd: Path = REPO,
                  extra_env: dict[str, str] | None = None, **popen: Any) -> subprocess.Popen:
    """Start ``lmforge ARGS`` (through ``runner`` with LMFORGE_TEST_FAULT=``fault`` if given) to
    watch, signal or kill it; stdout and stderr are text pipes unless ``popen`` says otherwise."""
    env = dict(extra_env or {})
    if fault is not None:
        assert runner is not None, "a fault is injected by the fault runner"
        env["LMFORGE_TEST_FAULT"] = fault
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **popen}
    return subprocess.Popen(lmforge_cmd(*args, runner=runner), cwd=cwd, env=cli_env(env), **popen)


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    """Wait for a started run: (exit code, stdout, stderr)."""
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def torchrun_cmd(*args: str | Path, nproc: int = 2, max_restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.2", "-m", "lmforge", *map(str, args)]


def torchrun(*args: str | Path, nproc: int = 2, max_restarts: int = 0, timeout: float = 240,
             extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``lmforge ARGS`` to the end under torchrun's agent, ``nproc`` CPU workers."""
    return subprocess.run(torchrun_cmd(*args, nproc=nproc, max_restarts=max_restarts), capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env=cli_env(extra_env))


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (torchrun's workers), from /proc."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def tail(proc: subprocess.CompletedProcess, n: int = 4000) -> str:
    return proc.stdout[-n:] + "\n---stderr---\n" + proc.stderr[-n:]


def run_in_terminal(cmd: list[str]) -> tuple[float, float, str]:
    """Run ``cmd`` with stdout on a 120-column pseudo-terminal: (launch time, exit time, output)."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    launched = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=cli_env(), stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=subprocess.PIPE)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 1.0)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # the terminal closed
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(master)
    rc = proc.wait(timeout=120)
    exited = time.time()
    assert rc == 0, proc.stderr.read().decode()[-3000:]
    return launched, exited, b"".join(chunks).decode("utf-8", "replace")


# ---------------------------------------------------------------------------- injected faults
FAULT_RUNNER = r'''
"""Runs the lmforge CLI with a fault from LMFORGE_TEST_FAULT injected (tests only)."""
import contextlib, errno, io, os, sys, time

fault = os.environ.get("LMFORGE_TEST_FAULT", "")
kind, _, arg = fault.partition(":")
if kind in ("pause_before_manifest", "pause_before_commit"):
    from lmforge.checkpoint import checkpointer as c

    def paused(original):
        def run(*a, **k):
            time.sleep(float(arg))
            return original(*a, **k)
        return run

    if kind == "pause_before_manifest":
        c.write_manifest = paused(c.write_manifest)
    else:
        c.Checkpointer._commit = paused(c.Checkpointer._commit)
elif kind == "disk_full":  # the checkpoint file system has `arg` bytes free
    from torch.distributed.checkpoint import filesystem
    free = [int(arg)]

    class FillingFile(io.BufferedWriter):
        def write(self, b):
            n = memoryview(b).nbytes
            if n > free[0]:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)
            free[0] -= n
            return super().write(b)

    original = filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" not in mode:
            with original(self, path, mode) as s:
                yield s
            return
        with FillingFile(io.FileIO(str(path), "w")) as s:
            yield s

    filesystem.FileSystem.create_stream = create_stream

from lmforge.cli import main
raise SystemExit(main(sys.argv[1:]))
'''
"""A script that runs the CLI with a fault injected (a pause inside a checkpoint save, so a SIGKILL
lands mid-save; a disk that fills up). It patches only test hooks; the training code is the shipped one."""


def write_fault_runner(directory: Path) -> Path:
    path = directory / "fault_runner.py"
    path.write_text(FAULT_RUNNER)
    return path


def reliable_run_args(run_dir: Path, *extra: str, **overrides: Any) -> list[str]:
    """The command line of a :data:`RELIABLE_RUN` pretraining (with ``overrides``) into ``run_dir``."""
    return ["pretrain", *tiny_run_args(**{**RELIABLE_RUN, **overrides}), f"--run.dir={run_dir}", *extra]


def start_reliable_run(runner: Path, run_dir: Path, *extra: str, fault: str = "", **overrides: Any) -> subprocess.Popen:
    """A :data:`RELIABLE_RUN` pretraining (with ``overrides``) through the fault runner."""
    return start_lmforge(*reliable_run_args(run_dir, *extra, **overrides), runner=runner, fault=fault)


class Reference:
    """The uninterrupted reliability run, started at once so other work overlaps it.

    ``path()`` waits for it; ``when_done(fn)`` runs ``fn(path)`` as soon as a ``poll()`` or ``path()``
    sees it finished (to start runs that need it while other work goes on).
    """

    def __init__(self, base: Path, runner: Path) -> None:
        self.dir = base / "reference"
        self.proc: subprocess.Popen | None = start_reliable_run(runner, self.dir)
        self.callbacks: list = []

    def when_done(self, fn) -> None:
        self.callbacks.append(fn)
        self.poll()

    def poll(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            self.path()
        if self.proc is None:
            while self.callbacks:
                self.callbacks.pop(0)(self.dir)

    def path(self) -> Path:
        if self.proc is not None:
            rc, _, err = finish(self.proc)
            self.proc = None
            assert rc == 0, err[-3000:]
        self.poll()
        return self.dir


# ---------------------------------------------------------------------------- losses
def losses(run_dir: Path) -> dict[int, float]:
    """Loss per step; a step trained twice (redone after a restart) must have logged the same loss."""
    out: dict[int, float] = {}
    for r in read_records(run_dir, "train"):
        if r["step"] in out:
            assert abs(out[r["step"]] - r["loss"]) <= 1e-5 * abs(r["loss"]), f"step {r['step']} redone differently"
        out[r["step"]] = r["loss"]
    return out


def grad_norms(run_dir: Path) -> dict[int, float]:
    """Pre-clip gradient norm per step (the last record of a step trained twice)."""
    return {r["step"]: r["grad_norm"] for r in read_records(run_dir, "train")}


def assert_losses_match(got: dict[int, float], want: dict[int, float], steps, rel: float = 1e-5) -> None:
    """fp32 sums in another order (other ranks, other microbatches) differ in the last bits only."""
    for s in steps:
        assert s in got, f"step {s} missing from {sorted(got)}"
        assert abs(got[s] - want[s]) <= rel * abs(want[s]), f"step {s}: {got[s]} vs {want[s]}"


# ---------------------------------------------------------------------------- train-step gradients
STEP_MODEL_ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32)
"""The model of the gradient tests (test_train_step.py, and _ddp_grad_check.py under torchrun)."""


def make_batch(n: int = 4, t: int = 12, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (n, t + 1), generator=g)
    labels = ids[:, 1:].clone()
    # uneven target counts per sequence: a per-microbatch mean would weight them wrongly
    for i in range(n):
        labels[i, : 3 * i] = IGNORE_INDEX
    return Batch(input_ids=ids[:, :-1], labels=labels, position_ids=None, document_ids=None)


def split_batch(batch: Batch, parts: int) -> list[Batch]:
    """``parts`` contiguous equal slices of a batch."""
    size = batch.input_ids.shape[0] // parts
    return [Batch(batch.input_ids[i * size:(i + 1) * size], batch.labels[i * size:(i + 1) * size], None, None)
            for i in range(parts)]
