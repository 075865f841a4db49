"""A partial rollout through vLLM, checked by log-probs. Prints one JSON line.

``python tests/_vllm_partial_check.py MODEL TOKENIZER SYNC_DIR URL [URL ...]`` (vLLM's API servers, with
``LMFORGE_SERVER_SECRET`` set to their secret; weights synced in memory), or ``... MODEL TOKENIZER SYNC_DIR
colocate`` with vLLM's Python (a ``vllm.LLM`` in this process; weights synced by file).

A round of 8 rows (4 prompts x 2) is decoded in two segments of 12 tokens (``rl/partial_rollouts.py``):
the first under the starting weights (version 0), then every weight is changed (2% noise) and synced
(version 1), then the second segment continues the unfinished rows as completion requests of prompt +
tokens so far. Each token's log-prob must be the teacher-forced fp32 one under the weights of *its*
segment, and the second segment's must differ from the old weights' (so a continuation that reused keys
and values prefix-cached under the old weights, or a sync that loaded nothing, fails). One prompt is longer
than a KV block (128 tokens on a CPU), so vLLM's prefix cache holds blocks of it across the sync.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch


def main() -> None:
    model_src, tokenizer, sync_dir, targets = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4:]
    from lmforge.data.chat import chat_format_for, stop_token_ids
    from lmforge.models.load import ModelSource, load_model
    from lmforge.rl.engines.base import SamplingSettings
    from lmforge.rl.engines.lmforge_engine import LmforgeEngine
    from lmforge.rl.engines.snapshot import WeightSnapshots
    from lmforge.rl.engines.vllm_engine import VllmEngine, colocated_runner
    from lmforge.rl.partial_rollouts import PartialRound, advance_round

    torch.manual_seed(0)
    lm = load_model(ModelSource.from_hf(model_src), tokenizer=tokenizer)
    model, tok = lm.model.eval(), lm.tokenizer
    if targets == ["colocate"]:
        backend = colocated_runner(Path(model_src), dtype="float32", seed=0, max_model_len=512,
                                   gpu_memory_utilization=0.3)
        engine = VllmEngine(backend, WeightSnapshots(sync_dir, owned=False), loads=True, shared=False)
    else:
        from lmforge.rl.engines.openai_backend import VllmApiBackend
        from lmforge.rl.engines.server_pool import ServerPool

        backend = ServerPool([VllmApiBackend(u, timeout_s=600) for u in targets])
        backend.init_transfer(torch.device("cpu"))
        engine = VllmEngine(backend, WeightSnapshots(sync_dir, owned=False), loads=True, shared=False,
                            memory_dtype=torch.float32)
    engine.load_weights(model, 0)  # the servers may hold other weights (an earlier check changed them)
    chat = chat_format_for(tok)
    # one prompt longer than vLLM's CPU KV block (128 tokens): its blocks are prefix-cached by the first
    # segment, so a continuation that reused them after the sync would carry the old weights' keys and values
    long_text = " ".join(f"Item {i} is a {c} box." for i, c in enumerate(["red", "blue", "green", "small"] * 6))
    questions = ("What is the capital of France?", "What is 17 + 25?", f"{long_text} Which item is green?",
                 "Write a long story.")
    prompt_ids = [chat.prompt_ids([{"role": "user", "content": q}]) for q in questions]
    sampling = SamplingSettings(24, 1.0, 1.0, tuple(stop_token_ids(tok)))
    rnd = PartialRound(list(range(4)), [{}] * 4, prompt_ids, group_size=2)
    seeds = lambda position, segment: 1 + 10 * position + segment  # noqa: E731
    advance_round(engine, rnd, sampling, 2, 8, seeds)
    first = [len(c) for c in rnd.completion_ids]
    done_first = list(rnd.done)
    old = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02 * p.abs().mean())
    engine.load_weights(model, 1)
    advance_round(engine, rnd, sampling, 2, 8, seeds)

    prompts = [prompt_ids[i // 2] for i in range(8)]
    reference = LmforgeEngine(pad_id=tok.pad_id)

    def logprobs(m: torch.nn.Module) -> list[list[float]]:
        reference.load_weights(m, 0)
        return reference.sampled_logprobs(prompts, rnd.completion_ids, 1.0)

    under_old, under_new = logprobs(old), logprobs(model)

    def gap(got: list[list[float]], want: list[list[float]], segment: int) -> float:
        pairs = [(a, b) for row, g, w in zip(range(8), got, want) for j, (a, b) in enumerate(zip(g, w))
                 if (j < first[row]) == (segment == 0)]
        return max((abs(a - b) for a, b in pairs), default=float("nan"))

    versions_ok = all(v == [0] * n + [1] * (len(c) - n)
                      for v, n, c in zip(rnd.token_versions, first, rnd.completion_ids))
    print(json.dumps({
        "prompt_lengths": [len(p) for p in prompt_ids], "first_segment": first, "lengths": [len(c) for c in rnd.completion_ids], "done_first": done_first,
        "continued": sum(len(c) > n for c, n in zip(rnd.completion_ids, first)),
        "finished_rows_untouched": all(len(c) == n for c, n, d in zip(rnd.completion_ids, first, done_first) if d),
        "versions_ok": versions_ok, "all_done": all(rnd.done),
        "gap_first_old": gap(rnd.logprobs, under_old, 0), "gap_second_new": gap(rnd.logprobs, under_new, 1),
        "gap_second_old": gap(rnd.logprobs, under_old, 1)}), flush=True)
    if targets == ["colocate"]:
        engine.close()


if __name__ == "__main__":
    main()
