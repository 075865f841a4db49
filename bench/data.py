"""Data at scale: ``lmforge prepare`` throughput, run start-up and memory, loader speed.

    python bench/data.py --mb 100                         # byte tokenizer, 1 and 2 workers
    python bench/data.py --mb 1000 --tokenizers byte
    python bench/data.py --mb 20 --tokenizers tests/fixtures/tokenizers/qwen2.5-instruct --skip-runs
    python bench/data.py --mb 100 --baseline /path/to/an/older/checkout/src   # "in memory" column

The corpus is generated (no download): documents of random words drawn from the embedded corpus's
vocabulary, 50-400 words each, written to ``--tmp`` and deleted at the end. Every measurement is a
separate CLI process; its peak RSS is the child's ``ru_maxrss`` (prepare's worker processes included).

* prepare: wall time of ``lmforge prepare`` and MB of text per second;
* start-up: wall time of a 1-step ``lmforge pretrain`` (command to end of step 1, eval and
  checkpoints off) and its peak RSS, on the prepared directory, on the raw file (prepared on first
  use into the cache, then read from it), and with ``--baseline``'s code (which tokenizes the whole
  raw file in memory at start);
* loader: samples per second of the step loader over the prepared shards (prefetch off, in this
  process), against what the trainer consumes, and ``data_wait`` of the 1-step run's goodput.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, append_benchmark, loadavg, markdown_table  # noqa: E402


def generate(path: Path, mb: int, seed: int = 0) -> int:
    from lmforge.data.corpus import embedded_corpus

    words = sorted({w for d in embedded_corpus("train", 3000) for w in d.split()})
    rng = np.random.default_rng(seed)
    target, written = mb * 1_000_000, 0
    with open(path, "w") as f:
        while written < target:
            lengths = rng.integers(50, 400, size=256)
            ids = rng.integers(0, len(words), size=int(lengths.sum()))
            docs, pos = [], 0
            for n in lengths:
                docs.append(" ".join(words[i] for i in ids[pos:pos + n]))
                pos += n
            block = "\n\n".join(docs) + "\n\n"
            f.write(block)
            written += len(block.encode())
    return written


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in MB of the child and its children, stdout + stderr tail)."""
    wrapper = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
               "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
               "w = time.perf_counter() - t; r = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss; "
               "print(p.returncode, w, r / 1024); print((p.stdout + p.stderr)[-1500:])")
    out = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, env=env)
    first, _, rest = out.stdout.partition("\n")
    rc, wall, rss = first.split()
    if int(rc) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{rest}")
    return float(wall), float(rss), rest


def lmforge(src: Path, *args: str) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(src)!r}); from lmforge.cli import main; "
            "raise SystemExit(main(sys.argv[1:]))", *args]


RUN = ["--training.steps=1", "--training.threads=1", "--eval.interval=0", "--checkpoint.enabled=false",
       "--metrics.tensorboard=false", "--metrics.progress=off", "--data.seq_len=256", "--training.global_batch_size=16"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=100, help="corpus size in MB of text")
    p.add_argument("--tokenizers", default="byte", help="comma-separated: byte and/or tokenizer directories")
    p.add_argument("--workers", default="1,2")
    p.add_argument("--tmp", default="/tmp/lmforge-bench-data")
    p.add_argument("--baseline", help="src/ of another checkout whose pretrain tokenizes in memory")
    p.add_argument("--skip-runs", action="store_true", help="prepare throughput only")
    p.add_argument("--no-write", action="store_true", help="print, do not append to BENCHMARKS.md")
    a = p.parse_args()
    tmp = Path(a.tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    src = ROOT / "src"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LMFORGE_CACHE": str(tmp / "cache")}
    try:
        corpus = tmp / "corpus.txt"
        t = time.perf_counter()
        nbytes = generate(corpus, a.mb)
        print(f"generated {nbytes / 1e6:.0f} MB in {time.perf_counter() - t:.0f}s (load {loadavg()})", flush=True)
        rows = []
        prepared = None
        for tok in a.tokenizers.split(","):
            for w in a.workers.split(","):
                out = tmp / f"prepared-{Path(tok).name}-{w}"
                cmd = ["prepare", str(corpus), "--out", str(out), "--tokenizer", tok, "--workers", w]
                wall, rss, _ = timed(lmforge(src, *cmd), env)
                index = json.loads((out / "index.json").read_text())
                rows.append([Path(tok).name, w, f"{nbytes / 1e6:.0f}", f"{index['num_tokens'] / 1e6:.1f}M {index['dtype']}",
                             f"{wall:.1f}", f"{nbytes / 1e6 / wall:.1f}", f"{rss:.0f}", loadavg()])
                print(rows[-1], flush=True)
                if tok == "byte" and prepared is None:
                    prepared = out
                else:
                    shutil.rmtree(out)
        body = [f"Corpus: {nbytes / 1e6:.0f} MB of generated text (`python bench/data.py --mb {a.mb} --tokenizers "
                f"{a.tokenizers}`); shared 2-vCPU machine, load average at each row shown.", "",
                markdown_table(["tokenizer", "workers", "MB", "tokens", "prepare s", "MB/s", "peak RSS MB", "load"], rows)]
        if not a.skip_runs and prepared is not None:
            body += ["", *startup_rows(src, a, corpus, prepared, env, tmp)]
        text = "\n".join(body)
        print(text)
        if not a.no_write:
            append_benchmark(f"Data preparation and loading, {nbytes / 1e6:.0f} MB", text)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def startup_rows(src: Path, a, corpus: Path, prepared: Path, env: dict[str, str], tmp: Path) -> list[str]:
    from lmforge.data.loader import StepLoader
    from lmforge.data.shards import PackedShardDataset, PreparedTokens
    from lmforge.metrics.records import read_records

    cases = [("prepared directory", src, prepared), ("raw file, first run (prepares into cache)", src, corpus),
             ("raw file, cached", src, corpus)]
    if a.baseline:
        cases.append(("raw file, in memory (--baseline)", Path(a.baseline), corpus))
    rows, wait = [], {}
    for k, (name, code, data) in enumerate(cases):
        run = tmp / f"run{k}"
        wall, rss, _ = timed(lmforge(code, "pretrain", *RUN, f"--data.train={data}", f"--data.validation={data}",
                                     f"--run.dir={run}"), env)
        goodput = [g for g in read_records(run, "goodput") if g.get("final")]
        wait[name] = goodput[-1].get("data_wait", float("nan")) if goodput else float("nan")
        rows.append([name, f"{wall:.1f}", f"{rss:.0f}", loadavg()])
        print(rows[-1], flush=True)
    loader = StepLoader(PackedShardDataset(PreparedTokens(prepared), 256), 16, 16, 0, 1, prefetch=0)
    t = time.perf_counter()
    steps = 200
    for _ in range(steps):
        loader.next_step()
    rate = steps * 16 * 256 / (time.perf_counter() - t)
    train = [r for r in read_records(tmp / "run0", "train")]
    trainer_rate = train[-1].get("tokens_per_sec_per_device", float("nan")) if train else float("nan")
    return [f"Start-up: `lmforge pretrain` to the end of step 1 (debug model, seq 256, batch 16, eval and "
            f"checkpoints off; `{' '.join(RUN)}`):", "",
            markdown_table(["data", "command to step 1 (s)", "peak RSS MB", "load"], rows), "",
            f"Loader over the prepared shards (shuffled windows, prefetch off): {rate:,.0f} tokens/s in one thread; "
            f"the trainer consumed ~{trainer_rate:,.0f} tokens/s; data_wait in goodput (%): "
            + ", ".join(f"{k}: {v}" for k, v in wait.items()) + "."]


if __name__ == "__main__":
    main()
