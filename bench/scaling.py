"""How time and memory grow with sequence length and vocabulary: lmforge vs a bare loop vs transformers.

    python bench/scaling.py                          # both sweeps at the 125m shape, CPU, 2 threads
    python bench/scaling.py --sweep vocab --layers 4 # one sweep, a shallower model

Two sweeps, each point a fresh subprocess (so its peak RSS is its own), 1 warm-up step then
``--steps`` timed optimizer steps, ``--tokens`` tokens per step:

* ``seq``: T = 512 ... 8192 at a fixed number of tokens per step (batch = tokens / T), byte vocabulary.
  ``pretrain`` rows are plain causal sequences (lmforge, bare, transformers); ``packed`` rows are
  SFT-style packed sequences of ~``--doc-len``-token documents with document ids and restarting
  positions (lmforge only: the bare loop and transformers' SDPA path on CPU have no packed attention). Attention
  within documents costs the same at every T here, so a packed row should stay flat as T doubles.
* ``vocab``: V = 320 ... 152k at T = 512.

Systems: ``lmforge`` is lmforge's train step (``gradient_computation`` with ``cross_entropy_loss``,
``run_optimizer_step``: the pieces every trainer runs); ``bare`` is forward, full-vocabulary fp32
cross-entropy, backward, AdamW; ``hf`` is ``transformers``' ``LlamaForCausalLM`` of the same
shape with its own loss (``labels=``) and AdamW, the step its ``Trainer`` runs. Memory is the
process's peak RSS minus its RSS just before the first step (what the steps
themselves add: activations, logits, gradients, optimizer state). The growth columns are the geometric
mean factor from one point of the sweep to the next (for T, per doubling).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_benchmark, loadavg, machine, markdown_table  # noqa: E402

SEQS = (512, 1024, 2048, 4096, 8192)
VOCABS = (320, 32_000, 128_256, 151_936)


def rss_bytes() -> int:
    """Current resident set size (Linux /proc), for the baseline before the first step."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def make_batch(kind: str, seq: int, batch: int, vocab: int, doc_len: int):
    from lmforge.data.packing import Batch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    if kind != "packed":
        return Batch(inputs, labels)
    pos = torch.arange(seq) % doc_len
    docs = torch.arange(seq) // doc_len
    return Batch(inputs, labels, position_ids=pos.expand(batch, seq).contiguous(),
                 document_ids=docs.expand(batch, seq).contiguous())


def model_args(a: argparse.Namespace, seq: int, vocab: int):
    from lmforge.models.model import model_args_for

    return model_args_for("125m", vocab, n_layers=a.layers, max_seq_len=max(seq, 2048))


def one_point(a: argparse.Namespace) -> dict:
    """Run one (system, kind, seq, vocab) point in this process; returns its measurements."""
    torch.set_num_threads(a.threads)
    batch = max(1, a.tokens // a.seq)
    args = model_args(a, a.seq, a.vocab)
    b = make_batch(a.kind, a.seq, batch, a.vocab, a.doc_len)
    if a.system == "hf":
        step, before = _hf_step(args, b)
    else:
        from lmforge.models.model import Transformer
        from lmforge.objectives.next_token import cross_entropy_loss
        from lmforge.optim.adamw import build_optimizer
        from lmforge.training.train_step import global_target_count, gradient_computation, run_optimizer_step

        model = Transformer(args)
        model.init_weights(seed=0)
        opt = build_optimizer(model, 1e-4, 0.1, (0.9, 0.95), 1e-8)
        if a.system == "lmforge":
            def step() -> None:
                gradient_computation(model, [b], cross_entropy_loss, global_target_count([b]))
                run_optimizer_step(model, opt, 1e-4, 1.0)
        else:
            def step() -> None:
                logits = model(b.input_ids)
                F.cross_entropy(logits.float().flatten(0, 1), b.labels.flatten()).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        before = rss_bytes()
    step()  # warm-up: lazy allocations, optimizer state
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    seconds = (time.perf_counter() - t0) / a.steps
    return {"tokens_per_sec": batch * a.seq / seconds, "step_memory_gb": (peak_rss_bytes() - before) / 1e9,
            "peak_rss_gb": peak_rss_bytes() / 1e9}


def _hf_step(args, b):
    """transformers' ``LlamaForCausalLM`` with its own loss (``labels=``) and AdamW: the step
    ``transformers.Trainer`` runs, without its data loading and bookkeeping."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_dim,
                      num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=args.max_seq_len,
                      tie_word_embeddings=args.tie_embeddings, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)
    before = rss_bytes()

    def step() -> None:
        model(input_ids=b.input_ids, labels=b.input_ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, before


def run_point(a: argparse.Namespace, system: str, kind: str, seq: int, vocab: int, tokens: int) -> dict:
    cmd = [sys.executable, __file__, "--one", "--system", system, "--kind", kind, "--seq", str(seq),
           "--vocab", str(vocab), "--tokens", str(tokens), "--steps", str(a.steps), "--layers", str(a.layers),
           "--threads", str(a.threads), "--doc-len", str(a.doc_len)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        print(f"  {system:>8} {kind:>8} T={seq:<5} V={vocab:<7} failed: {tail}", flush=True)
        return {"failed": tail[:60]}
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"  {system:>8} {kind:>8} T={seq:<5} V={vocab:<7} {r['tokens_per_sec']:>9,.0f} tokens/s  "
          f"+{r['step_memory_gb']:.2f} GB  ({time.perf_counter() - t0:.0f}s, load {loadavg()})", flush=True)
    return r


def growth(values: list[float]) -> str:
    ok = [v for v in values if v and v > 0]
    if len(ok) < 2:
        return "-"
    return f"{math.exp(math.log(ok[-1] / ok[0]) / (len(ok) - 1)):.2f}x"


def sweep_table(a, results: dict, points: list, axis: str) -> str:
    header = ["system", "kind"] + [f"{axis}={p}" for p in points] + ["memory growth per point", "tokens/s growth per point"]
    rows = []
    for (system, kind), per_point in results.items():
        cells = []
        for p in points:
            r = per_point.get(p, {})
            cells.append(r.get("failed", "-") if "tokens_per_sec" not in r else
                         f"{r['tokens_per_sec']:,.0f} tok/s, +{r['step_memory_gb']:.2f} GB")
        mem = [per_point.get(p, {}).get("step_memory_gb") for p in points]
        tps = [per_point.get(p, {}).get("tokens_per_sec") for p in points]
        rows.append([system, kind] + cells + [growth(mem), growth(tps)])
    return markdown_table(header, rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweep", default="seq,vocab", help="seq, vocab or both")
    p.add_argument("--systems", default="lmforge,bare,hf")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per optimizer step (sequence sweep)")
    p.add_argument("--vocab-tokens", type=int, default=4096,
                   help="tokens per step of the vocabulary sweep (full fp32 logits at 152k need ~4 GB per 1k tokens)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per point (after one warm-up step)")
    p.add_argument("--layers", type=int, default=12, help="layers of the 125m shape (12 = the real shape)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--doc-len", type=int, default=256, help="tokens per packed document")
    p.add_argument("--vocabs", default=",".join(map(str, VOCABS)), help="vocabulary sizes of the vocabulary sweep")
    p.add_argument("--seqs", default=",".join(map(str, SEQS)), help="sequence lengths of the sequence sweep")
    p.add_argument("--no-append", action="store_true")
    # one point, in a subprocess
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--system", default="lmforge", help=argparse.SUPPRESS)
    p.add_argument("--kind", default="pretrain", help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, default=512, help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, default=320, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one_point(a)))
        return
    systems = a.systems.split(",")
    load_before, sections = loadavg(), []
    if "seq" in a.sweep:
        results: dict = {}
        seqs = [int(x) for x in a.seqs.split(",")]
        for seq in seqs:
            for system in systems:
                results.setdefault((system, "pretrain"), {})[seq] = run_point(a, system, "pretrain", seq, 320, a.tokens)
            if "lmforge" in systems:
                results.setdefault(("lmforge", "packed"), {})[seq] = run_point(a, "lmforge", "packed", seq, 320, a.tokens)
        sections.append(f"Sequence length, {a.tokens} tokens per step, vocabulary 320:\n\n"
                        + sweep_table(a, results, seqs, "T"))
    if "vocab" in a.sweep:
        results = {}
        vocabs = [int(x) for x in a.vocabs.split(",")]
        for vocab in vocabs:
            for system in systems:
                results.setdefault((system, "pretrain"), {})[vocab] = run_point(a, system, "pretrain", 512, vocab, a.vocab_tokens)
        sections.append(f"Vocabulary, T=512, {a.vocab_tokens} tokens per step:\n\n"
                        + sweep_table(a, results, vocabs, "V"))
    body = (f"Machine: {machine(torch.device('cpu'))}, {a.threads} threads. Load average before/after: "
            f"{load_before} / {loadavg()}.\n\nModel: the `125m` shape (dim 768, 12 heads, 4 kv heads) with "
            f"{a.layers} layers, fp32; {a.steps} timed steps after one warm-up step per point; memory = peak RSS "
            f"minus RSS before the first step.\n\nCommand: `python bench/scaling.py {' '.join(sys.argv[1:])}`\n\n"
            + "\n\n".join(sections) + "\n")
    print("\n" + body)
    if not a.no_append:
        append_benchmark("Scaling with sequence length and vocabulary", body)
        print("appended to BENCHMARKS.md")


if __name__ == "__main__":
    main()
