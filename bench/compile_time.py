"""Time to finish a ``make train``-sized run with ``training.compile`` off, on with a cold cache, and on
again with the cache the first compiled run left (the second run of the same shapes).

    python bench/compile_time.py                     # configs/debug.toml, 300 steps, 2 threads
    python bench/compile_time.py --steps 100 --append

Each run is the CLI (``python -m lmforge pretrain --config configs/debug.toml``) in a fresh process, timed
from launch to exit: process start, model build, compilation, training, eval and checkpoints all count,
as a user waits for them. The compiled runs share one new cache directory (``LMFORGE_CACHE_DIR`` in a
temporary directory), so the first is cold and the second warm. The training seconds the trainer reports
(its last metrics record's ``elapsed``, when present) are listed beside the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, append_benchmark, machine, markdown_table  # noqa: E402

import torch  # noqa: E402


def run(name: str, steps: int, threads: int, compile: str, cache: Path, work: Path) -> tuple[float, str]:
    """Wall seconds of one CLI run, and the setup line's compile reason."""
    run_dir = work / name
    env = dict(os.environ, LMFORGE_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT / "src"))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    cmd = [sys.executable, "-m", "lmforge", "pretrain", "--config", str(ROOT / "configs/debug.toml"),
           f"--training.steps={steps}", f"--training.compile={compile}", f"--training.threads={threads}",
           f"--run.dir={run_dir}", "--metrics.progress=off", "--metrics.tensorboard=false"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    reason = ""
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "setup":
            reason = f"{record.get('compile')}: {record.get('compile_reason', '')}"
    return seconds, reason


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--append", action="store_true", help="append the table to BENCHMARKS.md")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work, cache = Path(tmp), Path(tmp) / "cache"
        off = None
        for name, setting in (("off", "false"), ("on, cold cache", "true"), ("on, warm cache", "true"),
                              ("auto, warm cache", "auto")):
            seconds, reason = run(name.replace(" ", "_").replace(",", ""), a.steps, a.threads, setting, cache, work)
            off = seconds if off is None else off
            rows.append([name, f"{seconds:.1f}", f"{off / seconds:.2f}", reason.split("; cache")[0]])
            print(" | ".join(rows[-1]), flush=True)
    table = markdown_table(["training.compile", "time to finish s", "speed vs off", "setup line"], rows)
    body = (f"`python bench/compile_time.py {' '.join(sys.argv[1:])}` on {machine(torch.device('cpu'))}: "
            f"`lmforge pretrain --config configs/debug.toml --training.steps={a.steps}` "
            f"(--training.threads={a.threads}), launch to exit.\n\n{table}\n")
    print(body)
    if a.append:
        append_benchmark("training.compile: time to finish, cold and warm cache", body)


if __name__ == "__main__":
    main()
