"""Write a model as a llama.cpp GGUF file (Llama incl. SmolLM2, Mistral, Qwen2/2.5, Qwen3, Gemma 3 text).

The inverse of :mod:`lmforge.models.gguf`, and built from the same tables: the model's Hugging Face
tensors (its family's ``state_dict_adapter``) are renamed to llama.cpp's names by inverting the
reader's mapping, then stored as llama.cpp's converter stores them, so llama.cpp, Ollama and LM Studio
run the file and lmforge reads it back to the same weights:

* the ``llama`` architecture (Llama, SmolLM2, Mistral) gets its q/k rows permuted into Meta's
  interleaved rotary layout (llama.cpp rotates adjacent pairs; lmforge and transformers rotate halves);
* Gemma 3's norm weights are stored as ``1 + w`` (llama.cpp's norm multiplies by the stored value);
* Llama 3 RoPE scaling becomes a ``rope_freqs`` tensor of per-frequency divisors;
* Gemma 3's layer pattern, local RoPE base and softmax scale are written only where they differ
  from what llama.cpp assumes (every 6th layer global, base 10,000, 1/sqrt(head_dim)).

Tensor types (``gguf_type``): ``f32``; ``f16`` and ``bf16`` (2-D weights; 1-D norms and biases stay
f32, as llama.cpp keeps them); ``q8_0`` (2-D weights whose rows split into 32-value blocks: one fp16
scale and 32 int8 values per block; other 2-D weights f16). Mistral's sliding window is recorded
(``llama.attention.sliding_window``, which lmforge reads back) but llama.cpp's ``llama`` architecture
attends to the whole context, so its logits differ from lmforge's beyond the window.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from lmforge.errors import UserError
from lmforge.models.args import ModelArgs
from lmforge.models.gguf import _GLOBAL_NAMES, _ROPE_FREQS, GEMMA3_LOCAL_THETA, GEMMA3_PATTERN, _gguf_module
from lmforge.models.spec import GGUFFormat, registered_specs, spec_for_args
from lmforge.models.tokenizer import Tokenizer

__all__ = ["GGUF_TYPES", "gguf_architecture", "gguf_format", "write_gguf"]

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
_Q8_BLOCK = 32


def gguf_format(args: ModelArgs) -> GGUFFormat:
    """How llama.cpp stores ``args``' family; UserError for a family or feature the writer does not cover."""
    if args.n_experts:
        raise UserError(f"GGUF export of mixture-of-experts models ({args.hf_model_type}) is not supported")
    fmt = spec_for_args(args).gguf
    if fmt is None:
        known = ", ".join(s.hf_model_type for s in registered_specs() if s.gguf is not None)
        raise UserError(f"GGUF export of {args.hf_model_type!r} models is not supported (supported: {known})")
    kind = (args.rope_scaling or {}).get("rope_type", (args.rope_scaling or {}).get("type"))
    if fmt.architecture == "gemma3" and kind not in (None, "default"):
        raise UserError(f"GGUF export of Gemma 3 with {kind} RoPE scaling is not supported")
    return fmt


def gguf_architecture(args: ModelArgs) -> str:
    """The GGUF architecture of ``args`` (see :func:`gguf_format`)."""
    return gguf_format(args).architecture


def _gguf_names(fmt: GGUFFormat) -> dict[str, str]:
    """Hugging Face name -> GGUF name, by inverting the reader's tables."""
    out = {hf: g for g, hf in _GLOBAL_NAMES.items()}
    for g, hf in fmt.layer_names.items():
        out[hf] = g
    return out


def _gguf_name(hf: str, names: dict[str, str]) -> str:
    if hf in names:
        return names[hf]
    parts = hf.split(".")
    module = ".".join(parts[3:-1])
    if parts[:2] != ["model", "layers"] or module not in names:
        raise UserError(f"GGUF export: no llama.cpp name for tensor {hf!r}")
    return f"blk.{parts[2]}.{names[module]}.{parts[-1]}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order: within each head, the first and second halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_divisors(args: ModelArgs) -> np.ndarray:
    """``rope_freqs``: what Llama 3 scaling divides each base frequency by (1 .. factor)."""
    from lmforge.models.layers.rope import rope_frequencies
    import dataclasses

    plain = rope_frequencies(dataclasses.replace(args, rope_scaling=None).decoder_config().ropes["global"], "cpu")[0]
    scaled = rope_frequencies(args.decoder_config().ropes["global"], "cpu")[0]
    return (plain / scaled).to(torch.float32).numpy()


def _stored(w: np.ndarray, gguf_type: str) -> tuple[np.ndarray, Any]:
    """``w`` as stored for ``gguf_type``, and its GGML type (None: numpy's dtype says it)."""
    gguf = _gguf_module()
    q = gguf.GGMLQuantizationType
    if w.ndim < 2 or gguf_type == "f32":
        return w.astype(np.float32), None
    if gguf_type == "bf16":
        return gguf.quants.quantize(w, q.BF16), q.BF16
    if gguf_type == "q8_0" and w.shape[-1] % _Q8_BLOCK == 0:
        return gguf.quants.quantize(w, q.Q8_0), q.Q8_0
    return w.astype(np.float16), None


def _file_type(gguf_type: str) -> int:
    t = _gguf_module().LlamaFileType
    return {"f32": t.ALL_F32, "f16": t.MOSTLY_F16, "bf16": t.MOSTLY_BF16, "q8_0": t.MOSTLY_Q8_0}[gguf_type]


def _add_hyperparameters(w: Any, args: ModelArgs, arch: str) -> None:
    w.add_vocab_size(args.vocab_size)
    w.add_context_length(args.max_seq_len)
    w.add_embedding_length(args.dim)
    w.add_block_count(args.n_layers)
    w.add_feed_forward_length(args.ffn_dim)
    w.add_head_count(args.n_heads)
    w.add_head_count_kv(args.kv_heads)
    w.add_layer_norm_rms_eps(args.norm_eps)
    w.add_rope_freq_base(args.rope_theta)
    w.add_rope_dimension_count(args.head_dim)
    w.add_key_length(args.head_dim)
    w.add_value_length(args.head_dim)
    scaling = args.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        w.add_rope_scaling_type(_gguf_module().RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(scaling["factor"]))
    if arch == "gemma3":
        _add_gemma3(w, args)
    elif args.sliding_window is not None:
        w.add_sliding_window(args.sliding_window)


def _add_gemma3(w: Any, args: ModelArgs) -> None:
    """Gemma 3's keys, each only where llama.cpp's built-in value would be wrong (see module doc)."""
    sliding = [args.layer_window(i) is not None for i in range(args.n_layers)]
    if args.sliding_window is not None:
        w.add_sliding_window(args.sliding_window)
    if sliding != [i % GEMMA3_PATTERN < GEMMA3_PATTERN - 1 for i in range(args.n_layers)]:
        w.add_sliding_window_pattern(sliding)
    local = args.local_rope_theta if args.local_rope_theta is not None else args.rope_theta
    if local != GEMMA3_LOCAL_THETA:
        w.add_rope_freq_base_swa(local)
    default = (args.dim // args.n_heads if args.n_layers == 62 else args.head_dim) ** -0.5
    if args.attn_scale is not None and not math.isclose(args.attn_scale, default, rel_tol=1e-6):
        w.add_attention_scale(args.attn_scale)


def write_gguf(hf_state: dict[str, Tensor], args: ModelArgs, path: str | Path, *, tokenizer: Tokenizer | None = None,
               gguf_type: str = "f32", name: str = "lmforge", metadata: Callable[[Any], None] | None = None) -> Path:
    """Write ``hf_state`` (Hugging Face tensor names, as the family's adapter gives them) as a GGUF file.

    ``tokenizer`` adds the vocabulary and chat template (:mod:`lmforge.exporters.gguf_vocab`);
    ``metadata(writer)`` may add further keys before anything is written.
    """
    if gguf_type not in GGUF_TYPES:
        raise UserError(f"unknown GGUF type {gguf_type!r} (choose from: {', '.join(GGUF_TYPES)})")
    fmt = gguf_format(args)
    arch = fmt.architecture
    gguf = _gguf_module()
    names = _gguf_names(fmt)
    heads = {"self_attn.q_proj": args.n_heads, "self_attn.k_proj": args.kv_heads}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_file_type(_file_type(gguf_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_hyperparameters(writer, args, arch)
    if tokenizer is not None:
        from lmforge.exporters.gguf_vocab import add_tokenizer

        add_tokenizer(writer, tokenizer, args.vocab_size)
    if metadata is not None:
        metadata(writer)
    if (args.rope_scaling or {}).get("rope_type") == "llama3":
        writer.add_tensor(_ROPE_FREQS, _llama3_divisors(args))
    for hf, t in hf_state.items():
        if hf == "lm_head.weight" and (args.tie_embeddings or arch == "gemma3"):
            continue
        a = t.detach().to("cpu", torch.float32).numpy()
        if fmt.norm_shifted and hf.endswith("norm.weight"):
            a = a + 1.0
        module = ".".join(hf.split(".")[3:-1])
        if fmt.permuted_qk and module in heads and hf.endswith(".weight"):
            a = _permute(a, heads[module])
        data, raw_dtype = _stored(np.ascontiguousarray(a), gguf_type)
        writer.add_tensor(_gguf_name(hf, names), data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
