"""The block tensor names llama.cpp gives the Llama-shaped families (``blk.N.<part>``), which each
family's :class:`~lmforge.models.spec.GGUFFormat` starts from."""

from __future__ import annotations

LLAMA_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
"""``blk.N.<part>.{weight,bias}`` -> ``model.layers.N.<name>.{weight,bias}``; anything else is refused by
name, so a file with tensors lmforge does not model never loads silently incomplete."""
