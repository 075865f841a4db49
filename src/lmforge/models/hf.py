"""Read and write Hugging Face checkpoint directories (config.json + safetensors).

Every family-specific step goes through the family's :class:`~lmforge.models.spec.ModelSpec`:
``lmforge.models.hf_config`` maps config.json to ``ModelArgs`` and back, the spec's
``state_dict_adapter`` renames the tensors (a pure renaming: lmforge's RoPE uses Hugging Face's
``rotate_half`` layout, so no q/k permutation in either direction) and its ``build`` makes the
model. Built-in families: Llama (incl. SmolLM2), Qwen2/2.5, Qwen3 and Mistral. Everything works
offline on local directories.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from lmforge.errors import UserError
from lmforge.models.args import ModelArgs
from lmforge.models.common.llama_style import LLAMA_LAYOUT
from lmforge.models.hf_config import args_from_hf_config, check_exportable, hf_config_from_args
from lmforge.models.model import Transformer
from lmforge.models.spec import spec_for_args


def hf_module_name(name: str, args: ModelArgs | None = None) -> str:
    """The Hugging Face name of a projection inside a layer: ``layers.3.attention.wq`` ->
    ``model.layers.3.self_attn.q_proj`` (wrapper prefixes such as torch.compile's are dropped).

    Without ``args`` the names of the Llama layout, which every built-in family shares, are used.
    """
    adapter = LLAMA_LAYOUT if args is None else spec_for_args(args).state_dict_adapter
    return adapter.hf_module_name(name)


def hf_state_dict_from_lmforge(model_state: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """Rename an lmforge state dict to the Hugging Face ``*ForCausalLM`` names of ``args``' family.

    With tied embeddings ``lm_head.weight`` is omitted, as ``save_pretrained`` does.
    """
    return spec_for_args(args).state_dict_adapter.to_hf(model_state, args)


def lmforge_state_dict_from_hf(hf_state: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """Rename a Hugging Face state dict of ``args``' family to lmforge names.

    When the model ties embeddings, ``output.weight`` is the embedding tensor itself.
    Buffers HF may store (``rotary_emb.inv_freq``) are ignored: lmforge recomputes RoPE.
    """
    return spec_for_args(args).state_dict_adapter.from_hf(hf_state, args)


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
    """Load a Hugging Face model directory into a CPU model of ``dtype`` (its spec's ``build``).

    The module is built on the meta device and the checkpoint tensors assigned directly,
    so no time or memory is spent on a random init that would be overwritten.
    """
    model_dir = Path(model_dir)
    args = load_hf_config(model_dir)
    hf_state = _read_hf_tensors(model_dir)
    score = hf_state.pop("score.weight", None)  # a *ForSequenceClassification directory: a reward model
    if score is not None and score.shape != (1, args.dim):
        raise UserError(f"{model_dir}: score.weight has shape {list(score.shape)}; lmforge reads reward models "
                        f"with one score (num_labels 1, [1, {args.dim}])")
    if score is not None and not args.tie_embeddings:  # it has no vocabulary layer: an unused, frozen stand-in
        hf_state.setdefault("lm_head.weight", torch.zeros(args.vocab_size, args.dim, dtype=score.dtype))
    model = model_from_hf_state(hf_state, args, dtype, f"{model_dir}: weights do not match config.json")
    if score is not None:
        from lmforge.models.heads import attach_head

        with torch.no_grad():
            attach_head(model, "score").weight.copy_(score)
    return model


def model_from_hf_state(hf_state: dict[str, Tensor], args: ModelArgs, dtype: torch.dtype, mismatch: str) -> Transformer:
    """The CPU model of ``args`` holding ``hf_state`` (Hugging Face names) in ``dtype``.

    Built on the meta device with the tensors assigned directly, so no time or memory goes to a random
    init that would be overwritten. ``mismatch`` starts the error when the tensors do not fit ``args``.
    """
    spec = spec_for_args(args)
    state = spec.state_dict_adapter.from_hf(hf_state, args)
    state = {k: v.to(dtype) for k, v in state.items()}
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    with torch.device("meta"):
        model = spec.build(args)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise UserError(f"{mismatch}: {' '.join(first[:3])}") from None
    model.tie_weights()
    model.rebuild_rope("cpu")  # every RoPE table (Gemma 3's local one too)
    return model


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def savable_tensors(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` as safetensors accepts it: on the CPU, contiguous, no two tensors sharing storage (a tied
    pair). Copies only where needed, so a large model is not duplicated in memory."""
    tensors: dict[str, Tensor] = {}
    seen: set[int] = set()
    for k, v in state.items():
        v = v.detach().to("cpu").contiguous()
        if v.untyped_storage().data_ptr() in seen:
            v = v.clone()
        seen.add(v.untyped_storage().data_ptr())
        tensors[k] = v
    return tensors


def save_hf_model(
    model_state: dict[str, Tensor], args: ModelArgs, out_dir: str | Path, *,
    bos_token_id: int | None = None, eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
    score: Tensor | None = None,
) -> None:
    """Write ``config.json``, ``model.safetensors`` and ``generation_config.json``.

    The config names ``args.hf_model_type`` and its class, so ``AutoModelForCausalLM`` rebuilds
    the same family. ``eos_token_id`` may be a list (several stop tokens) and is written as one.
    ``score`` ([1, dim]) writes a reward model instead: the family's ``*ForSequenceClassification``
    with ``score.weight`` and one label, and no vocabulary layer (a reward model never uses it).
    """
    check_exportable(args)  # refuse before writing anything
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = hf_state_dict_from_lmforge(model_state, args)
    if score is not None:
        hf.pop("lm_head.weight", None)
        hf["score.weight"] = score
    tensors = savable_tensors(hf)
    embedding = next(k for k in tensors if k.endswith("embed_tokens.weight"))  # model.language_model.* in a VLM
    dtype = tensors[embedding].dtype
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    config = hf_config_from_args(args, torch_dtype=_dtype_name(dtype), bos_token_id=bos_token_id,
                                 eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    if score is not None:  # pad_token_id (set by the caller) is how transformers finds each row's last token
        config["architectures"] = [config["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")]
        config |= {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {"_from_model_config": True}
    for key, val in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
        if val is not None:
            gen[key] = val
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
