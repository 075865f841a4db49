"""Run with vLLM's Python (``python tests/_vllm_sync_check.py MODEL TOKENIZER MODE [VLLM_PYTHON]``): weight
sync into a vLLM engine, checked by log-probs. Prints one JSON line.

The engine starts on the model's weights; then every weight is changed (noise of 2% of each tensor's
scale, the tied embedding included) and loaded into the engine. The engine's log-probs of the tokens it
samples must equal lmforge's teacher-forced fp32 log-probs of the same tokens under the new weights, and
differ clearly from those under the old ones (so a sync that loads nothing, or misses a tensor, fails).
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    model_src, tokenizer, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    vllm_python = sys.argv[4] if len(sys.argv) > 4 else ""
    from lmforge.data.chat import chat_format_for, stop_token_ids
    from lmforge.models.load import ModelSource, load_model
    from lmforge.rl.engines.base import SamplingSettings
    from lmforge.rl.engines.lmforge_engine import LmforgeEngine
    from lmforge.rl.engines.snapshot import WeightSnapshots
    from lmforge.rl.engines import openai_backend, vllm_engine
    from lmforge.exporters import write_hf_dir

    torch.manual_seed(0)
    lm = load_model(ModelSource.from_hf(model_src), tokenizer=tokenizer)
    model, tok = lm.model.eval(), lm.tokenizer
    work = Path(tempfile.mkdtemp(prefix="vllm_sync_"))
    write_hf_dir(model, tok, work / "model")
    snapshots = WeightSnapshots(work / "sync", owned=True)
    if mode == "server":
        backend = openai_backend.start_server(vllm_python or sys.executable, work / "model", weights_dir=snapshots.dir,
                                           dtype="float32", seed=0,
                                           max_model_len=512, log=work / "server.log")
    else:
        backend = vllm_engine.colocated_runner(work / "model", dtype="float32", seed=0, max_model_len=512,
                                               gpu_memory_utilization=0.3)
    engine = vllm_engine.VllmEngine(backend, snapshots, loads=True, shared=False)
    chat = chat_format_for(tok)
    prompts = [chat.prompt_ids([{"role": "user", "content": q}]) for q in
               ("What is the capital of France?", "What is 17 + 25?", "Name a colour.", "Say hello.")]
    sampling = SamplingSettings(24, 1.0, 1.0, tuple(stop_token_ids(tok)))
    reference = LmforgeEngine(pad_id=tok.pad_id)

    def gap(m: torch.nn.Module, completions: list) -> float:
        reference.load_weights(m, 0)
        ours = reference.sampled_logprobs(prompts, [c.token_ids for c in completions], 1.0)
        return max(abs(a - b) for c, o in zip(completions, ours) for a, b in zip(c.logprobs, o))

    before = engine.generate(prompts, sampling, seed=1)
    old = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02 * p.abs().mean())
    t0 = time.perf_counter()
    engine.load_weights(model, 1)
    sync_s = time.perf_counter() - t0
    after = engine.generate(prompts, sampling, seed=2)
    print(json.dumps({"gap_start": gap(old, before), "gap_synced": gap(model, after), "gap_stale": gap(old, after),
                      "tokens": sum(len(c.token_ids) for c in after), "sync_seconds": sync_s}), flush=True)
    engine.close()


if __name__ == "__main__":
    main()
