"""Read and write Hugging Face checkpoint directories (config.json + safetensors).

Families: Llama (incl. SmolLM2), Qwen2/2.5, Qwen3 and Mistral; ``lmforge.models.hf_config``
maps their config.json to ``ModelArgs`` and back. lmforge's RoPE uses the same
``rotate_half`` layout as Hugging Face, so the conversion is a pure renaming of tensors:
no q/k permutation is needed in either direction. Everything works offline on local
directories.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from lmforge.errors import UserError
from lmforge.models.hf_config import args_from_hf_config, check_exportable, hf_config_from_args
from lmforge.models.model import ModelArgs, Transformer

# lmforge per-layer suffix -> Hugging Face per-layer suffix
_LAYER_MAP = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GLOBAL_MAP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_LAYER_MAP = {v: k for k, v in _LAYER_MAP.items()}
_HF_GLOBAL_MAP = {v: k for k, v in _GLOBAL_MAP.items()}
_LF_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Wrappers that prefix parameter names (torch.compile, DDP).
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def _strip_wrappers(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for p in _WRAPPER_PREFIXES:
            if name.startswith(p):
                name, changed = name[len(p):], True
    return name.replace("._orig_mod.", ".")


def hf_module_name(name: str) -> str:
    """The Hugging Face name of a projection inside a layer: ``layers.3.attention.wq`` ->
    ``model.layers.3.self_attn.q_proj`` (wrapper prefixes such as torch.compile's are dropped)."""
    m = _LF_LAYER.fullmatch(_strip_wrappers(name))
    suffix = _LAYER_MAP.get(f"{m.group(2)}.weight") if m else None
    if m is None or suffix is None:
        raise ValueError(f"no Hugging Face name for lmforge module {name!r}")
    return f"model.layers.{m.group(1)}.{suffix.removesuffix('.weight')}"


def hf_state_dict_from_lmforge(model_state: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """Rename an lmforge state dict to Hugging Face ``*ForCausalLM`` names (shared by all families).

    With tied embeddings ``lm_head.weight`` is omitted, as ``save_pretrained`` does.
    """
    out: dict[str, Tensor] = {}
    for raw, t in model_state.items():
        name = _strip_wrappers(raw)
        if name in _GLOBAL_MAP:
            if name == "output.weight" and args.tie_embeddings:
                continue
            out[_GLOBAL_MAP[name]] = t
            continue
        m = _LF_LAYER.fullmatch(name)
        if m is None or m.group(2) not in _LAYER_MAP:
            raise ValueError(f"unexpected lmforge parameter {raw!r}")
        out[f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"] = t
    return out


def lmforge_state_dict_from_hf(hf_state: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """Rename a Hugging Face state dict (any supported family) to lmforge names.

    When the model ties embeddings, ``output.weight`` is the embedding tensor itself.
    Buffers HF may store (``rotary_emb.inv_freq``) are ignored: lmforge recomputes RoPE.
    """
    out: dict[str, Tensor] = {}
    for name, t in hf_state.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name in _HF_GLOBAL_MAP:
            out[_HF_GLOBAL_MAP[name]] = t
            continue
        m = _HF_LAYER.fullmatch(name)
        if m is None or m.group(2) not in _HF_LAYER_MAP:
            raise UserError(f"unexpected tensor {name!r} in Hugging Face checkpoint (a feature lmforge lacks?)")
        out[f"layers.{m.group(1)}.{_HF_LAYER_MAP[m.group(2)]}"] = t
    if args.tie_embeddings:
        if "tok_embeddings.weight" not in out:
            raise UserError("Hugging Face checkpoint has no model.embed_tokens.weight")
        out["output.weight"] = out["tok_embeddings.weight"]
    elif "output.weight" not in out:
        raise UserError("checkpoint has no lm_head.weight but config says tie_word_embeddings=false")
    return out


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path} not found: not a Hugging Face model directory") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None


def load_hf_config(model_dir: str | Path) -> ModelArgs:
    """``ModelArgs`` from a ``config.json``; UserError for anything lmforge cannot run exactly."""
    path = Path(model_dir) / "config.json"
    return args_from_hf_config(_read_json(path), path)


def _read_hf_tensors(model_dir: Path) -> dict[str, Tensor]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise UserError(f"{index}: no 'weight_map' object")
        files = sorted(set(map(str, weight_map.values())))
    elif (model_dir / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"no *.safetensors weights in {model_dir}")
    state: dict[str, Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(model_dir / f)))
        except FileNotFoundError:
            raise UserError(f"{model_dir / f}: missing (listed in the weight index)") from None
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for damaged files
            text = str(e).strip().splitlines()
            raise UserError(f"{model_dir / f}: not a readable safetensors file "
                            f"({text[-1] if text else type(e).__name__})") from None
    return state


def load_hf_model(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> Transformer:
    """Load a Hugging Face model directory into a CPU ``Transformer`` of ``dtype``.

    The module is built on the meta device and the checkpoint tensors assigned directly,
    so no time or memory is spent on a random init that would be overwritten.
    """
    model_dir = Path(model_dir)
    args = load_hf_config(model_dir)
    state = lmforge_state_dict_from_hf(_read_hf_tensors(model_dir), args)
    state = {k: v.to(dtype) for k, v in state.items()}
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    with torch.device("meta"):
        model = Transformer(args)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise UserError(f"{model_dir}: weights do not match config.json: {e}") from None
    model.tie_weights()
    model.rope.rebuild("cpu")
    return model


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def save_hf_model(
    model_state: dict[str, Tensor], args: ModelArgs, out_dir: str | Path, *,
    bos_token_id: int | None = None, eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
) -> None:
    """Write ``config.json``, ``model.safetensors`` and ``generation_config.json``.

    The config names ``args.hf_model_type`` and its class, so ``AutoModelForCausalLM`` rebuilds
    the same family. ``eos_token_id`` may be a list (several stop tokens) and is written as one.
    """
    check_exportable(args)  # refuse before writing anything
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = hf_state_dict_from_lmforge(model_state, args)
    # safetensors refuses aliased or non-contiguous storage: copy only where needed so a
    # large model is not duplicated in memory.
    tensors: dict[str, Tensor] = {}
    seen: set[int] = set()
    for k, v in hf.items():
        v = v.detach().to("cpu").contiguous()
        if v.untyped_storage().data_ptr() in seen:
            v = v.clone()
        seen.add(v.untyped_storage().data_ptr())
        tensors[k] = v
    dtype = tensors["model.embed_tokens.weight"].dtype
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    config = hf_config_from_args(args, torch_dtype=_dtype_name(dtype), bos_token_id=bos_token_id,
                                 eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"_from_model_config": True}
    for key, val in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
        if val is not None:
            gen[key] = val
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
