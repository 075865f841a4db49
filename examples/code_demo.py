"""The code environment on real weights: SmolLM2-135M-Instruct, a few GRPO steps with the sandboxed
``python`` tool and hidden unit tests, and the held-out pass rate before and after.

    python examples/code_demo.py          # runs/demo_code/grpo, then the table (CPU: 15-30 minutes)

Settings: configs/grpo_code.toml (this script passes the model file only). The held-out split is the
embedded code task's 20 functions the policy never trains on (``code_task_records("test")``), scored with
greedy episodes (2 turns, 160 new tokens a turn): pass rate (every hidden test passed), the mean fraction
of tests passed, and tool calls per episode.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

from demo import ROOT, machine, run_stage  # examples/demo.py: the stage runner and the machine line
from demo_real import gguf_path, wilson

from lmforge.checkpoint import resolve_checkpoint
from lmforge.data.chat import chat_format_for, stop_token_ids
from lmforge.metrics.records import read_records
from lmforge.models.load import ModelSource, load_model
from lmforge.rl.engines.base import SamplingSettings
from lmforge.rl.engines.lmforge_engine import LmforgeEngine
from lmforge.rl.environments import CodeEnv
from lmforge.rl.environments.code_tasks import code_task_records
from lmforge.rl.multi_turn import episode_metrics, run_episodes

TOKENIZER = ROOT / "tests" / "fixtures" / "tokenizers" / "smollm2-135m-instruct"
OUT = ROOT / "runs" / "demo_code"


def evaluate(source: str) -> dict[str, float]:
    """Greedy code episodes on the 20 held-out functions with the model at ``source``."""
    where = (ModelSource.from_hf(source) if source.endswith(".gguf")
             else ModelSource("checkpoint", str(resolve_checkpoint(Path(source)))))
    lm = load_model(where, tokenizer=str(TOKENIZER))
    chat = chat_format_for(lm.tokenizer)
    env = CodeEnv(chat, max_turns=2)
    engine = LmforgeEngine(pad_id=lm.tokenizer.pad_id)
    engine.load_weights(lm.model, 0)
    sampling = SamplingSettings(160, 0.0, 1.0, tuple(stop_token_ids(lm.tokenizer)))
    episodes = run_episodes(engine, env, code_task_records("test"), chat, lm.tokenizer, sampling, seed=0)
    passed = sum(e.reward == 1.0 for e in episodes)
    return {"passed": passed, "n": len(episodes), "reward": sum(e.reward for e in episodes) / len(episodes),
            **episode_metrics(episodes)}


def main() -> int:
    """``--eval-only``: score the base model and an earlier run's model again (no training)."""
    gguf = str(gguf_path())
    wall = None
    if "--eval-only" not in sys.argv:
        wall = run_stage("grpo", "grpo", "configs/grpo_code.toml", None, OUT, [f"--model.from_hf={gguf}"])
    rows = []
    for label, source in (("base", gguf), ("after GRPO", str(OUT / "grpo"))):
        r = evaluate(source)
        lo, hi = wilson(int(r["passed"]), r["n"])
        rows.append(f"| {label} | {r['passed'] / r['n']:.2f} ({int(r['passed'])}/{r['n']}, {lo:.2f}-{hi:.2f}) | "
                    f"{r['reward']:.2f} | {r['tools/calls']:.2f} | {r['tools/turns']:.2f} |")
    grpo = [x for x in read_records(OUT / "grpo") if x["kind"] == "train"]
    curve = ", ".join(f"{x['reward/mean']:.2f}" for x in grpo)
    print(f"\n{machine(OUT, ('grpo',))}, {datetime.date.today()}\n")
    print("| model | held-out pass rate (greedy) | tests passed | tool calls / episode | turns |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    took = f"; wall: GRPO {wall:.0f} s" if wall else ""
    print(f"\nGRPO reward/mean by step: {curve}{took}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
