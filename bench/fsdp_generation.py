"""Generation from an FSDP2-sharded model: gather once per rollout, or all-gather per token.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node=2 bench/fsdp_generation.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node=2 bench/fsdp_generation.py --size small --new-tokens 64

``once`` is :func:`lmforge.distributed.full_parameters` (every FSDP unit unsharded before decoding,
resharded after). ``per token`` lets FSDP2's hooks gather each block's parameters for every decode
forward and free them after (``hidden_states`` registered as a forward method, generation outside
inference mode, which FSDP's reused buffers need). Both decode greedily the same prompts, all rows
to ``--new-tokens``, and must return the same tokens as the unsharded model.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, markdown_table, median  # noqa: E402

from lmforge.distributed import full_parameters  # noqa: E402
from lmforge.runtime.world import init_distributed  # noqa: E402
from lmforge.parallel.plans import data_parallel  # noqa: E402
from lmforge.models.generate import generate  # noqa: E402
from lmforge.models.args import model_args_for  # noqa: E402
from lmforge.models.model import Transformer  # noqa: E402


def per_token(model: Transformer, prompts: list[list[int]], n: int) -> list[list[int]]:
    from torch.distributed.fsdp import register_fsdp_forward_method

    register_fsdp_forward_method(model, "hidden_states")  # as full_parameters does
    inference_mode = torch.inference_mode
    torch.inference_mode = torch.no_grad  # type: ignore[assignment]  # FSDP's gathered buffers are reused in training
    try:
        return generate(model, prompts, n, pad_id=0, temperature=0.0)
    finally:
        torch.inference_mode = inference_mode  # type: ignore[assignment]
        del model.hidden_states


def once(model: Transformer, prompts: list[list[int]], n: int) -> list[list[int]]:
    with full_parameters(model) as m:
        return generate(m, prompts, n, pad_id=0, temperature=0.0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="debug")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    info = init_distributed("cpu")
    torch.set_num_threads(1)
    args = model_args_for(a.size, 320)
    plain = Transformer(args)
    plain.init_weights(seed=0)
    model = Transformer(args)
    model.init_weights(seed=0)
    model = data_parallel(model, "fsdp", info.device)
    prompts = [[1 + (i * 7 + j) % 300 for j in range(12)] for i in range(a.batch)]
    want = generate(plain, prompts, a.new_tokens, pad_id=0, temperature=0.0)
    times: dict[str, list[float]] = {"once": [], "per token": []}
    for _ in range(a.repeats):  # interleaved, so machine noise hits both alike
        for name, fn in (("once", once), ("per token", per_token)):
            dist.barrier()
            t0 = time.perf_counter()
            got = fn(model, prompts, a.new_tokens)
            times[name].append(time.perf_counter() - t0)
            assert got == want, f"{name}: tokens differ from the unsharded model"
    if info.rank == 0:
        tokens = a.batch * a.new_tokens
        rows = [[name, f"{median(t) * 1000:,.0f}", f"{tokens / median(t):,.0f}"] for name, t in times.items()]
        print(f"{a.size} model ({sum(q.numel() for q in plain.parameters()) / 1e6:.1f}M params), 2 ranks x batch "
              f"{a.batch}, {a.new_tokens} new tokens, gloo; {machine(info.device)}\n")
        print(markdown_table(["FSDP2 generation", "ms (median)", "new tokens/s per rank"], rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
