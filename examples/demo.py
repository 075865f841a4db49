"""The whole demo from scratch: pretrain -> SFT -> GRPO on the CPU, then the table the README quotes.

    make demo            # or: python examples/demo.py

Runs the three shipped configs through the Python API (``lmforge.train``, what the CLI runs), each
stage in this process, starting from the previous one's run directory, into runs/demo/{pretrain,sft,grpo} (runs/demo is deleted first). Every setting lives in
configs/debug.toml, configs/sft_debug.toml and configs/grpo_debug.toml; this script overrides only
the run directories. Progress is streamed (eval lines in full, a training line every few seconds);
at the end it prints a Markdown table read back from the three metrics.jsonl files, with the date,
the machine and the torch version, so that a quoted number can always be traced to this command.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Sequence

import lmforge
from lmforge.cli import run_files_note
from lmforge.config import parse_overrides
from lmforge.errors import UserError
from lmforge.metrics.records import read_records

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "runs" / "demo"
STAGES = [  # (name, recipe, config, the stage it starts from)
    ("pretrain", "pretrain", "configs/debug.toml", None),
    ("sft", "sft", "configs/sft_debug.toml", "pretrain"),
    ("grpo", "grpo", "configs/grpo_debug.toml", "sft"),
]


class Digest(io.TextIOBase):
    """A stage's output, line by line: each prefixed with the stage and its seconds so far, with a
    training line shown only every ~10 s (enough to follow along); the last 40 lines are kept."""

    def __init__(self, name: str, out: io.TextIOBase) -> None:
        self.name, self.out, self.start, self.last_shown = name, out, time.perf_counter(), 0.0
        self.partial, self.tail = "", []

    def write(self, text: str) -> int:
        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines:
            self.line(line + "\n")
        return len(text)

    def line(self, line: str) -> None:
        self.tail = (self.tail + [line])[-40:]
        now = time.perf_counter()
        if line.startswith("completed step") and now - self.last_shown < 10:
            return
        if line.startswith("completed step"):
            self.last_shown = now
        print(f"[{self.name} {now - self.start:5.0f}s] {line.rstrip()[:160]}", file=self.out, flush=True)

    def isatty(self) -> bool:
        return False


def run_stage(name: str, recipe: str, config: str, parent: str | None, out: Path = OUT,
              extra: Sequence[str] = ()) -> float:
    """Run one stage with ``lmforge.train`` (its run directory ``out/name``, starting from ``out/parent``,
    then the ``extra`` flags, as the CLI reads them), stream a digest of its output, return its wall seconds."""
    argv = ["-m", "lmforge", recipe, "--config", config, f"--run.dir={out / name}"]
    if parent:
        argv.append(f"--model.from_checkpoint={out / parent}")
    argv += extra
    print(f"\n=== {name}: {' '.join(argv)}", flush=True)
    start, console = time.perf_counter(), sys.stdout
    digest = Digest(name, console)
    try:
        with contextlib.chdir(ROOT), contextlib.redirect_stdout(digest), contextlib.redirect_stderr(digest):
            run = lmforge.train(recipe, config, parse_overrides(argv[5:]))
            print(run_files_note(run.run_dir))
    except UserError as e:
        sys.exit(f"{name} failed (error: {e}); its last lines:\n{''.join(digest.tail)}")
    finally:
        if digest.partial:
            digest.line(digest.partial)
    return time.perf_counter() - start


def evals(stage: str, key: str) -> list[dict]:
    return [r for r in read_records(OUT / stage, "eval") if key in r]


def last_step(stage: str) -> int:
    return max(r["step"] for r in read_records(OUT / stage, "train"))


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def table(wall: dict[str, float]) -> str:
    rows = ["| stage | measure | before | after | steps | wall |", "|---|---|---|---|---|---|"]

    def row(stage: str, measure: str, before: str, after: str, first: bool) -> None:
        steps, secs = (f"{last_step(stage)}", f"{wall[stage]:.0f} s") if first else ("", "")
        rows.append(f"| {stage if first else ''} | {measure} | {before} | {after} | {steps} | {secs} |")

    loss = evals("pretrain", "loss")
    row("pretrain", f"validation loss (step {loss[0]['step']} → {loss[-1]['step']})",
        f"{loss[0]['loss']:.3f}", f"{loss[-1]['loss']:.3f}", True)
    sft = evals("sft", "exact_match")
    tasks = [k.removeprefix("exact_match_") for k in sft[-1] if k.startswith("exact_match_")]
    row("sft", "held-out exact match (greedy), all", f"{sft[0]['exact_match']:.3f}",
        f"{sft[-1]['exact_match']:.3f}", True)
    for t in tasks:
        row("sft", f"… {t}", f"{sft[0]['exact_match_' + t]:.3f}", f"{sft[-1]['exact_match_' + t]:.3f}", False)
    grpo = evals("grpo", "exact_match")
    for i, t in enumerate(k.removeprefix("exact_match_") for k in grpo[-1] if k.startswith("exact_match_")):
        row("grpo", f"held-out exact match (greedy), {t}", f"{grpo[0]['exact_match_' + t]:.3f}",
            f"{grpo[-1]['exact_match_' + t]:.3f}", i == 0)
    rewards = [(r["step"], r["reward/mean"]) for r in read_records(OUT / "grpo", "train") if "reward/mean" in r]
    n = last_step("grpo")
    first = mean([v for s, v in rewards if s <= 50])
    last = mean([v for s, v in rewards if s > n - 50])
    row("grpo", "reward/mean (logged steps among the first / last 50)", f"{first:.3f}", f"{last:.3f}", False)
    return "\n".join(rows)


def machine(out: Path = OUT, stages: Sequence[str] = ("pretrain", "sft", "grpo")) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        names = [ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    import torch

    threads = sorted({r.get("threads") for s in stages for r in read_records(out / s, "setup")})
    return f"{os.cpu_count()} CPUs ({cpu}), torch {torch.__version__}, torch threads {'/'.join(map(str, threads))}"


def main() -> int:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    wall = {name: run_stage(name, recipe, config, parent) for name, recipe, config, parent in STAGES}
    print(f"\n### lmforge demo, {datetime.date.today().isoformat()}: {machine()}, "
          f"{sum(wall.values()):.0f} s wall in all\n")
    print(table(wall))
    print(f"\nRun directories: {OUT.relative_to(ROOT)}/{{pretrain,sft,grpo}} (lmforge report RUN_DIR for plots)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
