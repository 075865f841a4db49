"""Helpers for the multi-process tests: tiny runs through the real CLI, alone or under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

STEPS = 8
GLOBAL_BATCH = 8
TOKENS_PER_STEP = GLOBAL_BATCH * 32  # seq_len 32, every packed token is a target


def tiny_args(data_file: Path) -> list[str]:
    """A ~140k-parameter model on a small text file: setup, not compute, dominates these runs."""
    return ["--model.size=debug", "--model.n_layers=2", "--model.dim=64", "--model.n_heads=4",
            "--model.n_kv_heads=2", "--data.seq_len=32", f"--data.train={data_file}",
            f"--data.validation={data_file}", f"--training.global_batch_size={GLOBAL_BATCH}",
            f"--training.steps={STEPS}", "--training.threads=1", "--metrics.log_every=1",
            "--metrics.tensorboard=false", "--metrics.peak_tflops=1", "--metrics.progress=off",
            "--eval.interval=0", "--checkpoint.interval=1000", "--schedule.warmup_steps=2"]


def write_corpus(path: Path) -> Path:
    words = ("the model learns to predict the next token from text with many small words and a few "
             "longer sentences about training language models on a laptop").split()
    docs = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(50 + i % 20)) for i in range(80)]
    path.write_text("\n\n".join(docs))
    return path


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.pop("LMFORGE_FAULT", None)
    e["OMP_NUM_THREADS"] = "1"
    return e


def lmforge(*args: str, timeout: int = 180, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmforge", *args], capture_output=True, text=True,
                          timeout=timeout, env=env() | (extra_env or {}))


def torchrun_cmd(*args: str, nproc: int = 2, max_restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.2", "-m", "lmforge", *args]


def torchrun(*args: str, nproc: int = 2, max_restarts: int = 0, timeout: int = 240,
             extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_cmd(*args, nproc=nproc, max_restarts=max_restarts), capture_output=True,
                          text=True, timeout=timeout, env=env() | (extra_env or {}))


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def losses(run_dir: Path) -> dict[int, float]:
    """Loss per step; a step trained twice (redone after a restart) must have logged the same loss."""
    out: dict[int, float] = {}
    for r in records(run_dir, "train"):
        if r["step"] in out:
            assert abs(out[r["step"]] - r["loss"]) <= 1e-5 * abs(r["loss"]), f"step {r['step']} redone differently"
        out[r["step"]] = r["loss"]
    return out


def assert_losses_match(got: dict[int, float], want: dict[int, float], steps, rel: float = 1e-5) -> None:
    """fp32 sums in another order (other ranks, other microbatches) differ in the last bits only."""
    for s in steps:
        assert s in got, f"step {s} missing from {sorted(got)}"
        assert abs(got[s] - want[s]) <= rel * abs(want[s]), f"step {s}: {got[s]} vs {want[s]}"


def reference_losses(tmp_path_factory, corpus: Path) -> dict[int, float]:
    """One process, the whole global batch in one microbatch, no interruption (computed once per session)."""
    run = tmp_path_factory.getbasetemp() / "reference_run"
    if not (run / "metrics.jsonl").is_file() or len(losses(run)) < STEPS:
        proc = lmforge("pretrain", *tiny_args(corpus), "--training.micro_batch_size=8", f"--run.dir={run}")
        assert proc.returncode == 0, tail(proc)
    return losses(run)


def tail(proc: subprocess.CompletedProcess, n: int = 4000) -> str:
    return (proc.stdout[-n:] + "\n---stderr---\n" + proc.stderr[-n:])
