"""Peak memory and time of the distillation loss: full logits of both models vs the chunked divergence.

    python bench/distill_memory.py                        # V = 49152 (SmolLM2), 4096 target tokens
    python bench/distill_memory.py --vocab 152064 --tokens 2048 --chunk 512

Each mode runs in a fresh subprocess (so peaks do not mix): a tiny student (dim 64, 2 layers) and a
tiny teacher (dim 96, 2 layers) of the same vocabulary, one warm-up step, then ``--steps`` timed
forward+backward steps of the loss (no optimizer). Peak memory is the growth over the memory held
before the timed steps: the peak resident set on CPU (VmHWM, reset through /proc/self/clear_refs),
``max_memory_allocated`` on CUDA.

* ``full``: both models' [tokens, V] logits in fp32, the forward KL written with log_softmax, autograd;
* ``chunked``: :class:`lmforge.objectives.distill.DistillLoss` with ``--chunk`` rows of logits at once.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import step_peak_and_seconds  # noqa: E402

from lmforge.data.packing import Batch  # noqa: E402
from lmforge.models.load import ModelSource  # noqa: E402
from lmforge.models.model import ModelArgs, Transformer  # noqa: E402
from lmforge.objectives.distill import DistillLoss, DistillSettings  # noqa: E402
from lmforge.objectives.reference import FrozenReference  # noqa: E402


def _full_forward_kl(student: Transformer, teacher: Transformer, batch: Batch) -> torch.Tensor:
    with torch.no_grad():
        logp = torch.log_softmax(teacher(batch.input_ids).float(), -1)
    logq = torch.log_softmax(student(batch.input_ids).float(), -1)
    return (logp.exp() * (logp - logq)).sum()


def measure_one(mode: str, vocab: int, tokens: int, seq_len: int, chunk: int, steps: int, device: str) -> dict:
    torch.manual_seed(0)
    dev = torch.device(device)
    student = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=vocab, max_seq_len=seq_len)).to(dev)
    teacher = Transformer(ModelArgs(dim=96, n_layers=2, n_heads=4, vocab_size=vocab, max_seq_len=seq_len)).to(dev)
    student.init_weights(seed=0)
    teacher.init_weights(seed=1)
    teacher.requires_grad_(False)
    ids = torch.randint(0, vocab, (tokens // seq_len, seq_len + 1), device=dev)
    batch = Batch(input_ids=ids[:, :-1], labels=ids[:, 1:].clone())
    if mode == "full":
        loss_fn = lambda: _full_forward_kl(student, teacher, batch)  # noqa: E731
    else:
        distill = DistillLoss(FrozenReference(teacher, ModelSource("init", "1")),
                              DistillSettings("forward_kl", chunk_tokens=chunk))
        loss_fn = lambda: distill(student, batch)[0]  # noqa: E731

    def step() -> None:
        student.zero_grad(set_to_none=False)
        loss_fn().backward()

    peak_mb, seconds = step_peak_and_seconds(step, steps, dev)
    return {"mode": mode, "peak_mb": round(peak_mb, 1), "seconds": round(seconds, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(measure_one(**json.loads(args.one))))
        return
    print(f"vocab {args.vocab}, {args.tokens} target tokens, chunk {args.chunk}, device {args.device}")
    for mode in ("full", "chunked"):
        one = {"mode": mode, "vocab": args.vocab, "tokens": args.tokens, "seq_len": args.seq_len,
               "chunk": args.chunk, "steps": args.steps, "device": args.device}
        out = subprocess.run([sys.executable, __file__, "--one", json.dumps(one)], capture_output=True, text=True,
                             check=True)
        print(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
