"""Gemma 3 (262,144-token vocabulary) SFT step: peak memory of the chunked loss vs full logits.

    python bench/gemma_vocab_memory.py                         # 6 layers; 4x1024 and 4x2048 tokens
    python bench/gemma_vocab_memory.py --layers 18 --batches 4x1024
    python bench/gemma_vocab_memory.py --quick                 # 1x1024 and 4x1024 only

The published gemma-3-270m shape (dim 640, 4 heads, 1 kv head of 256, GeGLU 2048, tied 262,144 x 640
embeddings, sliding window 512 with 5 local : 1 global layers, RoPE 10k local / 1M global, (1 + w)
RMSNorms around both sublayers, q/k norms, scaled embeddings), with ``--layers`` layers (18 in the
real model; 6 by default, for time: the embedding/output matrix, which is what the loss is about,
is 168M of the 268M parameters either way). Built with ``spec_for_args(args).build(args)`` and
``init_weights(seed=0)``; fp32; AdamW as lmforge's trainers build it (``build_optimizer``: fused,
decay on matrices). One SFT step = ``zero_grad(set_to_none=True)``, loss, ``backward``, ``step``.
Every position is a target by default (``--target-fraction`` masks a prompt prefix as SFT does;
the chunked loss then projects only the targets, so 1.0 is its worst case). Losses:

* ``chunked``: ``lmforge.objectives.next_token.cross_entropy_loss(model, Batch(input_ids, labels),
  chunk_tokens=1024)``, divided by the target count, as the trainers use it;
* ``full``: ``F.cross_entropy(model(ids).float().view(-1, V), labels.view(-1))``;
* ``hf``: transformers' ``Gemma3ForCausalLM`` of the same config (SDPA attention) with the same
  weights, ``model(input_ids, labels=..., shift_labels=...).loss`` (its own loss; ``shift_labels``
  gives it exactly lmforge's targets), the output object dropped at once as a training loop does.

Each case runs in a fresh process. The AdamW state is allocated up front, exactly as AdamW's lazy
init would (``step``, ``exp_avg``, ``exp_avg_sq`` zeros), so one step suffices (on a 2-core machine a
4x1024 step takes tens of seconds); then the resident-set high-water mark is reset
(``/proc/self/clear_refs``) and the resident set taken as the model + AdamW baseline; the step is
timed and its high-water mark (VmHWM) minus the baseline is the step's own memory (gradients,
activations, logits, the optimizer step). "Peak RSS" is the whole process's
``ru_maxrss`` (build included). The loss of every case is printed: the same model and data give the
same loss in all three. A case whose estimated peak (baseline + 3 fp32 copies of the logits for
the full-logits losses) exceeds the memory available (``MemAvailable`` less ``--margin-gb``) is not
run, and every case runs under an address-space limit of that size, so that a wrong estimate fails
in the case instead of pushing a shared machine into the OOM killer.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_benchmark, loadavg, machine, markdown_table, median  # noqa: E402

from lmforge.data.packing import IGNORE_INDEX, Batch  # noqa: E402
from lmforge.models.args import ModelArgs  # noqa: E402
from lmforge.models.spec import spec_for_args  # noqa: E402
from lmforge.objectives.next_token import cross_entropy_loss  # noqa: E402
from lmforge.optim.adamw import build_optimizer  # noqa: E402

VOCAB = 262_144
MODES = ("chunked", "full", "hf")
GIB = 2**30


def gemma3_args(n_layers: int, max_seq_len: int) -> ModelArgs:
    """google/gemma-3-270m's text config (config.json), with ``n_layers`` layers."""
    return ModelArgs(
        dim=640, n_layers=n_layers, n_heads=4, n_kv_heads=1, head_dim=256, ffn_hidden_dim=2048,
        vocab_size=VOCAB, norm_eps=1e-6, tie_embeddings=True, max_seq_len=max_seq_len, sliding_window=512,
        layer_types=["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layers)],
        local_rope_theta=10_000.0, rope_theta=1_000_000.0, hidden_act="gelu_tanh", norm_unit_offset=True,
        embed_scale=True, sandwich_norm=True, qk_norm=True, attn_scale=256 ** -0.5, hf_model_type="gemma3_text",
    )


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not in /proc/meminfo")


def hf_model(model: torch.nn.Module, args: ModelArgs) -> torch.nn.Module:
    """transformers' Gemma3ForCausalLM with lmforge's config and weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lmforge.models.hf import hf_state_dict_from_lmforge
    from lmforge.models.hf_config import hf_config_from_args

    cfg = dict(hf_config_from_args(args, torch_dtype="float32"))
    cfg.pop("architectures", None)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config._attn_implementation = "sdpa"
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    missing, unexpected = hf.load_state_dict(hf_state_dict_from_lmforge(model.state_dict(), args), strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SystemExit(f"weights do not map onto Gemma3ForCausalLM: missing {missing}, unexpected {unexpected}")
    if hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr():
        raise SystemExit("Gemma3ForCausalLM's lm_head is not tied to its embeddings")
    return hf.train()


def measure(mode: str, batch: int, seq_len: int, layers: int, chunk: int, target_fraction: float,
            limit_bytes: int) -> dict:
    """One case in this process (see the module docstring)."""
    # The address-space limit: what is mapped now (libraries, arenas) plus the memory granted.
    limit = _status_kb("VmSize") * 1024 + limit_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    t_build = time.perf_counter()
    args = gemma3_args(layers, seq_len)
    model = spec_for_args(args).build(args)
    model.init_weights(seed=0)
    if mode == "hf":
        model = hf_model(model, args)
        gc.collect()
    params = sum(p.numel() for p in model.parameters())
    opt = build_optimizer(model, lr=1e-5, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (batch, seq_len + 1), generator=g)
    inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].clone()
    labels[:, : int(seq_len * (1 - target_fraction))] = IGNORE_INDEX  # the prompt part carries no loss
    b = Batch(input_ids=inputs, labels=labels)
    targets = int((labels != IGNORE_INDEX).sum())
    build_s = time.perf_counter() - t_build

    def loss_fn() -> torch.Tensor:
        if mode == "chunked":
            return cross_entropy_loss(model, b, chunk_tokens=chunk)[0] / targets
        if mode == "full":
            return F.cross_entropy(model(inputs).float().view(-1, VOCAB), labels.view(-1))
        return model(input_ids=inputs, labels=labels, shift_labels=labels).loss

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        opt.step()
        return float(loss.detach())

    for group in opt.param_groups:  # AdamW's lazy state init (torch.optim.Adam._init_group), done now
        for q in group["params"]:
            opt.state[q] = {"step": torch.tensor(0.0, dtype=torch.float32),
                            "exp_avg": torch.zeros_like(q, memory_format=torch.preserve_format),
                            "exp_avg_sq": torch.zeros_like(q, memory_format=torch.preserve_format)}
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    base = _status_kb("VmRSS") * 1024
    t0 = time.perf_counter()
    loss = step()
    step_s = time.perf_counter() - t0
    hwm = _status_kb("VmHWM") * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if not all(int(st["step"]) == 1 for st in opt.state.values()):
        raise SystemExit("AdamW did not use the pre-allocated state")
    return {"params": params, "targets": targets, "loss": loss, "base": base, "step_peak": hwm, "peak": peak,
            "build_s": build_s, "step_s": step_s}


def estimate(mode: str, tokens: int, layers: int) -> float:
    """Rough peak (bytes) to decide whether a case can run: parameters, grads and AdamW state (4 fp32 copies),
    ~0.25 GB of activations per layer per 4096 tokens, the runtime, and for the full-logits losses
    three fp32 copies of the logits (log-softmax, its gradient, the logits' gradient)."""
    params = VOCAB * 640 + layers * 5.6e6
    est = 16 * params + 0.25e9 * layers * tokens / 4096 + 1e9
    if mode != "chunked":
        est += 3 * 4 * tokens * VOCAB
    return est


def run_child(a: argparse.Namespace, mode: str, batch: int, seq_len: int) -> dict:
    avail = mem_available() - a.margin_gb * GIB
    est = estimate(mode, batch * seq_len, a.layers)
    if est > avail:
        return {"skipped": f"not run (est. {est / GIB:.1f} GiB > {avail / GIB:.1f} GiB available)"}
    spec = dict(mode=mode, batch=batch, seq_len=seq_len, layers=a.layers, chunk=a.chunk,
                target_fraction=a.target_fraction, limit_bytes=int(avail))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True,
                          check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1][:200] if proc.stderr.strip() else f"rc {proc.returncode}"
        print(f"{mode} {batch}x{seq_len} failed: {proc.stderr.strip()[-600:]}", file=sys.stderr)
        return {"skipped": f"failed under the {avail / GIB:.1f} GiB limit: {tail}"}
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    r["wall_s"] = wall
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=6, help="decoder layers (gemma-3-270m has 18)")
    p.add_argument("--batches", default="4x1024,4x2048", help="comma-separated BATCHxSEQ_LEN")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--chunk", type=int, default=1024, help="chunk_tokens of the chunked loss")
    p.add_argument("--target-fraction", type=float, default=1.0, help="share of each row that carries loss")
    p.add_argument("--repeats", type=int, default=1, help="runs of every case, interleaved (median reported)")
    p.add_argument("--margin-gb", type=float, default=2.0, help="memory left to the rest of the machine")
    p.add_argument("--quick", action="store_true", help="--batches 1x1024,4x1024")
    p.add_argument("--append", action="store_true", help="also append the section to BENCHMARKS.md")
    p.add_argument("--one", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(measure(**json.loads(a.one))))
        return
    if a.quick:
        a.batches = "1x1024,4x1024"

    load_before, t_start = loadavg(), time.perf_counter()
    modes = a.modes.split(",")
    cases = [(spec, mode) for spec in a.batches.split(",") for mode in modes]
    runs: dict[tuple[str, str], list[dict]] = {c: [] for c in cases}
    for rep in range(a.repeats):
        for spec in a.batches.split(","):  # within a batch shape the order of the losses rotates every repeat
            for mode in modes[rep % len(modes):] + modes[: rep % len(modes)]:
                batch, seq_len = map(int, spec.lower().split("x"))
                r = run_child(a, mode, batch, seq_len)
                runs[(spec, mode)].append(r)
                extra = ("" if "skipped" in r else f"step {r['step_s']:.1f}s, above baseline "
                         f"{(r['step_peak'] - r['base']) / GIB:.2f} GiB, build {r['build_s']:.0f}s, "
                         f"process {r['wall_s']:.0f}s")
                print(f"  repeat {rep + 1}/{a.repeats} {mode:>7} {spec}: {r.get('skipped', extra)} "
                      f"(load {loadavg()})", flush=True)

    def above(r: dict) -> float:
        return (r["step_peak"] - r["base"]) / GIB

    rows = []
    for spec, mode in cases:
        done = [r for r in runs[(spec, mode)] if "skipped" not in r]
        if not done:
            rows.append([mode, spec, runs[(spec, mode)][-1]["skipped"], "-", "-", "-", "-", "-", "-"])
            continue
        chunked = [r for r in runs.get((spec, "chunked"), []) if "skipped" not in r]
        ratio = "-" if mode == "chunked" or not chunked else \
            f"{median([above(r) for r in done]) / median([above(r) for r in chunked]):.1f}x"
        steps = [r["step_s"] for r in done]
        rows.append([mode, spec, f"{max(r['peak'] for r in done) / GIB:.2f}",
                     f"{median([r['base'] for r in done]) / GIB:.2f}",
                     f"{median([above(r) for r in done]):.2f}", ratio,
                     f"{median(steps):.1f}" + (f" ({min(steps):.1f}-{max(steps):.1f})" if len(steps) > 1 else ""),
                     f"{done[0]['loss']:.5f}", f"{done[0]['params'] / 1e6:.1f}M"])

    table = markdown_table(["loss path", "batch x seq", "peak RSS GiB (process)", "model+AdamW baseline GiB",
                            "step peak above baseline GiB", "vs chunked", "s/step (median, range)", "loss value",
                            "params"], rows)
    cmd = "python bench/gemma_vocab_memory.py " + " ".join(x for x in sys.argv[1:] if x != "--append")
    body = (f"Machine: {machine(torch.device('cpu'))}, {torch.get_num_threads()} torch threads. "
            f"Load average before/after: {load_before} / {loadavg()}. "
            f"Wall time {time.perf_counter() - t_start:.0f}s.\n\n"
            f"Settings: gemma-3-270m shape (dim 640, vocab {VOCAB:,}, tied) with {a.layers} layers, fp32, CPU, one "
            f"SFT step (forward+backward+AdamW, its state allocated beforehand), {a.target_fraction:.0%} of positions "
            f"targets, chunk {a.chunk} tokens, each case in a fresh process, {a.repeats} interleaved repeat(s) "
            f"(peak RSS: the largest; the rest: medians). Baseline: RSS before the step (parameters + AdamW "
            f"state, no gradients). Step peak: VmHWM during the step, less the baseline.\n\n"
            f"Command: `{cmd.strip()}`\n\n{table}\n")
    print("\n" + body)
    if a.append:
        append_benchmark("Gemma 3 vocabulary memory", body)


if __name__ == "__main__":
    main()
