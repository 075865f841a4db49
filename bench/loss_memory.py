"""Memory and time of the next-token loss: full logits vs the chunked loss, over vocabulary sizes.

    python bench/loss_memory.py                               # V = 32k, 128k, 152k; 8192 tokens
    python bench/loss_memory.py --tokens 2048 --max-gb 12 --no-append

Each configuration runs in a fresh subprocess (so peaks do not mix): a tiny model (dim 64, 2 layers),
one warm-up step, then ``--steps`` timed forward+backward steps of the loss (no optimizer).
Peak memory is the growth over the memory held before the first step: on CPU the peak resident set
(VmHWM, reset through /proc/self/clear_refs), on CUDA ``max_memory_allocated``.

* ``full``: the loss as computed before chunking: all [tokens, V] logits, fp32, one ``F.cross_entropy``;
* ``chunked``: ``cross_entropy_loss`` with ``training.loss_chunk_tokens`` (every position a target);
* ``chunked, N% targets``: the same with only N% of positions carrying loss (SFT masks prompts).

A full-logits run whose estimated peak (4 fp32 copies of the logits) exceeds ``--max-gb`` is not run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_benchmark, loadavg, machine, markdown_table, step_peak_and_seconds  # noqa: E402

from lmforge.data.packing import IGNORE_INDEX, Batch  # noqa: E402
from lmforge.models.model import ModelArgs, Transformer  # noqa: E402
from lmforge.objectives.next_token import cross_entropy_loss  # noqa: E402

VOCABS = (32_000, 128_256, 152_064)  # Llama 2, Llama 3.1, Qwen2.5


def _full_cross_entropy(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    logits = model(batch.input_ids).float().flatten(0, 1)
    return F.cross_entropy(logits, batch.labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def measure_one(vocab: int, mode: str, tokens: int, seq_len: int, chunk: int, target_fraction: float,
                steps: int, device: str) -> dict:
    """One configuration in this process: peak memory growth (MB) and seconds per step."""
    torch.manual_seed(0)
    dev = torch.device(device)
    model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=vocab, max_seq_len=seq_len)).to(dev)
    model.init_weights(seed=0)
    ids = torch.randint(0, vocab, (tokens // seq_len, seq_len + 1), device=dev)
    labels = ids[:, 1:].clone()
    labels[:, : int(seq_len * (1 - target_fraction))] = IGNORE_INDEX  # the prompt part carries no loss
    batch = Batch(input_ids=ids[:, :-1], labels=labels)
    if mode == "full":
        loss_fn = _full_cross_entropy
    else:
        loss_fn = lambda m, b: cross_entropy_loss(m, b, chunk_tokens=chunk)[0]  # noqa: E731

    def step() -> None:
        model.zero_grad(set_to_none=False)  # gradients of the parameters stay allocated: not loss memory
        loss_fn(model, batch).backward()

    peak_mb, seconds = step_peak_and_seconds(step, steps, dev)
    return {"peak_mb": peak_mb, "seconds": seconds}


def run_in_subprocess(args: argparse.Namespace, vocab: int, mode: str, target_fraction: float) -> dict:
    cmd = [sys.executable, __file__, "--one", json.dumps({
        "vocab": vocab, "mode": mode, "tokens": args.tokens, "seq_len": args.seq_len, "chunk": args.chunk,
        "target_fraction": target_fraction, "steps": args.steps, "device": args.device})]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocabs", default=",".join(map(str, VOCABS)))
    p.add_argument("--tokens", type=int, default=8192, help="tokens per step (batch x seq_len)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--chunk", type=int, default=1024, help="training.loss_chunk_tokens of the chunked runs")
    p.add_argument("--target-fraction", type=float, default=0.25, help="targets per row of the SFT-like run")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-gb", type=float, default=8.0, help="skip full-logits runs estimated above this")
    p.add_argument("--no-append", action="store_true", help="print only, do not append to BENCHMARKS.md")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure_one(**json.loads(args.one))))
        return

    load_before = loadavg()
    rows = []
    sft = f"chunked, {args.target_fraction:.0%} targets"
    for vocab in map(int, args.vocabs.split(",")):
        full_gb = 4 * args.tokens * vocab * 4 / 1e9
        results = {}
        for mode, frac in (("full", 1.0), ("chunked", 1.0), (sft, args.target_fraction)):
            if mode == "full" and full_gb > args.max_gb:
                results[mode] = None
                rows.append([f"{vocab:,}", mode, f"not run (est. {full_gb:.0f} GB > --max-gb)", "-", "-"])
                continue
            r = results[mode] = run_in_subprocess(args, vocab, "full" if mode == "full" else "chunked", frac)
            full = results.get("full")
            ratio = f"{full['peak_mb'] / max(r['peak_mb'], 1e-9):.1f}x" if full and mode != "full" else "-"
            rows.append([f"{vocab:,}", mode, f"{r['peak_mb']:,.0f}", ratio, f"{r['seconds']:.2f}"])
            print(" | ".join(rows[-1]), flush=True)

    table = markdown_table(["vocab", "loss", "peak memory growth (MB)", "less memory than full", "s/step"], rows)
    cmd = "python bench/loss_memory.py " + " ".join(a for a in sys.argv[1:] if a != "--no-append")
    body = (f"Machine: {machine(torch.device(args.device))}. Load average before/after: {load_before} / "
            f"{loadavg()}.\n\nSettings: model dim 64, 2 layers, {args.tokens} tokens per step (seq_len "
            f"{args.seq_len}), chunk {args.chunk} tokens, device {args.device}, fp32, forward+backward of the "
            f"loss, median of {args.steps} steps after a warm-up, each configuration in a fresh process. "
            f"Peak memory: growth of the peak resident set (CPU) or of max_memory_allocated (CUDA) over what "
            f"was held before the step.\n\nCommand: `{cmd.strip()}`\n\n{table}\n")
    print("\n" + table)
    if not args.no_append:
        append_benchmark("Loss memory", body)


if __name__ == "__main__":
    main()
