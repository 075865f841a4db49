"""Optimizers side by side (adamw, adamw8bit, muon), and LoRA vs QLoRA.

    python bench/optimizers.py                              # small model, 100 steps each, 1 repeat
    python bench/optimizers.py --steps 200 --repeats 2
    python bench/optimizers.py --qlora GGUF_OR_HF_DIR --tokenizer DIR   # LoRA vs QLoRA on a real model

Each configuration is a real ``lmforge pretrain`` run in its own process (so its peak RSS is its own)
on the embedded corpus, with the same seed, data order, schedule and steps; repeats are interleaved
(A B C, B C A, ...) so a shared machine's drift hits every configuration alike, and the table quotes
medians and ratios to the first row. Columns:

* optimizer state: bytes of optimizer state for the model's trainable parameters after one step
  (moments, momentum buffers, 8-bit codes and their scales), measured in this process;
* peak RSS: the run's own ``memory_gb`` (the process's peak resident memory on a CPU);
* tokens/s: the trainer's own median over logged steps after the first;
* final train loss (mean of the last 10 logged steps) and validation loss at the last step.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, loadavg, machine, markdown_table, median  # noqa: E402

from lmforge.config import OptimizerSection  # noqa: E402
from lmforge.metrics.records import read_records  # noqa: E402


def run(argv: list[str], run_dir: Path, threads: int) -> dict[str, float]:
    cmd = [sys.executable, "-m", "lmforge", "pretrain", *argv, f"--run.dir={run_dir}",
           f"--training.threads={threads}", "--metrics.tensorboard=false", "--metrics.progress=off",
           "--checkpoint.enabled=false", "--metrics.log_every=1"]
    env = {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": str(threads), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    train = read_records(run_dir, "train")
    evals = read_records(run_dir, "eval")
    return {"tokens_per_s": median([r["tokens_per_sec_per_device"] for r in train[1:]]),
            "rss_gb": max(r.get("memory_gb", 0.0) for r in train),
            "train_loss": sum(r["loss"] for r in train[-10:]) / len(train[-10:]),
            "val_loss": evals[-1]["loss"] if evals else float("nan")}


def state_bytes_of(size: str, name: str) -> int:
    """Optimizer state of the ``size`` model after one step with zero gradients."""
    from lmforge.models.load import ModelSource, load_model
    from lmforge.optim.optimizers import make_optimizer, state_bytes

    model = load_model(ModelSource("init", "0"), tokenizer="byte", size=size, overrides={}).model
    opt = make_optimizer(model, OptimizerSection(name=name))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return state_bytes(opt)


def interleaved(configs: dict[str, list[str]], repeats: int, threads: int, work: Path) -> dict[str, list[dict]]:
    names = list(configs)
    results: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(repeats):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            results[name].append(run(configs[name], work / f"{name}-{r}", threads))
            print(f"  {name} repeat {r + 1}: {results[name][-1]}", flush=True)
    return results


def summary(results: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    return {n: {k: median([x[k] for x in rs]) for k in rs[0]} for n, rs in results.items()}


def optimizer_table(args: argparse.Namespace, work: Path) -> str:
    base = [f"--model.size={args.size}", f"--training.steps={args.steps}", f"--eval.interval={args.steps}",
            "--eval.steps=8", f"--training.global_batch_size={args.batch}", f"--training.micro_batch_size={args.batch}",
            f"--data.seq_len={args.seq_len}", "--training.dtype=float32"]
    configs = {name: base + [f"--optimizer.name={name}"] for name in args.optimizers}
    res = summary(interleaved(configs, args.repeats, args.threads, work))
    first = args.optimizers[0]
    rows = []
    for name in args.optimizers:
        sb = state_bytes_of(args.size, name)
        r = res[name]
        rows.append([name, f"{sb / 1e6:.2f} MB ({sb / state_bytes_of(args.size, first):.2f}x)",
                     f"{r['rss_gb']:.3f} GB",
                     f"{r['tokens_per_s']:,.0f} ({r['tokens_per_s'] / res[first]['tokens_per_s']:.2f}x)",
                     f"{r['train_loss']:.4f}", f"{r['val_loss']:.4f}"])
    return markdown_table(["optimizer", "optimizer state", "peak RSS", "tokens/s", "train loss (last 10)",
                           f"val loss (step {args.steps})"], rows)


def qlora_table(args: argparse.Namespace, work: Path) -> str:
    base = [f"--model.from_hf={args.qlora}", f"--training.steps={args.qlora_steps}", "--eval.interval=0",
            "--training.global_batch_size=4", "--training.micro_batch_size=4", f"--data.seq_len={args.seq_len}",
            "--training.dtype=float32", "--lora.enabled=true", "--optimizer.lr=1e-3"]
    if args.tokenizer:
        base.append(f"--model.tokenizer={args.tokenizer}")
    configs = {"lora": base, "qlora (nf4)": base + ["--lora.quantize=nf4"]}
    res = summary(interleaved(configs, args.repeats, args.threads, work))
    rows = [[n, f"{r['rss_gb']:.3f} GB ({r['rss_gb'] / res['lora']['rss_gb']:.2f}x)",
             f"{r['tokens_per_s']:,.0f} ({r['tokens_per_s'] / res['lora']['tokens_per_s']:.2f}x)",
             f"{r['train_loss']:.4f}"] for n, r in res.items()]
    return markdown_table(["LoRA", "peak RSS", "tokens/s", "train loss (last 10)"], rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="small")
    p.add_argument("--optimizers", nargs="+", default=["adamw", "adamw8bit", "muon"])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-optimizers", action="store_true")
    p.add_argument("--qlora", default="", help="a model (HF directory or .gguf) for LoRA vs QLoRA")
    p.add_argument("--tokenizer", default="")
    p.add_argument("--qlora-steps", type=int, default=10)
    args = p.parse_args(argv)
    print(f"# {datetime.date.today()}  {machine(torch.device('cpu'))}, {args.threads} threads, load {loadavg()}")
    print("# command: python bench/optimizers.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_optimizers:
            print(optimizer_table(args, Path(tmp)))
        if args.qlora:
            print(qlora_table(args, Path(tmp)))
    print(f"# load at the end {loadavg()}")


if __name__ == "__main__":
    main()
