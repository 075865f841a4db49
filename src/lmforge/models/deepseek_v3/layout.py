"""DeepSeek-V3's checkpoint tensor names: lmforge's parameters <-> transformers' ``DeepseekV3ForCausalLM``.

The Llama names for embeddings, norms and the dense layers' MLP (``mlp.gate_proj`` ...), plus latent
attention's projections and norms, the router with its ``e_score_correction_bias``, the routed experts
(one matrix per expert on disk, stacked in lmforge) and the shared experts (``mlp.shared_experts.*``).
Multi-token-prediction layers (``model.layers.{n_layers}...``) are dropped on load with one warning.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Mapping

from torch import Tensor

from lmforge.models.args import ModelArgs
from lmforge.models.common.llama_style import LLAMA_LAYOUT
from lmforge.models.common.moe_keys import EXPERTS
from lmforge.models.state_dict_adapter import StateDictAdapter

__all__ = ["DEEPSEEK_V3_LAYOUT"]

_HF_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")

ATTENTION = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
MOE = {
    "feed_forward.router.weight": "mlp.gate.weight",
    "feed_forward.router.correction_bias": "mlp.gate.e_score_correction_bias",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}


@dataclass(frozen=True)
class DeepseekV3Adapter(StateDictAdapter):
    """The renaming, reading past multi-token-prediction layers."""

    def from_hf(self, hf_state: Mapping[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
        kept, dropped = {}, set()
        for name, t in hf_state.items():
            m = _HF_LAYER_INDEX.match(name)
            if m is not None and int(m.group(1)) >= args.n_layers:
                dropped.add(int(m.group(1)))
                continue
            kept[name] = t
        if dropped:
            warnings.warn(f"ignoring the checkpoint's {len(dropped)} multi-token-prediction layer(s) (model.layers."
                          f"{min(dropped)}...): lmforge runs and trains the main model only", stacklevel=2)
        return super().from_hf(kept, args)


_BASE = LLAMA_LAYOUT.extend(layer_names={**ATTENTION, **MOE}, expert_names=EXPERTS,
                            drop=("attention.wk.weight", "attention.wv.weight"))
DEEPSEEK_V3_LAYOUT = DeepseekV3Adapter(_BASE.layer_names, _BASE.global_names, _BASE.expert_names, _BASE.fused_names)
