"""Full fine-tuning vs LoRA: step memory, peak memory and tokens/s of the same train step.

    python bench/lora.py                       # 125m shape, 32k vocabulary, 2 x 512 tokens per step
    python bench/lora.py --layers 4 --repeats 1

Each point is a fresh subprocess (so its peak RSS is its own): the model is built (with adapters for
LoRA: rank 16 on every projection, the base frozen), one warm-up step, then ``--steps`` timed steps of
lmforge's own train step (``gradient_computation`` + ``run_optimizer_step``, AdamW). Step memory is
the peak RSS minus the RSS before the first step: gradients, optimizer state and activations, which
is what LoRA saves (the frozen weights are there in both). Points are interleaved ``--repeats`` times
and the medians reported, with LoRA / full ratios; results are appended to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from common import append_benchmark, loadavg, machine, markdown_table, median  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def one_point(a: argparse.Namespace) -> dict:
    from lmforge.config import LoraSection
    from lmforge.data.packing import Batch
    from lmforge.models.lora import apply_lora, trainable_parameters
    from lmforge.models.model import Transformer, model_args_for
    from lmforge.objectives.next_token import cross_entropy_loss
    from lmforge.optim.adamw import build_optimizer
    from lmforge.training.train_step import global_target_count, gradient_computation, run_optimizer_step

    torch.set_num_threads(a.threads)
    args = model_args_for("125m", a.vocab, n_layers=a.layers)
    model = Transformer(args)
    model.init_weights(seed=0)
    if a.system == "lora":
        apply_lora(model, LoraSection(rank=a.rank, alpha=2 * a.rank))
    trainable, total = trainable_parameters(model)
    opt = build_optimizer(model, 1e-4, 0.0, (0.9, 0.95), 1e-8)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g)
    b = Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    before = rss_bytes()

    def step() -> None:
        gradient_computation(model, [b], cross_entropy_loss, global_target_count([b]))
        run_optimizer_step(model, opt, 1e-4, 1.0)

    step()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    seconds = (time.perf_counter() - t0) / a.steps
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"tokens_per_sec": a.batch * a.seq / seconds, "step_memory_gb": (peak - before) / 1e9,
            "peak_rss_gb": peak / 1e9, "trainable": trainable, "total": total}


def run_point(a: argparse.Namespace, system: str) -> dict:
    cmd = [sys.executable, __file__, "--one", "--system", system, "--layers", str(a.layers), "--vocab", str(a.vocab),
           "--seq", str(a.seq), "--batch", str(a.batch), "--steps", str(a.steps), "--rank", str(a.rank),
           "--threads", str(a.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{system} failed: {proc.stderr.strip().splitlines()[-1:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"  {system:>5}: {r['tokens_per_sec']:8.1f} tokens/s, step memory {r['step_memory_gb']:.2f} GB, "
          f"peak {r['peak_rss_gb']:.2f} GB (load {loadavg()})", flush=True)
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", default="full")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32_000)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-write", action="store_true", help="do not append to BENCHMARKS.md")
    a = p.parse_args()
    if a.one:
        print(json.dumps(one_point(a)))
        return
    results: dict[str, list[dict]] = {"full": [], "lora": []}
    for _ in range(a.repeats):
        for system in results:
            results[system].append(run_point(a, system))
    m = {s: {k: median([r[k] for r in rs]) for k in ("tokens_per_sec", "step_memory_gb", "peak_rss_gb")}
         for s, rs in results.items()}
    lo = results["lora"][0]
    rows = [[s, f"{lo['trainable'] if s == 'lora' else results['full'][0]['trainable']:,}",
             f"{m[s]['tokens_per_sec']:,.1f}", f"{m[s]['step_memory_gb']:.2f}", f"{m[s]['peak_rss_gb']:.2f}"]
            for s in results]
    rows.append(["LoRA / full", f"{lo['trainable'] / results['full'][0]['trainable']:.3f}",
                 f"{m['lora']['tokens_per_sec'] / m['full']['tokens_per_sec']:.2f}x",
                 f"{m['lora']['step_memory_gb'] / m['full']['step_memory_gb']:.2f}x",
                 f"{m['lora']['peak_rss_gb'] / m['full']['peak_rss_gb']:.2f}x"])
    table = markdown_table(["", "trainable parameters", "tokens/s", "step memory (GB)", "peak RSS (GB)"], rows)
    body = (f"`python bench/lora.py --layers {a.layers} --vocab {a.vocab} --seq {a.seq} --batch {a.batch} "
            f"--steps {a.steps} --rank {a.rank} --repeats {a.repeats} --threads {a.threads}` — the `125m` shape "
            f"with {a.layers} layers, LoRA rank {a.rank} on every projection; medians of {a.repeats} interleaved "
            f"repeats; {machine(torch.device('cpu'))}; load average {loadavg()}.\n\n{table}\n")
    print("\n" + body)
    if not a.no_write:
        append_benchmark("Full fine-tuning vs LoRA (bench/lora.py)", body)


if __name__ == "__main__":
    main()
