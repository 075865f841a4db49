"""MoE layer forward+backward tokens/s: grouped vs looped experts, against transformers' MoE blocks.

    python bench/moe_layer.py                       # 3 shapes x fp32/bf16, 3 interleaved repeats (~3 min)
    python bench/moe_layer.py --quick               # 2 repeats, shorter windows, no transformers eager row
    python bench/moe_layer.py --shapes mixtral --dtypes float32 --repeats 5

One ``lmforge.models.layers.moe.MoEFeedForward`` (router + ``GroupedExperts``) on ``--tokens`` tokens
(as [2, tokens/2, dim]), timed as forward + ``backward(g)`` with a fixed random upstream gradient
``g`` (parameter gradients set to None before each call, as ``zero_grad`` does). Module and input
are cast to the dtype (no autocast: ``grouped_mm`` is not autocast-enabled). Rows:

* ``grouped``: ``experts.impl = "grouped"``, one ``F.grouped_mm`` per projection;
* ``loop``: ``experts.impl = "loop"``, one ``F.linear`` per expert and projection (over ``unbind`` views);
* ``hf eager`` / ``hf grouped_mm``: transformers' own block of the family (``OlmoeSparseMoeBlock``,
  ``MixtralSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``) with ``experts_implementation`` ``"eager"``
  (a Python loop over the experts hit) or ``"grouped_mm"``, loaded with identical weights.

Before timing, every row's output and input gradient are compared with ``grouped``'s on the same
input: in fp32 they must agree to 1e-4 (max abs difference, asserted); in bf16 the difference is
printed. Repeats are interleaved (the order rotates every repeat) and each measurement runs calls
for at least ``--min-time`` seconds after one discarded warm-up call. A row whose warm-up call
takes longer than ``--slow-s`` *and* 4x the fastest warm-up of its (shape, dtype) is not repeated:
that first call is its only measurement (the "runs" column says so; it includes first-call setup,
so it errs on the slow side). Such rows are many times slower than the rest, so one call is enough
to rank them, and the whole run stays within a few minutes.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_benchmark, loadavg, machine, markdown_table, median, spread  # noqa: E402

from lmforge.models.configs import MLPConfig, MoEConfig, RouterConfig  # noqa: E402
from lmforge.models.layers.moe import GroupedExperts, MoEFeedForward  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# name -> (dim, expert hidden, experts, top-k, renormalise top-k, transformers family)
SHAPES = {
    "olmoe": (512, 256, 64, 8, False, "olmoe"),      # OLMoE-1B-7B scaled down (dim 2048 -> 512, hidden 1024 -> 256)
    "mixtral": (512, 1792, 8, 2, True, "mixtral"),   # Mixtral-8x7B scaled down (4096/14336 -> 512/1792)
    "qwen3moe": (512, 192, 128, 8, True, "qwen3_moe"),  # Qwen3-30B-A3B scaled down (2048/768 -> 512/192)
}
IMPLS = ("grouped", "loop", "hf eager", "hf grouped_mm")
SLOW_FACTOR = 4.0  # a "slow" row's warm-up also took this many times the cell's fastest warm-up


# ------------------------------------------------------------------------------------ transformers
def hf_block(family: str, moe: MoEFeedForward, dim: int, hidden: int, n_experts: int, top_k: int,
             norm_topk: bool) -> torch.nn.Module:
    """transformers' MoE block of ``family`` with ``moe``'s weights (fp32, before any cast)."""
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        cfg = MixtralConfig(hidden_size=dim, intermediate_size=hidden, num_local_experts=n_experts,
                            num_experts_per_tok=top_k, router_jitter_noise=0.0, hidden_act="silu")
    elif family == "olmoe":
        from transformers import OlmoeConfig
        from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock as Block

        cfg = OlmoeConfig(hidden_size=dim, intermediate_size=hidden, num_experts=n_experts,
                          num_experts_per_tok=top_k, norm_topk_prob=norm_topk, hidden_act="silu")
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        cfg = Qwen3MoeConfig(hidden_size=dim, moe_intermediate_size=hidden, num_experts=n_experts,
                             num_experts_per_tok=top_k, norm_topk_prob=norm_topk, hidden_act="silu")
    block = Block(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(moe.router.weight)
        # transformers: gate_up_proj [E, 2 * hidden, dim] = [gate; up], down_proj [E, dim, hidden]
        block.experts.gate_up_proj.copy_(torch.cat([moe.experts.w1, moe.experts.w3], dim=1))
        block.experts.down_proj.copy_(moe.experts.w2)
    block.experts.config._experts_implementation = "eager"
    return block


# ------------------------------------------------------------------------------------ one cell
class Cell:
    """One (shape, dtype): the modules, the input, and a call per implementation."""

    def __init__(self, shape: str, dtype: torch.dtype, tokens: int, impls: list[str]) -> None:
        dim, hidden, n_experts, top_k, norm_topk, family = SHAPES[shape]
        torch.manual_seed(0)
        self.moe = MoEFeedForward(MoEConfig(dim, RouterConfig(n_experts, top_k, norm_topk=norm_topk), MLPConfig(dim, hidden)))
        self.hf = (hf_block(family, self.moe, dim, hidden, n_experts, top_k, norm_topk)
                   if any(i.startswith("hf") for i in impls) else None)
        self.moe.to(dtype)
        if self.hf is not None:
            self.hf.to(dtype)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(2, tokens // 2, dim, generator=g).to(dtype).requires_grad_()
        self.g = torch.randn(2, tokens // 2, dim, generator=g).to(dtype)

    def call(self, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward+backward with ``impl``; (output, input gradient), detached."""
        experts = self.moe.experts
        if impl.startswith("hf"):
            module = self.hf
            module.experts.config._experts_implementation = impl.split(" ", 1)[1]
        else:
            module = self.moe
            experts.impl = impl
        module.zero_grad(set_to_none=True)
        self.x.grad = None
        y = module(self.x)
        y.backward(self.g)
        return y.detach(), self.x.grad.detach()


def time_calls(cell: Cell, impl: str, tokens: int, min_time: float) -> float:
    """tokens/s over as many calls as fit in ``min_time`` seconds (at least one)."""
    n, t0 = 0, time.perf_counter()
    while True:
        cell.call(impl)
        n += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= min_time:
            return n * tokens / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {','.join(SHAPES)}")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--impls", default=None, help=f"comma-separated subset of {','.join(IMPLS)} (default: all; "
                                                 "--quick drops 'hf eager')")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per call")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--min-time", type=float, default=0.5, help="seconds of calls per measurement")
    p.add_argument("--slow-s", type=float, default=5.0,
                   help="a row whose warm-up call takes longer is measured by that call alone")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--quick", action="store_true", help="--repeats 2 --min-time 0.3, without 'hf eager'")
    p.add_argument("--append", action="store_true", help="also append the section to BENCHMARKS.md")
    a = p.parse_args()
    if a.quick:
        a.repeats, a.min_time = min(a.repeats, 2), min(a.min_time, 0.3)
    impls = (a.impls.split(",") if a.impls else [i for i in IMPLS if not (a.quick and i == "hf eager")])
    if "grouped" not in impls:
        impls.insert(0, "grouped")  # the reference the outputs are checked against
    if a.threads:
        torch.set_num_threads(a.threads)
    shapes, dtypes = a.shapes.split(","), a.dtypes.split(",")
    load_before, t_start = loadavg(), time.perf_counter()

    rows = []
    for shape in shapes:
        for dname in dtypes:
            dtype = DTYPES[dname]
            cell = Cell(shape, dtype, a.tokens, impls)
            # Warm-up call of every row, checked against grouped; slow rows keep it as their measurement.
            ref_y = ref_gx = None
            diffs, results, first_call = {}, {}, {}
            for impl in impls:
                t0 = time.perf_counter()
                y, gx = cell.call(impl)
                first_call[impl] = time.perf_counter() - t0
                if ref_y is None:
                    ref_y, ref_gx = y.float(), gx.float()
                d = max((y.float() - ref_y).abs().max().item(), (gx.float() - ref_gx).abs().max().item())
                diffs[impl] = d
                if dtype == torch.float32 and d > 1e-4:
                    raise SystemExit(f"{shape} {dname} {impl}: output/input-grad differ from grouped by {d:.2e} > 1e-4")
                print(f"  {shape:>8} {dname:<8} {impl:<13} warm-up {first_call[impl]:6.2f}s  "
                      f"max|diff| vs grouped {d:.1e}", flush=True)
            floor = min(first_call.values())
            for impl in impls:  # clearly slow rows: their first call is their measurement (see the docstring)
                if first_call[impl] > a.slow_s and first_call[impl] > SLOW_FACTOR * floor:
                    results[impl] = [a.tokens / first_call[impl]]
            fast = [i for i in impls if i not in results]
            for r in range(a.repeats):
                for impl in fast[r % len(fast):] + fast[: r % len(fast)] if fast else []:
                    tps = time_calls(cell, impl, a.tokens, a.min_time)
                    results.setdefault(impl, []).append(tps)
                    print(f"  {shape:>8} {dname:<8} repeat {r + 1}/{a.repeats} {impl:<13} {tps:>10,.0f} tokens/s "
                          f"(load {loadavg()})", flush=True)
            loop = median(results["loop"]) if "loop" in results else float("nan")
            dim, hidden, n_experts, top_k, _, _ = SHAPES[shape]
            for impl in impls:
                xs = results[impl]
                m = median(xs)
                runs = "1 (first call)" if impl not in fast else f"{len(xs)}"
                rows.append([f"{shape} ({dim}/{hidden}, {n_experts}e top-{top_k})", dname, impl, f"{m:,.0f}",
                             spread(xs), runs, f"{m / loop:.2f}" if loop == loop else "-", f"{diffs[impl]:.1e}"])
            del cell
            gc.collect()

    table = markdown_table(["shape (dim/expert hidden, experts, top-k)", "dtype", "impl", "tokens/s (median)",
                            "range", "runs", "vs loop", "max abs diff vs grouped"], rows)
    cmd = "python bench/moe_layer.py " + " ".join(x for x in sys.argv[1:] if x != "--append")
    body = (f"Machine: {machine(torch.device('cpu'))}, {torch.get_num_threads()} torch threads. "
            f"Load average before/after: {load_before} / {loadavg()}. "
            f"Wall time {time.perf_counter() - t_start:.0f}s.\n\n"
            f"Settings: one MoE layer, {a.tokens} tokens per call, forward+backward (fixed random upstream "
            f"gradient), module and input in the dtype, {a.repeats} interleaved repeats of >= {a.min_time}s each "
            f"after a warm-up; rows whose warm-up call took > {a.slow_s}s and > {SLOW_FACTOR:g}x the fastest "
            f"warm-up are that one call. "
            f"fp32 outputs and input gradients asserted equal to `grouped`'s within 1e-4.\n\n"
            f"Command: `{cmd.strip()}`\n\n{table}\n")
    print("\n" + body)
    if a.append:
        append_benchmark("MoE layer throughput", body)


if __name__ == "__main__":
    main()
