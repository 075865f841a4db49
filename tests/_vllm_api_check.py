"""Weight sync into vLLM's own API server (``python -m lmforge.rl.engines.vllm_api``), by file and in memory,
checked by log-probs (as ``_vllm_sync_check.py`` does). Prints one JSON line.

``python tests/_vllm_api_check.py MODEL TOKENIZER SYNC_DIR URL [URL ...]`` with ``LMFORGE_SERVER_SECRET`` set to
the servers' secret: the servers serve MODEL with ``--weights-dir SYNC_DIR --dtype float32``. The trainer's
policy is changed (2% noise on every weight) before each sync; after it, every server's log-probs of the
tokens it samples must equal lmforge's teacher-forced fp32 ones under the new weights.
"""

from __future__ import annotations

import copy
import json
import sys
import time
from pathlib import Path

import torch


def main() -> None:
    model_src, tokenizer, sync_dir, urls = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4:]
    from lmforge.data.chat import chat_format_for, stop_token_ids
    from lmforge.models.load import ModelSource, load_model
    from lmforge.rl.engines.base import SamplingSettings
    from lmforge.rl.engines.lmforge_engine import LmforgeEngine
    from lmforge.rl.engines.openai_backend import VllmApiBackend, check_served_model
    from lmforge.rl.engines.server_pool import ServerPool
    from lmforge.rl.engines.snapshot import WeightSnapshots
    from lmforge.rl.engines.vllm_engine import VllmEngine

    torch.manual_seed(0)
    lm = load_model(ModelSource.from_hf(model_src), tokenizer=tokenizer)
    model, tok = lm.model.eval(), lm.tokenizer
    pool = ServerPool([VllmApiBackend(u, timeout_s=600) for u in urls])
    for s in pool.servers:
        check_served_model(s, model.args, tok)
    snapshots = WeightSnapshots(sync_dir, owned=False)
    by_file = VllmEngine(pool, snapshots, loads=True, shared=False)
    in_memory = VllmEngine(pool, snapshots, loads=True, shared=False, memory_dtype=torch.float32)
    chat = chat_format_for(tok)
    prompts = [chat.prompt_ids([{"role": "user", "content": q}]) for q in
               ("What is the capital of France?", "What is 17 + 25?", "Name a colour.", "Say hello.")] * len(urls)
    sampling = SamplingSettings(24, 1.0, 1.0, tuple(stop_token_ids(tok)))
    reference = LmforgeEngine(pad_id=tok.pad_id)

    def gap(m: torch.nn.Module, completions: list) -> float:
        reference.load_weights(m, 0)
        ours = reference.sampled_logprobs(prompts, [c.token_ids for c in completions], 1.0)
        return max(abs(a - b) for c, o in zip(completions, ours) for a, b in zip(c.logprobs, o))

    def perturb() -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02 * p.abs().mean())

    result: dict[str, float] = {"gap_start": gap(model, by_file.generate(prompts, sampling, seed=1))}
    t0 = time.perf_counter()
    pool.init_transfer(torch.device("cpu"))
    result["init_transfer_seconds"] = time.perf_counter() - t0
    for name, engine in (("file", by_file), ("memory", in_memory), ("file2", by_file), ("memory2", in_memory)):
        old = copy.deepcopy(model)
        perturb()
        engine.load_weights(model, len(result))
        after = engine.generate(prompts, sampling, seed=2)
        result |= {f"{name}_gap_synced": gap(model, after), f"{name}_gap_stale": gap(old, after),
                   f"{name}_seconds": engine.sync_seconds, f"{name}_bytes": engine.sync_bytes}
    result["servers_left"] = len(pool.servers)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
