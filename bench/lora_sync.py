"""Bytes and seconds of one weight sync into lmforge's rollout engine for a LoRA policy: full weights
vs adapters only.

    python bench/lora_sync.py                          # SmolLM2-135M's shape, rank 16, 5 syncs each (~1 min)
    python bench/lora_sync.py --size debug --rank 8 --append

A model of ``--size`` (random weights, SmolLM2's 49,152-token vocabulary) gets LoRA adapters on every
attention and MLP projection (``lora.rank``), as ``[lora] enabled = true`` gives it. lmforge's engine with
its own copy of the weights (what ``grpo.async_steps`` uses) loads it once, then ``--syncs`` times after
the adapters moved, timed:

* ``adapters only``: what the engine does for a LoRA policy: the tensors training can change (the adapters)
  are copied into its copy, whose adapter layers apply them live;
* ``full weights``: every tensor of the state dict copied (what a policy without adapters syncs, and what
  the engine did before).

The third row is the arithmetic of vLLM's merged path (``grpo.engine = "vllm"`` with LoRA): the merged
full weights in the rollout dtype, the bytes ``rollout/sync_bytes`` logs for it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_benchmark, machine, markdown_table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="smollm2-135m")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--append", action="store_true", help="append the table to BENCHMARKS.md")
    args = ap.parse_args()
    torch.set_num_threads(2)

    from lmforge.config import LoraSection
    from lmforge.models.lora import apply_lora
    from lmforge.models.model import Transformer, model_args_for
    from lmforge.rl.engines.lmforge_engine import LmforgeEngine

    torch.manual_seed(0)
    model = apply_lora(Transformer(model_args_for(args.size, 49152)), LoraSection(enabled=True, rank=args.rank))
    rows, bytes_by = [], {}
    for mode in ("adapters only", "full weights"):
        engine = LmforgeEngine(pad_id=0, copy_weights=True)
        engine.load_weights(model, 0)
        if mode == "full weights":
            engine.changing = None  # every tensor, as without adapters
        seconds = []
        for v in range(1, args.syncs + 1):
            with torch.no_grad():
                for p in model.parameters():
                    if p.requires_grad:
                        p.add_(1e-3)
            t0 = time.perf_counter()
            engine.load_weights(model, v)
            seconds.append(time.perf_counter() - t0)
        assert all(torch.equal(a, b) for a, b in zip(engine.model.state_dict().values(), model.state_dict().values()))
        bytes_by[mode] = engine.sync_bytes
        rows.append([mode, f"{engine.sync_bytes:,}", f"{statistics.median(seconds) * 1e3:.2f}",
                     f"{min(seconds) * 1e3:.2f}-{max(seconds) * 1e3:.2f}"])
        engine.close()
    unique = {id(p): p for p in model.parameters()}.values()
    merged_bf16 = sum(p.numel() for p in unique if p.requires_grad is False) * 2  # the merged base, bf16
    rows.append(["vLLM, merged (bf16), arithmetic", f"{merged_bf16:,}", "-", "-"])
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    table = markdown_table(["sync into lmforge's engine", "bytes per sync", "median ms", "range ms"], rows)
    ratio = bytes_by["full weights"] / bytes_by["adapters only"]
    body = (f"`python bench/lora_sync.py --size {args.size} --rank {args.rank}`: {args.size} shape, LoRA rank "
            f"{args.rank} on every attention and MLP projection ({trainable:,} trainable parameters), fp32, "
            f"{args.syncs} syncs each; {machine(torch.device('cpu'))}.\n\n{table}\n\n"
            f"Adapters only: {ratio:.0f}x fewer bytes a sync.\n")
    print(body)
    if args.append:
        append_benchmark("LoRA RL weight sync: full weights vs adapters only", body)


if __name__ == "__main__":
    main()
