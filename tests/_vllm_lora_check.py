"""Run with vLLM's Python (``python tests/_vllm_lora_check.py MODEL TOKENIZER [SYNC] [SYNCS]``): weight sync of
a LoRA policy into a colocated vLLM engine, checked by log-probs. Prints one JSON line.

``SYNC`` ``adapters`` (default): the engine starts on the base weights with vLLM's LoRA on, and each sync
writes only the adapters (a PEFT directory it loads as a new ``LoRARequest``); ``merged``: the engine starts
on the base and each sync is the merged full weights (the fallback). Rank-8 adapters on every attention
and MLP projection are given random A and B (so the adapted model differs from its base) and synced
``SYNCS`` times, new ones before each sync (the seconds of each are reported). The engine's log-probs of the tokens it samples must
equal lmforge's teacher-forced fp32 log-probs under the adapters, and differ clearly from the base's and
from the adapters synced before (so an adapter that was not applied, or not replaced, fails).
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    model_src, tokenizer = sys.argv[1], sys.argv[2]
    sync = sys.argv[3] if len(sys.argv) > 3 else "adapters"
    syncs = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    from lmforge.config import LoraSection
    from lmforge.data.chat import chat_format_for, stop_token_ids
    from lmforge.exporters import write_hf_dir
    from lmforge.models.load import ModelSource, load_model
    from lmforge.models.lora import adapter_weights, adapters_disabled, apply_lora
    from lmforge.rl.engines import vllm_engine
    from lmforge.rl.engines.base import SamplingSettings
    from lmforge.rl.engines.lmforge_engine import LmforgeEngine
    from lmforge.rl.engines.snapshot import WeightSnapshots

    torch.manual_seed(0)
    lm = load_model(ModelSource.from_hf(model_src), tokenizer=tokenizer)
    model, tok = lm.model.eval(), lm.tokenizer
    work = Path(tempfile.mkdtemp(prefix="vllm_lora_"))
    write_hf_dir(model, tok, work / "model")  # the base, before any adapter
    lora = LoraSection(enabled=True, rank=8, alpha=16.0)
    apply_lora(model, lora)

    def new_adapters() -> dict:
        with torch.no_grad():
            for a, b in adapter_weights(model).values():
                a.normal_(0, 0.02)
                b.normal_(0, 0.02)
        return {n: (a.detach().clone(), b.detach().clone()) for n, (a, b) in adapter_weights(model).items()}

    snapshots = WeightSnapshots(work / "sync", owned=True)
    adapters = sync == "adapters"
    t0 = time.perf_counter()
    backend = vllm_engine.colocated_runner(work / "model", dtype="float32", seed=0, max_model_len=512,
                                           gpu_memory_utilization=0.3, max_lora_rank=8 if adapters else 0)
    start_s = time.perf_counter() - t0
    engine = vllm_engine.VllmEngine(backend, snapshots, loads=True, shared=False,
                                    adapters=(lora.model_dump(), str(work / "model")) if adapters else None)
    chat = chat_format_for(tok)
    prompts = [chat.prompt_ids([{"role": "user", "content": q}]) for q in
               ("What is the capital of France?", "What is 17 + 25?", "Name a colour.", "Say hello.")]
    sampling = SamplingSettings(24, 1.0, 1.0, tuple(stop_token_ids(tok)))
    reference = LmforgeEngine(pad_id=tok.pad_id)
    seconds, sizes, versions = [], [], []
    for v in range(syncs):  # new adapters every sync: the engine must serve the latest
        versions.append(new_adapters())
        engine.load_weights(model, v + 1)
        seconds.append(engine.sync_seconds)
        sizes.append(engine.sync_bytes)
    after = engine.generate(prompts, sampling, seed=2)
    reference.load_weights(model, 0)
    ids = [c.token_ids for c in after]

    def gap(ours: list) -> float:
        return max(abs(a - b) for c, o in zip(after, ours) for a, b in zip(c.logprobs, o))

    adapted = reference.sampled_logprobs(prompts, ids, 1.0)
    with torch.no_grad(), adapters_disabled(model):
        base = reference.sampled_logprobs(prompts, ids, 1.0)
    previous = None
    if syncs > 1:  # the adapters of the sync before the last
        with torch.no_grad():
            for (a, b), (a0, b0) in zip(adapter_weights(model).values(), versions[-2].values()):
                a.copy_(a0)
                b.copy_(b0)
        previous = gap(reference.sampled_logprobs(prompts, ids, 1.0))
    expected = sum((a.numel() + b.numel()) * 4 for a, b in adapter_weights(model).values())
    left = sorted(p.name for p in snapshots.dir.iterdir())
    print(json.dumps({"sync": sync, "gap_adapted": gap(adapted), "gap_base": gap(base), "gap_previous": previous,
                      "tokens": sum(len(i) for i in ids), "sync_bytes": sizes[-1], "adapter_bytes": expected,
                      "sync_seconds": seconds, "median_sync_s": statistics.median(seconds), "start_s": start_s,
                      "snapshots_left": left}), flush=True)
    engine.close()
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
