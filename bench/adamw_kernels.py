"""AdamW's foreach vs fused kernels on a CPU, over the parameter shapes of SmolLM2-135M.

    python bench/adamw_kernels.py                # 2 threads, 5 interleaved steps each

One optimizer step over 272 tensors (the tied 49152 x 576 embedding, 30 blocks' seven projections and
their norms), gradients fixed, both optimizers stepping the same way in turn; then both kernels run 3
steps from equal parameters and the largest difference is printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import loadavg, machine  # noqa: E402

BLOCK = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536), (576,), (576,)]
SHAPES = [(49152, 576)] + BLOCK * 30 + [(576,)]


def parameters(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in SHAPES]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return ps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"{machine(torch.device('cpu'))}; {a.threads} threads; load {loadavg()}")
    kinds = {"foreach": {"foreach": True}, "fused": {"fused": True}}
    opts = {k: torch.optim.AdamW(parameters(0), lr=1e-3, weight_decay=0.1, **kw) for k, kw in kinds.items()}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for o in opts.values():
        o.step()  # the moments are created here
    for _ in range(a.steps):
        for k, o in opts.items():
            t0 = time.perf_counter()
            o.step()
            times[k].append(time.perf_counter() - t0)
    n = sum(torch.Size(s).numel() for s in SHAPES)
    for k, ts in times.items():
        print(f"{k:8s} {statistics.median(ts) * 1e3:8.0f} ms per step ({n / 1e6:.0f}M parameters)")
    print(f"fused is {statistics.median(times['foreach']) / statistics.median(times['fused']):.1f}x faster")
    a_ps, b_ps = parameters(1), parameters(1)
    oa = torch.optim.AdamW(a_ps, lr=1e-3, weight_decay=0.1, foreach=True)
    ob = torch.optim.AdamW(b_ps, lr=1e-3, weight_decay=0.1, fused=True)
    for _ in range(3):
        oa.step()
        ob.step()
    diff = max((x - y).abs().max().item() for x, y in zip(a_ps, b_ps))
    print(f"largest parameter difference after 3 steps: {diff:.2g}; load {loadavg()}")


if __name__ == "__main__":
    main()
