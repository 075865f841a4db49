"""Packed attention: the dense [B, 1, T, T] document mask vs per-document SDPA (the model's path).

    python bench/packed_attention.py                   # 125m shape, 2 layers, T 512..8192, ~256 tokens/doc
    python bench/packed_attention.py --seq-lens 512,1024 --layers 1 --no-append

One forward+backward of one packed row at the ``125m`` shape (dim 768, 12 heads, 4 kv heads),
with a small vocabulary so the logits do not hide the attention's memory. Documents have
random lengths around ``--doc-len`` (uniform in [doc/2, 3 doc/2]); the tail is a padding
document, as packing writes it. Each measurement runs in its own process so its peak resident
memory (``ru_maxrss``, minus the memory before the step) belongs to that step alone.
The table gives the growth factor per doubling of T: ~2 is linear, ~4 is quadratic.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_benchmark, loadavg, machine, markdown_table, median  # noqa: E402

from lmforge.models.layers.masks import document_mask  # noqa: E402
from lmforge.models.model import Transformer, model_args_for  # noqa: E402

PATHS = ("dense", "packed")


def document_lengths(T: int, doc_len: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    lengths, left = [], T
    while left > 0:
        n = min(left, int(torch.randint(doc_len // 2, doc_len * 3 // 2 + 1, (1,), generator=g)))
        lengths.append(n)
        left -= n
    return lengths


def dense_step(model: Transformer, tokens, pos, docs) -> torch.Tensor:
    """What the model did before: the same layers with the dense document mask."""
    h = model.tok_embeddings(tokens)
    cos, sin = model.rope(pos, h.dtype)
    mask = document_mask(docs)
    for layer in model.layers:
        h = layer(h, cos, sin, mask, False)
    return model.output(model.norm(h))


def measure(path: str, T: int, doc_len: int, layers: int, repeats: int) -> dict:
    """One configuration, in this process: seconds per forward+backward and extra peak MiB."""
    torch.manual_seed(0)
    args = model_args_for("125m", 256, n_layers=layers, max_seq_len=T)
    model = Transformer(args)
    model.init_weights(seed=0)
    lengths = document_lengths(T, doc_len)
    docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    tokens = torch.randint(0, args.vocab_size, (1, T))

    def step() -> None:
        model.zero_grad(set_to_none=True)
        if path == "dense":
            logits = dense_step(model, tokens, pos, docs)
        else:
            logits = model(tokens, position_ids=pos, document_ids=docs)
        logits.float().square().mean().backward()

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": median(times[1:]), "peak_mib": (peak - base) / 1024, "documents": len(lengths)}


def run_child(path: str, T: int, a: argparse.Namespace) -> dict | None:
    cmd = [sys.executable, __file__, "--child", path, "--seq-lens", str(T), "--doc-len", str(a.doc_len),
           "--layers", str(a.layers), "--repeats", str(a.repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        print(f"{path} T={T} failed (rc {proc.returncode}): {proc.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def probe_alternatives() -> list[str]:
    """Whether flex_attention and nested-tensor SDPA can train (forward+backward) on this CPU."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    T, lines = 512, []
    docs = torch.arange(T) // 128
    q = torch.randn(1, 4, T, 64, requires_grad=True)
    kv = torch.randn(1, 2, T, 64, requires_grad=True)

    def same_document_causal(b, h, qi, ki):
        return (docs[qi] == docs[ki]) & (qi >= ki)

    def flex_step() -> None:
        mask = create_block_mask(same_document_causal, None, None, T, T, device="cpu")
        flex_attention(q, kv, kv, block_mask=mask, enable_gqa=True).sum().backward()

    def nested_step() -> None:
        x = torch.nested.nested_tensor([torch.randn(n, 4, 64) for n in (100, 200)], layout=torch.jagged,
                                       requires_grad=True).transpose(1, 2)
        F.scaled_dot_product_attention(x, x, x, is_causal=True).values().sum().backward()

    for name, fn in (("flex_attention + BlockMask (eager)", flex_step), ("nested jagged SDPA", nested_step)):
        try:
            fn()
            lines.append(f"- {name}: forward+backward runs on CPU")
        except Exception as e:  # noqa: BLE001 - the point is to report what this torch does
            lines.append(f"- {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    return lines


def growth(values: list[float | None], i: int) -> str:
    if i == 0 or values[i] is None or values[i - 1] is None or values[i - 1] <= 0:
        return "-"
    return f"x{values[i] / values[i - 1]:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", default="512,1024,2048,4096,8192")
    p.add_argument("--doc-len", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no-append", action="store_true", help="print only; do not append to BENCHMARKS.md")
    p.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    a = p.parse_args()
    seq_lens = [int(x) for x in a.seq_lens.split(",")]
    if a.child:
        print(json.dumps(measure(a.child, seq_lens[0], a.doc_len, a.layers, a.repeats)))
        return

    load_before = loadavg()
    alternatives = probe_alternatives()
    results = {path: [run_child(path, T, a) for T in seq_lens] for path in PATHS}
    rows = []
    for path in PATHS:
        secs = [r and r["seconds"] for r in results[path]]
        mibs = [r and r["peak_mib"] for r in results[path]]
        for i, T in enumerate(seq_lens):
            r = results[path][i]
            rows.append([
                path, f"{T}", "-" if r is None else f"{r['documents']}",
                "failed" if r is None else f"{r['seconds']:.3f}", growth(secs, i),
                "failed" if r is None else f"{r['peak_mib']:,.0f}", growth(mibs, i),
            ])
    table = markdown_table(
        ["attention", "T", "documents", "s / fwd+bwd", "time growth", "peak extra MiB", "memory growth"], rows
    )
    threads = os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads()))
    body = (
        f"Machine: {machine(torch.device('cpu'))}, OMP_NUM_THREADS={threads}. "
        f"Load average before/after: {load_before} / {loadavg()}.\n\n"
        f"Settings: `125m` shape (dim 768, 12 heads, 4 kv heads) with {a.layers} layers, vocab 256, batch 1, "
        f"fp32, documents of {a.doc_len // 2}-{a.doc_len * 3 // 2} tokens (~{a.doc_len}), one forward+backward, "
        f"median of {a.repeats} after a warm-up, each configuration in its own process (peak = ru_maxrss growth "
        "during the steps). `dense`: the [B, 1, T, T] document mask passed to SDPA (the previous path); "
        "`packed`: per-document causal SDPA (`lmforge.models.layers.packed_attention`).\n\n"
        f"Command: `OMP_NUM_THREADS={threads} python bench/packed_attention.py "
        f"--seq-lens {a.seq_lens} --doc-len {a.doc_len} --layers {a.layers} --repeats {a.repeats}`\n\n{table}\n\n"
        "Alternatives on this CPU (T=512, fp32, forward+backward):\n\n" + "\n".join(alternatives) + "\n"
    )
    print(body)
    if not a.no_append:
        append_benchmark("Packed attention", body)


if __name__ == "__main__":
    main()
