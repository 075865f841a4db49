"""An lmforge run exported to GGUF, answered by llama.cpp: its greedy answers against lmforge's on the
same file, over held-out `add` problems (the task of ``make demo-real``).

    lmforge export --gguf out/sft.gguf runs/demo_real/sft
    python examples/gguf_llama_cpp_check.py runs/demo_real/sft out/sft.gguf [--n 24]

Needs ``pip install llama-cpp-python`` (it builds llama.cpp from source). lmforge reads the GGUF back
(the weights llama.cpp runs) and decodes greedily with the run's chat template; llama.cpp decodes the
same prompt ids greedily; the script prints how many answers are identical and each one's exact match.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_gguf_export import llama_cpp_greedy  # noqa: E402

from lmforge.data.chat import chat_format_for, stop_token_ids  # noqa: E402
from lmforge.data.tasks import task_examples  # noqa: E402
from lmforge.models.generate import generate  # noqa: E402
from lmforge.models.gguf import load_gguf_model  # noqa: E402
from lmforge.models.load import ModelSource, load_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", help="the lmforge run or checkpoint the GGUF was exported from (its tokenizer)")
    p.add_argument("gguf")
    p.add_argument("--n", type=int, default=24, help="held-out add problems")
    args = p.parse_args()
    tok = load_model(ModelSource.at(args.run)).tokenizer
    fmt, stops = chat_format_for(tok), stop_token_ids(tok)
    problems = task_examples("test", args.n, ["add"])
    ids = [fmt.prompt_ids([{"role": "user", "content": e.prompt}]) for e in problems]
    exported = load_gguf_model(args.gguf).eval()
    with torch.no_grad():
        ours = [generate(exported, [i], 8, stop_ids=stops, pad_id=tok.pad_id, temperature=0.0)[0] for i in ids]
    start = time.perf_counter()
    theirs = llama_cpp_greedy(args.gguf, ids, stops, 8)
    seconds = time.perf_counter() - start
    same = sum(a == b for a, b in zip(ours, theirs))
    right = sum(tok.decode(t, skip_special=True).strip() == e.answer for t, e in zip(theirs, problems))
    print(f"{len(ids)} held-out add prompts: llama.cpp's greedy answers equal lmforge's on {same}/{len(ids)}; "
          f"llama.cpp exact match {right}/{len(ids)} ({seconds:.1f} s)")


if __name__ == "__main__":
    main()
