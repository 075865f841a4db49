"""Tiny transformers models written to GGUF the way llama.cpp's converter writes them (f32 tensors),
for the GGUF reader's tests: llama.cpp's tensor names, the q/k row permutation of the ``llama``
architecture, Llama 3 RoPE as a ``rope_freqs`` tensor, and Gemma 3's norm weights stored as ``1 + w``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import numpy as np

HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's ``LlamaModel.permute`` does to q/k rows (Meta's interleaved rotary layout)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(theta: float, head_dim: int, s: dict) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` tensor for Llama 3 RoPE: the divisor of each base frequency."""
    out = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * math.pi / freq
        ctx, lo, hi, f = s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"], s["factor"]
        if wavelen < ctx / hi:
            out.append(1.0)
        elif wavelen > ctx / lo:
            out.append(f)
        else:
            smooth = (ctx / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / f + smooth))
    return np.asarray(out, dtype=np.float32)


GEMMA3_NAMES = {**HF_TO_GGUF, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def write_gguf(model: Any, arch: str, path: Path, metadata: Callable[[Any], None] | None = None) -> Path:
    """``model`` (a transformers ``*ForCausalLM``) as llama.cpp would convert it, in f32; ``metadata(writer)``
    adds architecture keys (Gemma 3's window, pattern...)."""
    import gguf

    gemma = arch == "gemma3"
    names = GEMMA3_NAMES if gemma else HF_TO_GGUF
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope_parameters = getattr(c, "rope_parameters", None) or {}
    rope_parameters = rope_parameters.get("full_attention", rope_parameters)
    theta = rope_parameters["rope_theta"] if rope_parameters else c.rope_theta
    w.add_rope_freq_base(theta)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if metadata is not None:
        metadata(w)
    rope = rope_parameters or getattr(c, "rope_scaling", None) or {}
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(theta, head_dim, rope))
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and (c.tie_word_embeddings or gemma):
            continue
        a = t.detach().float().numpy().copy()
        if gemma and name.endswith("norm.weight"):
            a = a + 1.0  # llama.cpp's Gemma converter stores 1 + w
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            g = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, _, kind = rest.rpartition(".")
            g = f"blk.{layer}.{names[module]}.{kind}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                a = llama_cpp_permute(a, c.num_attention_heads if "q_proj" in module else c.num_key_value_heads)
        w.add_tensor(g, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


