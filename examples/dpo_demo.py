"""DPO demo on the CPU: a short SFT of the embedded tasks, preference pairs from its own mistakes, DPO.

    python examples/dpo_demo.py            # from the repository root; a few minutes on 2 cores

1. The pretrained demo model ``runs/demo/pretrain`` (trained first with configs/debug.toml if missing).
2. A *short* SFT of it on the embedded tasks (configs/sft_debug.toml, ``SFT_STEPS`` steps): the full SFT
   demo reaches 0.998 held-out exact match, which leaves preference training nothing to fix.
3. Preference pairs from the embedded *training* tasks: chosen = the correct answer, rejected = the
   SFT model's greedy answer if wrong, else the first wrong one of ``K`` samples at temperature 1
   (prompts with no wrong answer are skipped). The last tenth of the pairs is the validation set.
4. ``lmforge dpo --config configs/dpo_debug.toml`` from the SFT model on those pairs (DPO plus the
   chosen responses' NLL), and the same with ``--dpo.nll_weight=0`` (pure DPO) for comparison.

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


def build_pairs(model_dir: Path, out: Path) -> dict[str, int]:
    """Write ``train.jsonl`` and ``validation.jsonl`` of conversational pairs; returns the counts.

    The model's greedy answer comes first among the candidates for "rejected", then ``K`` samples at
    temperature 1: the greedy mistakes are the ones held-out (greedy) exact match counts."""
    model, tokenizer = load_for_inference(model_dir)
    examples = task_examples("train", PROMPTS)
    prompts = [e.prompt for e in examples]
    samples = [sample_texts(model, tokenizer, prompts, max_new_tokens=16, temperature=0.0 if k == 0 else 1.0,
                            seed=k, chat=True, batch_size=128) for k in range(K + 1)]
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
    correct = [sum(is_correct(s[i], e.answer) for i, e in enumerate(examples)) for s in samples]
    return {"prompts": len(examples), "pairs": len(pairs), "validation": n_val,
            "greedy_correct_pct": round(100 * correct[0] / len(examples)),
            "sampled_correct_pct": round(100 * sum(correct[1:]) / (K * len(examples)))}


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summary(run: str) -> dict[str, float]:
    """Before/after values of one DPO run, read back from its metrics.jsonl."""
    evals = [r for r in read_records(OUT / run, "eval") if "exact_match" in r]
    acc = [r["rewards/accuracies"] for r in read_records(OUT / run, "train")]
    k = max(len(acc) // 5, 1)
    out = {"steps": read_records(OUT / run, "train")[-1]["step"], "acc_first": mean(acc[:k]), "acc_last": mean(acc[-k:])}
    for key in ("exact_match", "exact_match_add", "exact_match_reverse", "exact_match_sort", "loss",
                "rewards/accuracies", "rewards/margins", "logps/chosen"):
        out[f"{key}:before"], out[f"{key}:after"] = evals[0][key], evals[-1][key]
    return out


def report(counts: dict[str, int], wall: dict[str, float]) -> str:
    runs = {"DPO + NLL (configs/dpo_debug.toml)": summary("dpo"), "pure DPO (dpo.nll_weight=0)": summary("dpo_pure")}
    rows = ["| measure | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]

    def row(label: str, key: str) -> None:
        rows.append(f"| {label} | " + " | ".join(f"{v[key + ':before']:.3f} → {v[key + ':after']:.3f}"
                                                  for v in runs.values()) + " |")

    row("held-out exact match (greedy, 600 problems), all", "exact_match")
    for task in ("add", "reverse", "sort"):
        row(f"… {task}", f"exact_match_{task}")
    rows.append("| rewards/accuracies, train (first → last fifth of logged steps) | "
                + " | ".join(f"{v['acc_first']:.3f} → {v['acc_last']:.3f}" for v in runs.values()) + " |")
    row("validation rewards/accuracies", "rewards/accuracies")
    row("validation rewards/margins", "rewards/margins")
    row("validation logps/chosen", "logps/chosen")
    head = (f"pairs: {counts['pairs']} of {counts['prompts']} training prompts had a wrong answer (greedy, then "
            f"{K} samples at temperature 1; greedy {counts['greedy_correct_pct']}% correct, samples "
            f"{counts['sampled_correct_pct']}%); {counts['validation']} kept for validation. "
            f"{next(iter(runs.values()))['steps']} DPO steps each. Wall: "
            + ", ".join(f"{k} {v:.0f} s" for k, v in wall.items()))
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
    wall["dpo_pure"] = lmforge("dpo_pure", "dpo", "--config", "configs/dpo_debug.toml", "--dpo.nll_weight=0",
                               f"--run.dir={OUT / 'dpo_pure'}")
    import torch

    print(f"\n### lmforge DPO demo, {datetime.date.today().isoformat()}: {platform.machine()}, "
          f"torch {torch.__version__}\n")
    print(report(counts, wall))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
