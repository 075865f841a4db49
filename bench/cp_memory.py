"""Peak memory per rank of a context-parallel train step against one process, at growing T.

    python bench/cp_memory.py                       # T = 8k, 16k, 32k; the dense path at 8k only
    python bench/cp_memory.py --seq-lens 8192 16384 32768 65536 --dense-max 16384 --append

Each configuration runs in fresh processes (``torch.multiprocessing`` with gloo on the CPU, one thread
each): one process on the whole row, or ``--cp`` ranks each holding ``T / cp`` tokens (load-balanced
split), with blockwise attention (now) or the dense ``[B, 1, T/cp, T]`` mask and SDPA (before,
``context_attention.DENSE``). A tiny Llama-shaped model (2 layers, dim 64, 4 heads over 2 kv heads,
byte vocabulary), one causal row, forward + backward of the summed cross-entropy.

Two peaks per rank, of the step after a warm-up step: **live tensors** (``LiveTensorMemory``: every
storage an operator returns, counted until freed; blind to workspace inside one kernel) and the
growth of the process's **peak RSS** over the step (VmHWM reset before it; sees everything, allocator
caching included). The largest rank is reported.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_benchmark, markdown_table, machine  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _run(rank: int, world: int, seq_len: int, dense: bool, port: int, results: dict) -> None:
    """One rank (or the single process when ``world`` is 1): a warm-up step, then the measured one."""
    torch.set_num_threads(1)
    from lmforge.data.packing import Batch
    from lmforge.models.args import ModelArgs
    from lmforge.models.layers import context_attention
    from lmforge.models.model import Transformer
    from lmforge.objectives.next_token import cross_entropy_loss
    from lmforge.parallel.context_parallel import apply_cp, shard_batch
    from lmforge.planning.memory_probe import LiveTensorMemory

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=seq_len)
    model = Transformer(args)
    model.init_weights(seed=0)
    ids = torch.randint(0, 256, (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
    batch = Batch(ids[:, :-1], ids[:, 1:].clone())
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        apply_cp(model, dist.group.WORLD)
        batch = shard_batch(batch, rank, world)
        context_attention.DENSE = dense

    def step() -> None:
        model.zero_grad(set_to_none=False)
        cross_entropy_loss(model, batch)[0].backward()

    step()  # warm-up: gradients exist from here on
    mem = LiveTensorMemory()
    mem.track([p for p in model.parameters()] + [p.grad for p in model.parameters()])
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    rss0 = _status_kb("VmRSS")
    t0 = time.perf_counter()
    with mem:
        step()
    seconds = time.perf_counter() - t0
    results[rank] = (mem.peak / 2**20, (_status_kb("VmHWM") - rss0) / 1024, seconds)
    if world > 1:
        dist.destroy_process_group()


def measure(seq_len: int, world: int, dense: bool, port: int) -> tuple[float, float, float]:
    """(live-tensor peak MB, RSS growth MB, seconds) of the worst rank."""
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_run, args=(world, seq_len, dense, port, results), nprocs=world, start_method="spawn")
        worst = max(results.values())
        return worst[0], max(r[1] for r in results.values()), max(r[2] for r in results.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--dense-max", type=int, default=8192, help="longest T for the dense-mask path (memory)")
    ap.add_argument("--append", action="store_true", help="append the table to BENCHMARKS.md")
    a = ap.parse_args()
    rows = []
    port = 29611
    for T in a.seq_lens:
        cases = [("one process", 1, False), (f"cp={a.cp} blockwise", a.cp, False)]
        if T <= a.dense_max:
            cases.append((f"cp={a.cp} dense mask (before)", a.cp, True))
        for name, world, dense in cases:
            port += 1
            live, rss, seconds = measure(T, world, dense, port)
            rows.append([f"{T:,}", name, f"{live:,.0f}", f"{rss:,.0f}", f"{seconds:.1f}"])
            print(" | ".join(rows[-1]), flush=True)
    table = markdown_table(["T", "run", "live tensors MB (max rank)", "peak RSS growth MB (max rank)",
                            "step s"], rows)
    body = (f"`python bench/cp_memory.py {' '.join(sys.argv[1:])}` on {machine(torch.device('cpu'))}; "
            f"2-layer dim-64 Llama shape (4 heads over 2 kv), one causal row, forward + backward, one "
            f"thread per rank.\n\n{table}\n")
    print(body)
    if a.append:
        append_benchmark("Context-parallel attention: peak memory per rank", body)


if __name__ == "__main__":
    main()
