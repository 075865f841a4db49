"""Read llama.cpp's GGUF files as a model source (Llama incl. SmolLM2 and Mistral, Qwen2/2.5, Qwen3, Gemma 3).

A GGUF file is mapped onto what lmforge already reads from a Hugging Face directory, so no family
logic is repeated here: its metadata becomes a ``config.json``-style dict for
:func:`lmforge.models.hf_config.args_from_hf_config` (which refuses what lmforge cannot run exactly),
and its tensors, dequantized to fp32 with the ``gguf`` package, are renamed to Hugging Face names for
the family's ``state_dict_adapter``. Two conversions undo what llama.cpp's converter did: the q/k row
permutation of ``llama``-architecture models (it stores them in Meta's interleaved rotary layout;
lmforge, like transformers, uses ``rotate_half``; Qwen and Gemma models are stored unpermuted), and
the unit offset of Gemma 3's RMSNorm weights (it stores ``1 + w`` for every ``*norm.weight``; the
Hugging Face weight, which the (1 + w) norm scales by, is the stored value minus 1, as transformers'
own GGUF loader reads it). Which family an architecture reads as, its tensor names and which of the two
rewrites it has are the family's own (``ModelSpec.gguf``, a :class:`~lmforge.models.spec.GGUFFormat`).

Gemma 3 (``gemma3``, the text model; e.g. google/gemma-3-270m) becomes a ``gemma3_text`` config. What
its GGUF metadata leaves out is filled in as llama.cpp itself does: every 6th layer global, the others
sliding (unless ``attention.sliding_window_pattern`` says otherwise), local RoPE base 10,000 (unless
``rope.freq_base_swa``), and ``query_pre_attn_scalar`` = ``head_dim`` (the 62-layer 27B model:
``hidden_size / num_heads``; ``attention.scale`` when given).

Training needs full-precision weights, so everything is dequantized on load (fp32, then ``dtype``)
(:mod:`lmforge.exporters.gguf_write` writes GGUF files). The file's embedded tokenizer is not read: pair the weights with
the model's Hugging Face tokenizer files (``model.tokenizer=DIR``).

Everything the file declares is checked before it is used (:mod:`lmforge.models.gguf_checks`): its header's
counts, lengths, types and tensor extents against the file's bytes before ``gguf.GGUFReader`` reads it, and
the metadata's values against what a model can be before anything is sized from them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from lmforge.errors import UserError
from lmforge.models.args import ModelArgs
from lmforge.models.gguf_checks import check_against_tensors, check_config_bounds, check_gguf_layout
from lmforge.models.hf import model_from_hf_state
from lmforge.models.hf_config import args_from_hf_config
from lmforge.models.model import Transformer
from lmforge.models.spec import gguf_format_for

__all__ = ["gguf_args", "gguf_hf_config", "hf_state_dict_from_gguf", "load_gguf_model", "open_gguf"]

GEMMA3_PATTERN = 6
"""llama.cpp's Gemma 3 layer pattern (``set_swa_pattern(6)``): five sliding layers, then a global one."""
GEMMA3_LOCAL_THETA = 10_000.0
"""llama.cpp's RoPE base of Gemma 3's sliding layers (``rope_freq_base_train_swa``)."""

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_ROPE_FREQS = "rope_freqs.weight"
"""Llama 3.1-style RoPE: llama.cpp stores the per-frequency divisors instead of the scaling settings."""


def _gguf_module() -> Any:
    try:
        import gguf
    except ImportError:
        raise UserError("reading GGUF files needs the gguf package: pip install gguf") from None
    return gguf


def open_gguf(path: str | Path) -> Any:
    """A ``gguf.GGUFReader`` over ``path`` (memory-mapped; tensors are read on access)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"{p}: no such GGUF file")
    with p.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise UserError(f"{p}: not a GGUF file (no GGUF magic at its start)")
    gguf = _gguf_module()
    check_gguf_layout(p, str(p))  # before the reader, which trusts every declared count and size
    try:
        return gguf.GGUFReader(str(p))
    except Exception as e:  # noqa: BLE001 - a damaged file fails anywhere in numpy's parsing
        raise UserError(f"{p}: unreadable GGUF file, truncated or damaged ({type(e).__name__}: {e})") from None


def _value(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value; an array gives its length (the token list is only counted). Done by hand
    rather than with ``ReaderField.contents`` so that older ``gguf`` releases work too."""
    field = reader.fields.get(key)
    if field is None:
        return default
    kind = field.types[0]
    vt = _gguf_module().GGUFValueType
    if kind == vt.ARRAY:
        return len(field.data)
    part = field.parts[field.data[0]]
    if kind == vt.STRING:
        return bytes(part).decode("utf-8")
    if kind in (vt.FLOAT32, vt.FLOAT64):
        # float32 keys (rms epsilon, rope base) hold a decimal the source config spelt; its shortest
        # float32 spelling gives that decimal back (1e-05, not 9.99999974e-06).
        return float(str(part[0]))
    return part.tolist()[0]


def _array(reader: Any, key: str) -> list[Any] | None:
    """An array metadata value's items (numbers or booleans); None when the key is absent or not an array."""
    field = reader.fields.get(key)
    if field is None or field.types[0] != _gguf_module().GGUFValueType.ARRAY:
        return None
    return [field.parts[i].tolist()[0] for i in field.data]


def _tensors(reader: Any) -> dict[str, Any]:
    return {t.name: t for t in reader.tensors}


def gguf_hf_config(reader: Any, where: str) -> dict[str, Any]:
    """The Hugging Face ``config.json`` a GGUF file's metadata stands for (keys transformers reads)."""
    arch = _value(reader, "general.architecture")
    spec, _ = gguf_format_for(str(arch), where)

    def key(name: str, default: Any = None) -> Any:
        return _value(reader, f"{arch}.{name}", default)

    tensors = _tensors(reader)
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise UserError(f"{where}: no token_embd.weight tensor")
    n_heads = key("attention.head_count")
    dim = key("embedding_length")
    cfg: dict[str, Any] = {
        "model_type": spec.hf_model_type,
        "hidden_size": dim,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": key("attention.head_count_kv", n_heads),  # GGUF leaves it out without GQA
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": key("rope.freq_base", 10000.0),  # llama.cpp's default when the key is absent
        "vocab_size": int(embd.shape[-1]),  # GGUF shapes are innermost first: [dim, vocab]
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    missing = [k for k, v in cfg.items() if v is None]
    if missing:
        raise UserError(f"{where}: GGUF metadata lacks {arch}.* for {', '.join(missing)}")
    check_config_bounds(cfg, where)  # before any value is divided by or sized from
    if key("context_length") is not None:
        cfg["max_position_embeddings"] = key("context_length")
    head_dim = key("attention.key_length") or (dim // n_heads)
    cfg["head_dim"] = head_dim
    check_config_bounds(cfg, where)
    if key("attention.value_length", head_dim) != head_dim:
        raise UserError(f"{where}: {arch}.attention.value_length {key('attention.value_length')} differs from "
                        f"key_length {head_dim}; lmforge's attention has one head size")
    rotated = key("rope.dimension_count")
    if rotated is not None and rotated != head_dim:  # let the family refuse partial rotary by its key
        cfg["partial_rotary_factor"] = rotated / head_dim
    if key("expert_count"):  # a mixture of experts: the family refuses it by this key
        cfg["num_local_experts"] = key("expert_count")
    if arch == "gemma3":
        cfg.update(_gemma3_keys(reader, key, cfg, where))
    elif key("attention.sliding_window"):  # Mistral's window; the Qwen families refuse one by this key
        cfg["sliding_window"], cfg["use_sliding_window"] = key("attention.sliding_window"), True
        if arch == "llama":
            cfg["model_type"] = "mistral"
    if "hidden_activation" not in cfg:
        cfg["hidden_act"] = "silu"
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": key("rope.scaling.factor", 1.0)}
        if key("rope.scaling.original_context_length"):
            cfg["rope_scaling"]["original_max_position_embeddings"] = key("rope.scaling.original_context_length")
    elif _ROPE_FREQS in tensors:
        check_config_bounds(cfg, where)
        cfg["rope_scaling"] = _llama3_scaling(_dequantized(tensors[_ROPE_FREQS], where), cfg, where)
    check_config_bounds(cfg, where)
    return cfg


def _layer_ids(tensors: dict[str, Any]) -> set[int]:
    """The block indices the tensors hold (``blk.N.*``)."""
    return {int(n.split(".")[1]) for n in tensors if n.startswith("blk.") and n.split(".")[1].isdigit()}


def _gemma3_keys(reader: Any, key: Callable[..., Any], cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """Gemma 3's own ``config.json`` keys; llama.cpp's built-in values for what the metadata leaves out."""
    n_layers = cfg["num_hidden_layers"]
    pattern_key = "gemma3.attention.sliding_window_pattern"
    flags = _array(reader, pattern_key)
    if flags is not None:  # one flag per layer, true = sliding (llama.cpp's swa_layers)
        if len(flags) != n_layers:
            raise UserError(f"{where}: {pattern_key} has {len(flags)} entries for {n_layers} layers")
        sliding = [bool(f) for f in flags]
    else:  # llama.cpp's set_swa_pattern(n): layer i is global when i % n == n - 1 (n = 0: all sliding)
        n = int(key("attention.sliding_window_pattern", GEMMA3_PATTERN))
        sliding = [n == 0 or i % n < n - 1 for i in range(n_layers)]
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "rope_local_base_freq": key("rope.freq_base_swa", GEMMA3_LOCAL_THETA),
    }
    if key("attention.sliding_window"):
        out["sliding_window"] = key("attention.sliding_window")
    elif any(sliding):
        raise UserError(f"{where}: GGUF metadata lacks gemma3.attention.sliding_window")
    scale = key("attention.scale")
    if scale:  # the softmax scale itself: query_pre_attn_scalar ** -0.5
        out["query_pre_attn_scalar"] = round(float(scale) ** -2, 4)
    elif n_layers == 62:  # llama.cpp's LLM_TYPE_27B: hidden_size / num_heads (gemma_pytorch's config)
        out["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    else:
        out["query_pre_attn_scalar"] = cfg["head_dim"]
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):  # Gemma 2's; the family refuses them
        if key(cap):
            out[cap] = key(cap)
    return out


def _llama3_scaling(divisors: Tensor, cfg: dict[str, Any], where: str) -> dict[str, Any]:
    """Llama 3.1's ``rope_scaling`` from llama.cpp's per-frequency divisors: the settings every Llama
    3.x release uses, accepted only when they reproduce the stored divisors."""
    from lmforge.models.layers.rope import rope_frequencies

    scaling = {"rope_type": "llama3", "factor": float(divisors.max()), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    probe = args_from_hf_config({**cfg, "rope_scaling": None}, where)
    plain = rope_frequencies(probe.decoder_config().ropes["global"], "cpu")[0]
    scaled = rope_frequencies(dataclasses.replace(probe, rope_scaling=scaling).decoder_config().ropes["global"], "cpu")[0]
    if divisors.shape != plain.shape or not torch.allclose(scaled, plain / divisors, rtol=1e-5):
        raise UserError(f"{where}: {_ROPE_FREQS} holds RoPE scaling other than Llama 3's; not supported")
    return scaling


def _dequantized(tensor: Any, where: str) -> Tensor:
    """One tensor as fp32, in torch's shape order (GGUF lists dimensions innermost first)."""
    from gguf.quants import dequantize

    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise UserError(f"{where}: tensor {tensor.name} has type {tensor.tensor_type.name}, which the gguf "
                        f"package cannot dequantize") from None
    shape = tuple(reversed([int(n) for n in tensor.shape]))
    # f32 tensors come back as views of the read-only mapped file: copy those only.
    return torch.from_numpy(values.astype("float32", copy=not values.flags.writeable)).reshape(shape)


def _unpermute(w: Tensor, heads: int) -> Tensor:
    """Undo ``LlamaModel.permute`` of llama.cpp's converter: within each head it interleaved the two
    halves of the rows (``reshape(heads, 2, hd/2, ...).swapaxes(1, 2)``); the inverse swaps back."""
    rows = w.shape[0]
    if rows % (2 * heads):
        raise UserError(f"{rows} rows do not split into {heads} heads of even size")
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_name(name: str, where: str, layer_names: Mapping[str, str]) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if (len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names
            and parts[3] in ("weight", "bias")):
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    raise UserError(f"{where}: unexpected tensor {name!r} in the GGUF file (a feature lmforge lacks?)")


def hf_state_dict_from_gguf(reader: Any, cfg: dict[str, Any], where: str) -> dict[str, Tensor]:
    """Every tensor, dequantized to fp32, unpermuted and unshifted, under its Hugging Face name."""
    _, fmt = gguf_format_for(str(_value(reader, "general.architecture")), where)
    permuted, shifted, layer_names = fmt.permuted_qk, fmt.norm_shifted, fmt.layer_names
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    out: dict[str, Tensor] = {}
    for name, tensor in _tensors(reader).items():
        if name == _ROPE_FREQS:  # read into cfg's rope_scaling; lmforge recomputes RoPE
            continue
        hf = _hf_name(name, where, layer_names)
        w = _dequantized(tensor, where)
        if shifted and name.endswith("norm.weight"):
            w = w - 1.0
        part = name.split(".")[2] if name.startswith("blk.") else ""
        if permuted and part in heads:
            try:
                w = _unpermute(w, heads[part])
            except UserError as e:
                raise UserError(f"{where}: {name}: {e}") from None
        out[hf] = w
    return out


def gguf_args(path: str | Path) -> ModelArgs:
    """The ``ModelArgs`` of a GGUF file (its metadata read as a Hugging Face config)."""
    where = str(Path(path).expanduser())
    return args_from_hf_config(gguf_hf_config(open_gguf(path), where), where)


def load_gguf_model(path: str | Path, dtype: torch.dtype = torch.float32) -> Transformer:
    """Load a GGUF file into a CPU model of ``dtype``, every tensor dequantized (see the module doc).

    Built like :func:`lmforge.models.hf.load_hf_model` (:func:`~lmforge.models.hf.model_from_hf_state`).
    """
    where = str(Path(path).expanduser())
    reader = open_gguf(path)
    cfg = gguf_hf_config(reader, where)
    tensors = _tensors(reader)
    check_against_tensors(cfg, tuple(int(n) for n in tensors["token_embd.weight"].shape), _layer_ids(tensors), where)
    args = args_from_hf_config(cfg, where)
    return model_from_hf_state(hf_state_dict_from_gguf(reader, cfg, where), args, dtype,
                               f"{where}: tensors do not match the GGUF metadata")
