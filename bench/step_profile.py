"""Where one training step's time goes: torch.profiler over the pretraining train step, CPU or GPU.

    python bench/step_profile.py --size small --dtype bfloat16          # top ops by self time
    python bench/step_profile.py --size small --dtype float32 --rows 30
    python bench/step_profile.py --size small --ab                       # fp32 vs bf16 step times, auto's pick
    python bench/step_profile.py --size small --vs-bare --threads 1      # the trainer's step vs a bare one

The step is the trainer's own: the pretraining objective's loss (chunked cross-entropy through the
model's output head), ``gradient_computation`` under the run's autocast, then ``run_optimizer_step``
(clip, AdamW, zero_grad), on a fixed batch of the packed embedded corpus. The table groups the
profiler's ops by name, sorted by self time, and the totals by kind (matmuls, casts, optimizer, ...)
so the share the matmuls get, the part that runs at the matmul peak, is one line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import loadavg, machine  # noqa: E402

from lmforge.data.corpus import embedded_corpus  # noqa: E402
from lmforge.data.packing import PackedTokenDataset, collate  # noqa: E402
from lmforge.models.flops import flops_per_token  # noqa: E402
from lmforge.models.model import Transformer, model_args_for  # noqa: E402
from lmforge.models.tokenizer import load_tokenizer  # noqa: E402
from lmforge.objectives.next_token import NextTokenObjective  # noqa: E402
from lmforge.runtime.precision import choose_dtype  # noqa: E402
from lmforge.optim.adamw import build_optimizer  # noqa: E402
from lmforge.parallel.plans import apply_compile  # noqa: E402
from lmforge.training.train_step import gradient_computation, run_optimizer_step  # noqa: E402

KINDS = {  # op-name fragments -> kind, first match wins
    "matmul": ("mm", "addmm", "linear", "matmul", "bmm", "baddbmm"),
    "attention": ("scaled_dot_product", "flash_attention", "efficient_attention", "_softmax", "masked_fill"),
    "cast/copy": ("_to_copy", "copy_", "to", "clone", "contiguous"),
    "optimizer": ("_foreach", "_fused_adam", "lerp", "addcdiv", "addcmul", "sqrt", "norm"),
}


def kind(name: str) -> str:
    base = name.replace("aten::", "")
    for k, frags in KINDS.items():
        if base in frags or (k != "matmul" and any(f in base for f in frags)):
            return k
    return "other"


class Step:
    """One train step of a model (the loop's pieces), callable repeatedly on a fixed batch."""

    def __init__(self, size: str, dtype: str, seq_len: int, batch: int, device: torch.device,
                 compile_blocks: bool = False) -> None:
        tok = load_tokenizer("byte")
        self.args = model_args_for(size, tok.vocab_size)
        data = PackedTokenDataset(embedded_corpus("train"), tok, seq_len)
        self.batch = collate([data[i] for i in range(batch)]).to(device)
        torch.manual_seed(0)
        self.model = Transformer(self.args).to(device)
        self.model.init_weights(seed=0)
        if compile_blocks:
            apply_compile(self.model)
        self.opt = build_optimizer(self.model, 3e-3, 0.1, (0.9, 0.95), 1e-8)
        self.objective = NextTokenObjective()
        self.dtype, self.device = dtype, device
        self.tokens = batch * seq_len
        self.flops = flops_per_token(self.args, seq_len) * self.tokens

    def __call__(self) -> None:
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.dtype == "bfloat16" else None
        mbs = [self.batch]
        gradient_computation(self.model, mbs, self.objective.loss_fn, self.objective.normalizer(mbs), autocast)
        run_optimizer_step(self.model, self.opt, 1e-3, 1.0)
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def bare_step(size: str, seq_len: int, batch: int, device: torch.device, clip: bool = False,
              head: bool = False) -> Callable[[], None]:
    """A bare fp32 step (forward, full-logits cross-entropy, backward, one-group fused AdamW, zero_grad) on
    the batch a :class:`Step` uses; ``clip`` adds the trainer's grad clipping, ``head`` its chunked loss."""
    s = Step(size, "float32", seq_len, batch, device)
    opt = torch.optim.AdamW(s.model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), fused=True)

    def step() -> None:
        if head:
            objective, stats = s.objective.loss_fn(s.model, s.batch)
            loss = objective / stats.target_tokens
        else:
            loss = F.cross_entropy(s.model(s.batch.input_ids).float().flatten(0, 1), s.batch.labels.flatten())
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(s.model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def vs_bare(a: argparse.Namespace, device: torch.device) -> None:
    """The trainer's step pieces against a bare step and the bare step plus each piece, interleaved, in
    process CPU seconds (what other processes on a shared machine do not change); min and median."""
    steps: dict[str, Callable[[], None]] = {
        "bare": bare_step(a.size, a.seq_len, a.batch, device),
        "bare + grad clip": bare_step(a.size, a.seq_len, a.batch, device, clip=True),
        "bare + chunked loss": bare_step(a.size, a.seq_len, a.batch, device, head=True),
        "trainer step": Step(a.size, "float32", a.seq_len, a.batch, device)}
    times: dict[str, list[float]] = {k: [] for k in steps}
    for f in steps.values():
        f(), f()
    names = list(steps)
    for r in range(a.steps):
        for k in names[r % len(names):] + names[:r % len(names)]:
            for _ in range(3):
                t0 = time.process_time()
                steps[k]()
                times[k].append(time.process_time() - t0)
    lo = min(times["bare"])
    for k, ts in times.items():
        print(f"{k:<20} min {min(ts) * 1e3:8.1f} ms  median {statistics.median(ts) * 1e3:8.1f} ms  "
              f"bare/this (min) {lo / min(ts):.3f}")
    print(f"load after: {loadavg()}")


def time_steps(step: Step, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="profiled steps (after 3 warm-up steps)")
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--compile", action="store_true", help="each block compiled, as training.compile does")
    p.add_argument("--ab", action="store_true", help="only time fp32 and bf16 steps, interleaved")
    p.add_argument("--vs-bare", action="store_true", help="the trainer's fp32 step vs a bare one (CPU seconds)")
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(a.threads)
    print(f"{machine(device)}; {torch.get_num_threads()} threads; load {loadavg()}")
    if a.vs_bare:
        vs_bare(a, device)
        return
    if a.ab:
        steps = {d: Step(a.size, d, a.seq_len, a.batch, device) for d in ("float32", "bfloat16")}
        times: dict[str, list[float]] = {d: [] for d in steps}
        for d, s in steps.items():
            time_steps(s, 3)
        for _ in range(a.steps):
            for d, s in steps.items():
                times[d] += time_steps(s, 2)
        for d, ts in times.items():
            m = statistics.median(ts)
            print(f"{a.size} {d}: median step {m * 1e3:.1f} ms, {steps[d].tokens / m:,.0f} tokens/s, "
                  f"{steps[d].flops / m / 1e9:.1f} GFLOP/s")
        print(f"bf16 / fp32 speed: {statistics.median(times['float32']) / statistics.median(times['bfloat16']):.2f}x"
              f" (load {loadavg()})")
        nonemb = steps["float32"].model.num_params(exclude_embeddings=True)
        print("training.dtype=auto here: %s (%s)" % choose_dtype("auto", device, nonemb))
        return
    step = Step(a.size, a.dtype, a.seq_len, a.batch, device, compile_blocks=a.compile)
    time_steps(step, 3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ts = time_steps(step, a.steps)
    wall = statistics.median(ts)
    print(f"{a.size} {a.dtype}{' compiled' if a.compile else ''}: median profiled step {wall * 1e3:.1f} ms ({step.tokens / wall:,.0f} tokens/s; "
          f"profiler overhead included), {step.flops / wall / 1e9:.1f} GFLOP/s")
    print_profile(prof, a.steps, a.rows)
    print(f"load after: {loadavg()}")


def print_profile(prof: torch.profiler.profile, steps: int, rows: int) -> None:
    """The profiler's ops by self time per step, and the shares by kind."""
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: -e.self_cpu_time_total)
    print(f"{'op':<44} {'self ms/step':>12} {'share':>7} {'calls/step':>10}")
    for e in events[:rows]:
        print(f"{e.key[:44]:<44} {e.self_cpu_time_total / 1e3 / steps:>12.2f} "
              f"{100 * e.self_cpu_time_total / total:>6.1f}% {e.count / steps:>10.0f}")
    by_kind: dict[str, float] = {}
    for e in events:
        by_kind[kind(e.key)] = by_kind.get(kind(e.key), 0.0) + e.self_cpu_time_total
    print("by kind: " + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
