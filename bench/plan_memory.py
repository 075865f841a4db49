"""The planner's estimate (lmforge.planning.planner) against the measured peak of live tensor memory of a
real train step in this process (lmforge.planning.memory_probe), on the CPU.

    PYTHONPATH=src python bench/plan_memory.py [--sizes debug small smollm2-135m] [--seq-len 256] [--micro-batch 8]
        [--dtypes float32 bfloat16] [--checkpointing both|on|off] [--vocab N]
"""

from __future__ import annotations

import argparse

import torch

from lmforge.models.args import model_args_for
from lmforge.models.tokenizer import ByteTokenizer
from lmforge.planning.memory_probe import measure_train_step
from lmforge.parallel.dims import ParallelDims
from lmforge.planning.planner import estimate_memory


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=["debug", "small", "smollm2-135m"])
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=1)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--checkpointing", choices=["both", "on", "off"], default="both")
    p.add_argument("--vocab", type=int, default=0, help="vocabulary size (default: the byte tokenizer's)")
    a = p.parse_args()
    torch.set_num_threads(1)
    vocab = a.vocab or ByteTokenizer().vocab_size
    ckpts = {"both": (False, True), "on": (True,), "off": (False,)}[a.checkpointing]
    print(f"seq_len {a.seq_len}, micro batch {a.micro_batch}, {a.microbatches} microbatch(es) per step, AdamW, "
          f"vocab {vocab}; MB = 1e6 bytes, peak of the second step")
    print(f"{'size':<14} {'dtype':<9} {'ckpt':<4} {'measured MB':>11} {'estimate MB':>11} {'ratio':>6}  phase")
    for size in a.sizes:
        args = model_args_for(size, vocab, max_seq_len=max(a.seq_len, 8))
        for dtype in a.dtypes:
            for ckpt in ckpts:
                m = measure_train_step(args, seq_len=a.seq_len, micro_batch=a.micro_batch, dtype=dtype,
                                       checkpointing=ckpt, microbatches=a.microbatches)
                e = estimate_memory(args, ParallelDims.of(), a.seq_len, a.micro_batch, dtype, ckpt,
                                    microbatches=a.microbatches, device="cpu")
                print(f"{size:<14} {dtype:<9} {'on' if ckpt else 'off':<4} {m.peak / 1e6:>11.2f} "
                      f"{e.total / 1e6:>11.2f} {e.total / m.peak:>6.3f}  {e.phase}")


if __name__ == "__main__":
    main()
