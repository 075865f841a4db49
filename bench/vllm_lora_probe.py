"""Does vLLM serve a LoRA adapter on this machine? ``.venv-vllm/bin/python bench/vllm_lora_probe.py MODEL_DIR OUT_DIR``

Writes a random rank-8 PEFT adapter on q_proj/v_proj of MODEL_DIR (a Hugging Face Llama directory) into
OUT_DIR, starts ``vllm.LLM(enable_lora=True)`` and samples greedily with and without it (a ``LoRARequest``):
one JSON line, ``ok`` false with the stage and error where vLLM cannot serve LoRA here. The probe before
building adapter-only weight sync into vLLM (docs/rollout_engines.md, "Adapter-only weight sync").
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_adapter(model: str, out: Path, rank: int = 8) -> None:
    """A random PEFT adapter (``adapter_config.json``, ``adapter_model.safetensors``) on every q/v projection."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(model) / "config.json").read_text())
    d = cfg["hidden_size"]
    kv = cfg["num_key_value_heads"] * (d // cfg["num_attention_heads"])
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for name, width in (("q_proj", d), ("v_proj", kv)):
            prefix = f"base_model.model.model.layers.{i}.self_attn.{name}"
            tensors[prefix + ".lora_A.weight"] = torch.randn(rank, d, generator=g) * 0.05
            tensors[prefix + ".lora_B.weight"] = torch.randn(width, rank, generator=g) * 0.05
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"],
        "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": model, "task_type": "CAUSAL_LM"}))


def main() -> None:
    model, out = sys.argv[1], Path(sys.argv[2])
    write_adapter(model, out)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    t0 = time.time()
    try:
        llm = LLM(model, dtype="float32", enforce_eager=True, max_model_len=256, enable_lora=True, max_lora_rank=8,
                  max_loras=1, seed=0)
    except Exception as e:  # noqa: BLE001 - the finding is the error itself
        print(json.dumps({"ok": False, "stage": "start", "error": f"{type(e).__name__}: {e}"[:600]}))
        traceback.print_exc()
        return
    sampling = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
    prompt = [TokensPrompt(prompt_token_ids=[1, 504, 3458, 282, 4649, 314])]
    try:
        base = llm.generate(prompt, sampling, use_tqdm=False)[0].outputs[0]
        lora = llm.generate(prompt, sampling, lora_request=LoRARequest("probe", 1, str(out)),
                            use_tqdm=False)[0].outputs[0]
    except Exception as e:  # noqa: BLE001
        print(json.dumps({"ok": False, "stage": "generate", "error": f"{type(e).__name__}: {e}"[:600]}))
        traceback.print_exc()
        return

    def logprobs(o) -> list[float]:  # noqa: ANN001 - vLLM's CompletionOutput
        return [float(d[t].logprob) for t, d in zip(o.token_ids, o.logprobs)]

    print(json.dumps({"ok": True, "start_s": time.time() - t0, "base": list(base.token_ids),
                      "lora": list(lora.token_ids), "base_lp": logprobs(base)[:3], "lora_lp": logprobs(lora)[:3]}))


if __name__ == "__main__":
    main()
