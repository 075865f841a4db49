"""DPO demo on the CPU: a short SFT of the embedded tasks, preference pairs from its own mistakes, DPO.

    python examples/dpo_demo.py            # from the repository root; a few minutes on 2 cores

1. The pretrained demo model ``runs/demo/pretrain`` (trained first with configs/debug.toml if missing).
2. A *short* SFT of it on the embedded tasks (configs/sft_debug.toml, ``SFT_STEPS`` steps): the full SFT
   demo reaches 0.998 held-out exact match, which leaves preference training nothing to fix.
3. Preference pairs from the embedded *training* tasks: for each prompt, ``K`` completions sampled
   from the SFT model at temperature 1; chosen = the correct answer, rejected = the first wrong
   sample (prompts with no wrong sample are skipped). The last tenth of the pairs is the validation set.
4. ``lmforge dpo --config configs/dpo_debug.toml`` from the SFT model on those pairs.

It prints held-out greedy exact match (600 test problems, never used for pairs) before and after DPO,
and rewards/accuracies over training, read back from the runs' metrics.jsonl. Everything is written
under runs/dpo_demo (deleted first; runs/demo/pretrain is reused).
"""

from __future__ import annotations

import datetime
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from lmforge.data.tasks import is_correct, task_examples
from lmforge.inference import load_for_inference, sample_texts
from lmforge.metrics.records import read_records

ROOT = Path(__file__).resolve().parent.parent
PRETRAIN = ROOT / "runs" / "demo" / "pretrain"
OUT = ROOT / "runs" / "dpo_demo"
SFT_STEPS = 500
PROMPTS = 2400
"""Training prompts the pairs are drawn from (of the 12,000 embedded ones, all three tasks)."""
K = 4
"""Samples per prompt; a prompt becomes a pair when at least one of them is wrong."""


def lmforge(name: str, *args: str) -> float:
    """Run ``lmforge ARGS`` in the repository root, show its eval lines and a training line every
    ~10 s, return its wall seconds."""
    argv = [sys.executable, "-m", "lmforge", *args]
    print(f"\n=== {name}: lmforge {' '.join(args)}", flush=True)
    start, last, tail = time.perf_counter(), 0.0, []
    with subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1) as proc:
        for line in proc.stdout:  # type: ignore[union-attr]
            tail = (tail + [line])[-40:]
            now = time.perf_counter()
            if line.startswith("completed step"):
                if now - last < 10:
                    continue
                last = now
            print(f"[{name} {now - start:4.0f}s] {line.rstrip()[:170]}", flush=True)
    if proc.returncode:
        sys.exit(f"{name} failed (exit {proc.returncode}); its last lines:\n{''.join(tail)}")
    return time.perf_counter() - start


def build_pairs(model_dir: Path, out: Path, temperature: float = 1.0) -> dict[str, int]:
    """Write ``train.jsonl`` and ``validation.jsonl`` of conversational pairs; returns the counts."""
    model, tokenizer = load_for_inference(model_dir)
    examples = task_examples("train", PROMPTS)
    prompts = [e.prompt for e in examples]
    samples = [sample_texts(model, tokenizer, prompts, max_new_tokens=16, temperature=temperature, seed=k, chat=True,
                            batch_size=128) for k in range(K)]
    pairs = []
    for i, e in enumerate(examples):
        wrong = next((s[i] for s in samples if not is_correct(s[i], e.answer)), None)
        if wrong is not None:
            pairs.append({"prompt": [{"role": "user", "content": e.prompt}],
                          "chosen": [{"role": "assistant", "content": e.answer}],
                          "rejected": [{"role": "assistant", "content": wrong.strip()}], "task": e.task})
    n_val = len(pairs) // 10
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", pairs[:-n_val]), ("validation", pairs[-n_val:])):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in part))
    correct = sum(is_correct(s[i], e.answer) for s in samples for i, e in enumerate(examples))
    return {"prompts": len(examples), "pairs": len(pairs), "validation": n_val,
            "sampled_correct_pct": round(100 * correct / (K * len(examples)))}


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def report(counts: dict[str, int], wall: dict[str, float]) -> str:
    evals = [r for r in read_records(OUT / "dpo", "eval") if "exact_match" in r]
    before, after = evals[0], evals[-1]
    train = read_records(OUT / "dpo", "train")
    n = len(train)
    rows = ["| measure | before DPO | after DPO |", "|---|---|---|",
            f"| held-out exact match (greedy, 600 problems), all | {before['exact_match']:.3f} | {after['exact_match']:.3f} |"]
    for task in ("add", "reverse", "sort"):
        key = f"exact_match_{task}"
        rows.append(f"| … {task} | {before[key]:.3f} | {after[key]:.3f} |")
    acc = [r["rewards/accuracies"] for r in train]
    rows.append(f"| rewards/accuracies (train, mean of the first / last {max(n // 5, 1)} logged steps) | "
                f"{mean(acc[:max(n // 5, 1)]):.3f} | {mean(acc[-max(n // 5, 1):]):.3f} |")
    rows.append(f"| validation: loss (mean DPO loss) | {before['loss']:.3f} | {after['loss']:.3f} |")
    rows.append(f"| validation: rewards/accuracies | {before['rewards/accuracies']:.3f} | "
                f"{after['rewards/accuracies']:.3f} |")
    rows.append(f"| validation: rewards/margins | {before['rewards/margins']:.3f} | {after['rewards/margins']:.3f} |")
    steps = train[-1]["step"]
    head = (f"pairs: {counts['pairs']} of {counts['prompts']} training prompts had a wrong sample among {K} "
            f"({counts['sampled_correct_pct']}% of samples correct); {counts['validation']} kept for validation. "
            f"DPO: {steps} steps. Wall: " + ", ".join(f"{k} {v:.0f} s" for k, v in wall.items()))
    return head + "\n\n" + "\n".join(rows)


def main() -> int:
    shutil.rmtree(OUT, ignore_errors=True)
    wall: dict[str, float] = {}
    if not (PRETRAIN / "checkpoints").is_dir():
        wall["pretrain"] = lmforge("pretrain", "pretrain", "--config", "configs/debug.toml", f"--run.dir={PRETRAIN}")
    wall["sft"] = lmforge("sft", "sft", "--config", "configs/sft_debug.toml", f"--model.from_checkpoint={PRETRAIN}",
                          f"--training.steps={SFT_STEPS}", f"--eval.interval={SFT_STEPS}", "--checkpoint.interval=0",
                          f"--run.dir={OUT / 'sft'}")
    t0 = time.perf_counter()
    counts = build_pairs(OUT / "sft", OUT / "pairs")
    wall["pairs"] = time.perf_counter() - t0
    print(f"\n=== pairs: {counts}", flush=True)
    wall["dpo"] = lmforge("dpo", "dpo", "--config", "configs/dpo_debug.toml")
    import torch

    print(f"\n### lmforge DPO demo, {datetime.date.today().isoformat()}: {platform.machine()}, "
          f"torch {torch.__version__}\n")
    print(report(counts, wall))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
