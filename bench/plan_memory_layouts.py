"""The planner's per-device estimate (lmforge.planning.planner) against each rank's measured peak of live
tensor memory in a real train step laid out over a mesh (lmforge.planning.layout_probe), on the CPU.

    PYTHONPATH=src python bench/plan_memory_layouts.py [--layouts dp_shard=2 tp=2 tp=2,dp_shard=2 ...]
        [--sizes debug small] [--dtypes float32 bfloat16] [--micro-batches 2 8] [--microbatches 1 2]
        [--checkpointing off on]

The driver launches one ``torchrun --standalone`` (gloo) per layout; each runs every configuration and
rank 0 prints one JSON line per configuration with every rank's peak. The table compares the planner's
estimate (the worst device) with the largest rank's peak. Under pp a step needs at least pp
microbatches (1F1B), so ``--microbatches`` n becomes n x pp there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

LAYOUTS = ["dp_shard=2", "dp_shard=4", "tp=2", "tp=2,dp_shard=2", "cp=2", "pp=2", "pp=2,dp_shard=2"]


def parse_layout(text: str):  # type: ignore[no-untyped-def]
    from lmforge.parallel.dims import ParallelDims

    degrees = dict(part.split("=") for part in text.split(",") if part)
    return ParallelDims.of(**{k: int(v) for k, v in degrees.items()})


def configs(a: argparse.Namespace, pp: int) -> list[dict]:
    return [dict(size=s, dtype=d, micro_batch=b, microbatches=m * pp, ckpt=c) for s in a.sizes for d in a.dtypes
            for b in a.micro_batches for m in a.microbatches for c in a.checkpointing]


def worker(a: argparse.Namespace) -> None:
    """Under torchrun: every configuration on this layout; rank 0 prints JSON lines."""
    import torch
    import torch.distributed as dist

    from lmforge.runtime.world import init_distributed
    from lmforge.models.args import model_args_for
    from lmforge.models.tokenizer import ByteTokenizer
    from lmforge.planning.layout_probe import measure_layout_step

    torch.set_num_threads(1)
    init_distributed("cpu")
    layout = parse_layout(a.worker)
    vocab = ByteTokenizer().vocab_size
    for c in configs(a, layout.pp):
        args = model_args_for(c["size"], vocab, max_seq_len=max(a.seq_len, 8))
        m = measure_layout_step(args, layout, seq_len=a.seq_len, micro_batch=c["micro_batch"],
                                microbatches=c["microbatches"], dtype=c["dtype"], checkpointing=c["ckpt"] == "on")
        peaks: list = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, (m.peak, m.params))
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps({**c, "layout": a.worker, "peaks": [p for p, _ in peaks],
                                          "params": [q for _, q in peaks]}), flush=True)
    dist.destroy_process_group()


def driver(a: argparse.Namespace) -> None:
    from lmforge.models.args import model_args_for
    from lmforge.models.tokenizer import ByteTokenizer
    from lmforge.planning.planner import estimate_memory

    vocab = ByteTokenizer().vocab_size
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"),
                                          os.environ.get("PYTHONPATH", "")])}
    print(f"seq_len {a.seq_len}, AdamW, vocab {vocab}, gloo on the CPU; MB = 1e6 bytes; measured: the largest "
          f"rank's peak of live tensors in the second step; estimate: lmforge plan's worst device")
    print(f"{'layout':<16} {'size':<6} {'dtype':<9} {'ckpt':<4} {'mb':>3} {'n_mb':>4} {'measured MB':>11} "
          f"{'estimate MB':>11} {'ratio':>6}  {'phase':<9} per-rank MB")
    ratios = []
    for text in a.layouts:
        layout = parse_layout(text)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={layout.devices}",
               __file__, "--worker", text, "--seq-len", str(a.seq_len), "--sizes", *a.sizes, "--dtypes", *a.dtypes,
               "--micro-batches", *map(str, a.micro_batches), "--microbatches", *map(str, a.microbatches),
               "--checkpointing", *a.checkpointing]
        t0 = time.time()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            print(f"{text}: torchrun failed (exit {proc.returncode})\n{proc.stderr[-3000:]}", file=sys.stderr)
            continue
        for line in proc.stdout.splitlines():
            if not line.startswith("RESULT "):
                continue
            r = json.loads(line[len("RESULT "):])
            args = model_args_for(r["size"], vocab, max_seq_len=max(a.seq_len, 8))
            est = estimate_memory(args, layout, a.seq_len, r["micro_batch"], r["dtype"], r["ckpt"] == "on",
                                  microbatches=r["microbatches"], device="cpu")
            measured = max(r["peaks"])
            ratios.append(est.total / measured)
            print(f"{text:<16} {r['size']:<6} {r['dtype']:<9} {r['ckpt']:<4} {r['micro_batch']:>3} "
                  f"{r['microbatches']:>4} {measured / 1e6:>11.2f} {est.total / 1e6:>11.2f} "
                  f"{est.total / measured:>6.3f}  {est.phase:<9} "
                  + " ".join(f"{p / 1e6:.1f}" for p in r["peaks"]), flush=True)
        print(f"# {text}: {time.time() - t0:.0f} s", file=sys.stderr)
    if ratios:
        print(f"estimate / measured: min {min(ratios):.3f}, max {max(ratios):.3f} over {len(ratios)} rows")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="+", default=LAYOUTS)
    p.add_argument("--sizes", nargs="+", default=["debug", "small"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--micro-batches", nargs="+", type=int, default=[2, 8])
    p.add_argument("--microbatches", nargs="+", type=int, default=[1, 2])
    p.add_argument("--checkpointing", nargs="+", choices=["off", "on"], default=["off"])
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    worker(a) if a.worker else driver(a)


if __name__ == "__main__":
    main()
