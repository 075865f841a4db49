"""Adapter-only weight sync into vLLM for a LoRA policy.

With ``[lora]`` on, the base weights never change, so vLLM is started once on the base (unmerged) and
every sync writes only the adapters, as a PEFT directory (``adapter_config.json`` +
``adapter_model.safetensors``, Hugging Face module names) that the engine loads as a new ``LoRARequest``:
a few MB a sync instead of the whole merged model. Where vLLM's LoRA cannot serve the adapters the sync
stays the merged full weights (:func:`.snapshot.full_cpu_state`), and the setup line says why.
"""

from __future__ import annotations

from typing import Any

from torch import nn

VLLM_LORA_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
"""The Hugging Face projections lmforge's adapters may sit on for vLLM to apply them (its Llama-layout
decoders pack q/k/v and gate/up, and take adapters on each part)."""
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts (``vllm.config.lora.MaxLoRARanks``)."""


def adapter_sync_plan(lora: Any, g: Any, args: Any) -> tuple[int, str]:
    """``(max_lora_rank, note)``: the rank vLLM's LoRA is started with when the adapters alone are synced
    (0: the merged full weights are), and the setup line's note saying which and why ("" when the run
    has no adapters or does not sample with vLLM)."""
    if not lora.enabled or g.engine != "vllm":
        return 0, ""
    merged = "merged full weights (vLLM receives the adapters folded into the base)"
    if lora.quantize != "none":
        return 0, f"{merged}: lora.quantize={lora.quantize} (QLoRA's 4-bit base is not a model vLLM loads)"
    if getattr(args, "n_experts", 0):
        return 0, f"{merged}: adapters on a mixture of experts' stacked expert weights, which vLLM's LoRA does not load"
    if g.vllm_mode != "colocate":
        return 0, f"{merged}: adapter-only sync is built for grpo.vllm_mode=colocate only"
    from lmforge.models.hf import hf_module_name
    from lmforge.models.spec import lora_targets_for

    hf = {hf_module_name(f"layers.0.{path}", args).rpartition(".")[2]
          for path in lora_targets_for(args, lora.target_modules).values()}
    if not hf <= VLLM_LORA_MODULES:
        return 0, f"{merged}: vLLM's LoRA does not take adapters on {', '.join(sorted(hf - VLLM_LORA_MODULES))}"
    rank = next((r for r in VLLM_LORA_RANKS if r >= lora.rank), 0)
    if not rank:
        return 0, f"{merged}: lora.rank={lora.rank} is above vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]})"
    return rank, f"adapters only (a PEFT directory per sync, loaded as a vLLM LoRA of max rank {rank})"


def adapter_bytes(model: nn.Module) -> int:
    """Bytes of the adapter tensors one sync writes (float32, as :func:`write_peft_adapter` writes them)."""
    from lmforge.models.lora import adapter_weights

    return sum((a.numel() + b.numel()) * 4 for a, b in adapter_weights(model).values())
