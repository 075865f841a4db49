"""Training throughput: lmforge's trainer vs a bare PyTorch loop vs the Hugging Face Trainer.

    python bench/throughput.py                      # debug and small models, 2 threads, CPU
    python bench/throughput.py --sizes small --repeats 5
    python bench/throughput.py --variant compile:training.compile=true   # an lmforge option, A/B

All systems train the same architecture (lmforge's ``Transformer`` or the equivalent
``transformers`` ``LlamaForCausalLM``) on the same packed embedded corpus, with the same sequence
length, batch, learning-rate settings and threads, in one process. Repeats are interleaved
(A B C, B C A, C A B, ...) so slow drift of a shared machine hits every system alike; the table
quotes the median over repeats and the ratios of those medians.

How each system is timed, identically: the wall-clock time from the end of optimizer step
``--warmup`` to the end of step ``--steps`` (so warm-up, model build and process setup are
excluded, and everything inside the loop, logging included, is counted).

* lmforge: the real pretraining trainer, the ``pretrain`` recipe run by ``run_recipe`` (what ``lmforge
  pretrain`` calls), with its normal logging: console line, metrics.jsonl and TensorBoard every
  ``metrics.log_every`` = 10 steps, prefetching loader, grad clipping, LR schedule, guards. Eval and
  checkpoint *saves* are switched off (the other systems do neither), but the loop still runs its
  per-step checks. The window is measured from the wall-clock ``time`` stamps of the JSONL records
  written at steps ``--warmup`` and ``--steps``, not from the trainer's own step timer, so the
  trainer cannot flatter itself; its self-reported tokens/s is printed alongside as a cross-check.
  Driving ``run`` in-process (rather than the CLI in a subprocess) keeps the thread count and
  allocator identical for all systems; the code path is the CLI's, minus argument parsing.
* bare: forward, cross-entropy, backward, AdamW (same hyper-parameters and the same fused kernel
  implementation lmforge builds), zero_grad: nothing else, batches built before the clock starts.
* hf: ``transformers.Trainer`` with ``LlamaForCausalLM`` of the same configuration (SDPA
  attention), its default optimizer, no saving, no eval, logging every 10 steps.

``--clock cpu``: the window in process CPU seconds (``time.process_time``, every thread of the process)
instead of wall seconds, so the other processes of a shared machine do not enter it; the rows are then
tokens per CPU-second (with N threads about 1/N of the wall rate), and the ratios are what to read. An
lmforge window's CPU stamps are taken where its wall stamps are, at the end of ``record_step`` of the
steps ``--warmup`` and ``--steps``; they include its prefetch and TensorBoard threads.

``--defaults``: each system as it comes out of the box instead of at identical settings: lmforge with its
config defaults (``training.dtype=auto``, its optimizer and schedule defaults), the Hugging Face Trainer
with ``TrainingArguments`` defaults (on a CPU: fp32 and its default optimizer; only saving and
reporting switched off, as for lmforge). The model, sequence length, batch and threads stay the same,
so the table is the speed a user gets from each with no tuning.

MFU: each row against the peak of the dtype it ran in (``--dtype`` for bare and hf; an lmforge row's
own setup record, so a ``--variant bf16:training.dtype=bfloat16`` row is quoted against the bf16
peak), as the trainer's own MFU is.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import append_benchmark, loadavg, machine, markdown_table, median, spread  # noqa: E402

from lmforge.config import Config, parse_overrides, validate_config  # noqa: E402
from lmforge.metrics.logger import MetricLogger  # noqa: E402
from lmforge.metrics.records import read_records  # noqa: E402
from lmforge.data.corpus import embedded_corpus  # noqa: E402
from lmforge.data.packing import PackedTokenDataset, collate  # noqa: E402
from lmforge.models.flops import flops_per_token  # noqa: E402
from lmforge.runtime.precision import default_peak_shapes, measure_matmul_peak, peak_flops_per_device  # noqa: E402
from lmforge.models.model import ModelArgs, Transformer, model_args_for  # noqa: E402
from lmforge.models.tokenizer import load_tokenizer  # noqa: E402

LOG_EVERY = 10
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LR, WD, BETAS = 3e-3, 0.1, (0.9, 0.95)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass
class Setup:
    size: str
    seq_len: int
    batch: int
    steps: int
    warmup: int
    device: torch.device
    dtype: str
    compile: bool
    args: ModelArgs
    dataset: PackedTokenDataset
    model_overrides: dict = field(default_factory=dict)
    clock: str = "wall"
    """``wall`` or ``cpu`` (see ``--clock``)."""
    defaults: bool = False
    """Each system with its own defaults (``--defaults``) rather than the identical settings above."""
    hf_dtype: str = ""
    hf_optim: str = ""
    """Under ``--defaults``: the dtype and optimizer the Trainer's defaults chose (read back from it)."""

    @property
    def window_tokens(self) -> int:
        return (self.steps - self.warmup) * self.batch * self.seq_len


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# ---------------------------------------------------------------------------------------- systems
def run_lmforge(s: Setup, overrides: list[str]) -> tuple[float, float, str]:
    """(tokens/s over the window from JSONL wall-clock stamps, the trainer's own median tokens/s, the
    dtype it trained in: its setup record's, which an override such as ``training.dtype`` may change)."""
    from lmforge.recipes import get_recipe
    from lmforge.recipes.skeleton import run_recipe

    with tempfile.TemporaryDirectory(prefix="lmforge-bench-") as run_dir:
        training = {"steps": s.steps, "global_batch_size": s.batch, "micro_batch_size": s.batch,
                    "threads": torch.get_num_threads() if s.device.type == "cpu" else 0}
        data = {
            "model": {"size": s.size, **s.model_overrides},
            "data": {"seq_len": s.seq_len},
            "training": training if s.defaults else
            {**training, "device": s.device.type, "dtype": s.dtype, "compile": s.compile},
            "schedule": {} if s.defaults else {"warmup_steps": s.warmup},
            "optimizer": {} if s.defaults else {"lr": LR, "weight_decay": WD, "beta1": BETAS[0], "beta2": BETAS[1]},
            "eval": {"interval": 0},
            "checkpoint": {"enabled": False},
            "metrics": {"log_every": LOG_EVERY},
            "run": {"dir": run_dir},
        }
        cfg = validate_config(Config, merge(data, parse_overrides([f"--{o}" for o in overrides])), "bench")
        stamps: dict[int, float] = {}
        record_step = MetricLogger.record_step

        def stamped(self, step, *args, **kw):  # noqa: ANN001, ANN202
            out = record_step(self, step, *args, **kw)
            if step in (s.warmup, s.steps):
                stamps[step] = CLOCKS[s.clock]()
            return out

        MetricLogger.record_step = stamped
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                run_recipe(get_recipe("pretrain"), cfg)
        finally:
            MetricLogger.record_step = record_step
        train = {r["step"]: r for r in read_records(run_dir, "train")}
        dtype = read_records(run_dir, "setup")[-1]["dtype"]
    t0, t1 = (train[s.warmup]["time"], train[s.steps]["time"]) if s.clock == "wall" else (stamps[s.warmup], stamps[s.steps])
    own = [r["tokens_per_sec_per_device"] for k, r in train.items() if k > s.warmup]
    return s.window_tokens / (t1 - t0), median(own), dtype


def run_bare(s: Setup) -> float:
    """The minimum a training step needs, as a user would write it by hand."""
    torch.manual_seed(0)
    model = Transformer(s.args).to(s.device)
    model.init_weights(seed=0)
    if s.compile:
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, betas=BETAS, fused=True)
    n = max(1, min(len(s.dataset) // s.batch, s.steps))
    batches = [collate([s.dataset[i] for i in range(k * s.batch, (k + 1) * s.batch)]).to(s.device) for k in range(n)]
    autocast = torch.autocast(s.device.type, dtype=torch.bfloat16) if s.dtype == "bfloat16" \
        else contextlib.nullcontext()
    t0 = 0.0
    for step in range(1, s.steps + 1):
        b = batches[step % n]
        with autocast:
            logits = model(b.input_ids)
        loss = F.cross_entropy(logits.float().flatten(0, 1), b.labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == s.warmup:
            sync(s.device)
            t0 = CLOCKS[s.clock]()
    sync(s.device)
    return s.window_tokens / (CLOCKS[s.clock]() - t0)


def hf_config(args: ModelArgs):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_seq_len, rope_theta=args.rope_theta, rms_norm_eps=args.norm_eps,
        tie_word_embeddings=args.tie_embeddings, attention_bias=False, mlp_bias=False,
        attn_implementation="sdpa",
    )


def run_hf(s: Setup) -> float:
    """transformers.Trainer on LlamaForCausalLM; step ends timed by a callback."""
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    class Samples(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(s.dataset)

        def __getitem__(self, i: int) -> dict:
            ids = s.dataset[i].input_ids
            return {"input_ids": ids, "labels": ids}  # the model shifts labels itself

    stamps: dict[int, float] = {}

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step in (s.warmup, s.steps):
                sync(s.device)
                stamps[state.global_step] = CLOCKS[s.clock]()

    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_config(s.args))
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="hf-bench-") as out:
        if s.defaults:  # out of the box: only saving and reporting off (lmforge's runs save nothing either)
            targs = TrainingArguments(output_dir=out, per_device_train_batch_size=s.batch, max_steps=s.steps,
                                      save_strategy="no", report_to="none")
        else:
            targs = TrainingArguments(
                output_dir=out, per_device_train_batch_size=s.batch, max_steps=s.steps, learning_rate=LR,
                weight_decay=WD, adam_beta1=BETAS[0], adam_beta2=BETAS[1], max_grad_norm=1.0,
                lr_scheduler_type="cosine", warmup_steps=s.warmup, logging_steps=LOG_EVERY, save_strategy="no",
                eval_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=0,
                use_cpu=s.device.type == "cpu", bf16=s.dtype == "bfloat16", torch_compile=s.compile, seed=0,
            )
        trainer = Trainer(model=model, args=targs, train_dataset=Samples(), callbacks=[StepClock()])
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            trainer.train()
        if s.defaults:  # what the defaults trained in, for the table
            s.hf_dtype = "bfloat16" if targs.bf16 else "float16" if targs.fp16 else "float32"
            s.hf_optim = str(getattr(targs.optim, "value", targs.optim))
    torch.set_num_threads(threads)  # in case anything changed it
    return s.window_tokens / (stamps[s.steps] - stamps[s.warmup])


# ---------------------------------------------------------------------------------------- driver
def measure_peak(device: torch.device, dtype: torch.dtype, setups: list[Setup]) -> float:
    """Best matmul FLOP/s over square shapes and the shapes the benchmarked models use."""
    shapes = default_peak_shapes(device.type, 4096 if device.type == "cuda" else 1024)
    for s in setups:
        a, tokens = s.args, s.batch * s.seq_len
        shapes += [(tokens, a.dim, a.ffn_dim), (tokens, a.ffn_dim, a.dim), (tokens, a.dim, a.dim)]
    return measure_matmul_peak(device, dtype, shapes=shapes, iters=30, budget_s=1.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="debug,small", help="comma-separated lmforge model sizes")
    p.add_argument("--systems", default="lmforge,bare,hf", help="subset of lmforge,bare,hf")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                   help="an extra lmforge run with config overrides, e.g. compile:training.compile=true")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per run (window ends here)")
    p.add_argument("--warmup", type=int, default=10, help="steps before the window starts")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch threads on CPU")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--compile", action="store_true", help="torch.compile in every system")
    p.add_argument("--model", action="append", default=[], metavar="KEY=VALUE",
                   help="model override for every system, e.g. n_layers=8")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="lmforge_set",
                   help="config override for every lmforge run, e.g. metrics.tensorboard=false")
    p.add_argument("--clock", default="wall", choices=sorted(CLOCKS),
                   help="window in wall seconds, or in process CPU seconds (robust on a shared machine)")
    p.add_argument("--defaults", action="store_true",
                   help="each system with its own defaults (lmforge: training.dtype=auto; HF: TrainingArguments)")
    p.add_argument("--no-append", action="store_true", help="do not append to BENCHMARKS.md")
    a = p.parse_args(argv)
    if a.defaults:
        if a.compile or a.dtype != "float32" or a.variant:
            p.error("--defaults runs each system as it comes: no --compile, --dtype or --variant")
        a.systems = ",".join(x for x in a.systems.split(",") if x != "bare")  # a bare loop has no defaults
    if a.warmup % LOG_EVERY or a.steps % LOG_EVERY or a.steps <= a.warmup:
        p.error(f"--warmup and --steps must be multiples of {LOG_EVERY} (lmforge log steps), steps > warmup")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cpu":
        torch.set_num_threads(a.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    tok = load_tokenizer("byte")
    dataset = PackedTokenDataset(embedded_corpus("train"), tok, a.seq_len)
    model_overrides = {k: v for k, v in (parse_overrides([f"--{m}" for m in a.model]) or {}).items()}
    setups = [Setup(size, a.seq_len, a.batch, a.steps, a.warmup, device, a.dtype, a.compile,
                    model_args_for(size, tok.vocab_size, **model_overrides), dataset, model_overrides, a.clock,
                    a.defaults)
              for size in a.sizes.split(",")]
    variants = dict(v.split(":", 1) for v in a.variant)
    systems = [x for x in a.systems.split(",") if x] + [f"lmforge[{n}]" for n in variants]
    load_before = loadavg()
    peaks = {a.dtype: measure_peak(device, DTYPES[a.dtype], setups)}  # other dtypes once a row has run in them
    print(f"matmul peak ({a.dtype}, {device}, {torch.get_num_threads()} threads): {peaks[a.dtype] / 1e12:.3f} "
          f"TFLOP/s", flush=True)

    results: dict[tuple[str, str], list[float]] = {}
    self_reported: dict[tuple[str, str], list[float]] = {}
    row_dtype: dict[tuple[str, str], str] = {}  # bare and hf run in --dtype; an lmforge row in its setup's dtype
    for s in setups:
        for r in range(a.repeats):
            order = systems[r % len(systems):] + systems[: r % len(systems)]
            for name in order:
                t0 = time.perf_counter()
                dtype = a.dtype
                if name == "bare":
                    tps = run_bare(s)
                elif name == "hf":
                    tps = run_hf(s)
                    dtype = s.hf_dtype or dtype
                else:
                    over = a.lmforge_set + ([] if name == "lmforge" else variants[name[8:-1]].split(","))
                    tps, own, dtype = run_lmforge(s, over)
                    self_reported.setdefault((s.size, name), []).append(own)
                if row_dtype.setdefault((s.size, name), dtype) != dtype:
                    raise SystemExit(f"{s.size} {name}: ran in {row_dtype[(s.size, name)]}, then in {dtype}")
                results.setdefault((s.size, name), []).append(tps)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                print(f"  {s.size:>6} repeat {r + 1}/{a.repeats} {name:<18} {tps:>10,.0f} tokens/s "
                      f"({time.perf_counter() - t0:.0f}s, load {loadavg()})", flush=True)
    # Each row's MFU is against the peak of the dtype it ran in (a bf16 row against an fp32 peak would
    # read several times too high). Measured again now: a second chance at a quiet moment for --dtype.
    peak_sources = []
    for dtype in sorted(set(row_dtype.values()) | {a.dtype}, key=lambda d: d != a.dtype):
        peaks[dtype] = max(peaks.get(dtype, 0.0), measure_peak(device, DTYPES[dtype], setups))
        peak_sources.append(f"measured {dtype} matmul peak {peaks[dtype] / 1e12:.3f} TFLOP/s")
        if device.type == "cuda":  # MFU is quoted against the vendor's dense peak where it is known
            table_peak, src = peak_flops_per_device(device, DTYPES[dtype])
            if src.startswith("spec"):
                peak_sources[-1] = f"{src} {table_peak / 1e12:.0f} TFLOP/s (measured matmul peak {peaks[dtype] / 1e12:.0f})"
                peaks[dtype] = table_peak
    peak_source = "; ".join(peak_sources)

    header = ["size", "params", "system", "dtype", "tokens/s (median)", "repeats range", "vs bare", "vs hf", "MFU",
              "trainer-reported tokens/s"]
    rows = []
    for s in setups:
        fpt = flops_per_token(s.args, s.seq_len)
        params = _count(s.args)
        for name in systems:
            xs = results[(s.size, name)]
            m = median(xs)
            bare = median(results.get((s.size, "bare"), []))
            hf = median(results.get((s.size, "hf"), []))
            own = self_reported.get((s.size, name))
            dtype = row_dtype[(s.size, name)]
            rows.append([s.size, f"{params / 1e6:.1f}M", name, dtype, f"{m:,.0f}", spread(xs),
                         f"{m / bare:.3f}" if bare == bare else "-", f"{m / hf:.2f}" if hf == hf else "-",
                         f"{100 * m * fpt / peaks[dtype]:.1f}%" if a.clock == "wall" else "-",
                         f"{median(own):,.0f}" if own else "-"])
    table = markdown_table(header, rows)
    print()
    print(table)
    settings = (f"seq_len {a.seq_len}, batch {a.batch}, {a.steps} steps per run timed from step {a.warmup}, "
                f"{a.repeats} interleaved repeats, device {device}"
                + (", clock: process CPU seconds (tokens per CPU-second)" if a.clock == "cpu" else "")
                + (f", {torch.get_num_threads()} threads" if device.type == "cpu" else "")
                + (f", each system's defaults (lmforge training.dtype=auto; HF TrainingArguments: "
                   f"{setups[0].hf_dtype or '-'}, optim {setups[0].hf_optim or '-'})" if a.defaults else
                   f", dtype {a.dtype}, compile {'on' if a.compile else 'off'}"))
    body = (f"Machine: {machine(device)}. Load average before/after: {load_before} / {loadavg()}.\n\n"
            f"Settings: {settings}. Peak for MFU: {peak_source}.\n\n"
            + (f"Variants: {', '.join(f'`{k}`: `{v}`' for k, v in variants.items())}.\n\n" if variants else "")
            + f"Command: `python bench/throughput.py {' '.join(sys.argv[1:] if argv is None else argv)}`\n\n"
            + table + "\n")
    print(f"\n{settings}\nPeak for MFU: {peak_source}")
    if not a.no_append:
        append_benchmark("Training throughput", body)
        print("appended to BENCHMARKS.md")


def _count(args: ModelArgs) -> int:
    """Parameter count without allocating (for the large presets)."""
    with torch.device("meta"):
        return Transformer(args).num_params()


if __name__ == "__main__":
    main()
