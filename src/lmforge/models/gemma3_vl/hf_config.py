"""Gemma 3 multimodal ``config.json`` both ways: the text decoder's keys in ``text_config`` (read and
written as the ``gemma3_text`` family reads and writes them), the SigLIP tower's in ``vision_config``,
the projector's ``mm_tokens_per_image`` and the special tokens at the top. Refused in one line: a tower
activation other than tanh-GELU, a tower whose pooling head is used, and what the text family refuses."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Mapping

from lmforge.errors import UserError
from lmforge.models.args import ModelArgs
from lmforge.models.gemma3 import GEMMA3_CONFIG
from lmforge.models.gemma3_vl.args import Gemma3VLArgs

__all__ = ["ARCHITECTURE", "MODEL_TYPE", "args_from_hf", "check_exportable", "hf_config"]

MODEL_TYPE = "gemma3"
ARCHITECTURE = "Gemma3ForConditionalGeneration"
VISION_DEFAULTS = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
                   "num_channels": 3, "image_size": 896, "patch_size": 14, "layer_norm_eps": 1e-6,
                   "hidden_act": "gelu_pytorch_tanh"}
TOKENS = {"image_token_index": ("image_token_id", 262144), "boi_token_index": ("boi_token_id", 255999),
          "eoi_token_index": ("eoi_token_id", 256000)}


def args_from_hf(cfg: Mapping[str, Any], where: str) -> Gemma3VLArgs:
    """``Gemma3VLArgs`` of a parsed config.json; ``where`` names the file in errors."""
    if cfg.get("model_type") != MODEL_TYPE:
        raise UserError(f"{where}: model_type {cfg.get('model_type')!r} is not {MODEL_TYPE!r}")
    if not isinstance(cfg.get("text_config"), Mapping):
        raise UserError(f"{where}: model_type {MODEL_TYPE!r} needs a text_config (the language model's settings)")
    vision = {**VISION_DEFAULTS, **(cfg.get("vision_config") or {})}
    if vision["hidden_act"] != "gelu_pytorch_tanh":
        raise UserError(f"{where}: vision_config.hidden_act {vision['hidden_act']!r} is not supported "
                        "(need gelu_pytorch_tanh)")
    text = GEMMA3_CONFIG.args_from_hf({**(cfg.get("text_config") or {}), "model_type": "gemma3_text",
                                       "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}, where)
    try:
        return Gemma3VLArgs(
            **{**asdict(text), "hf_model_type": MODEL_TYPE}, vision_depth=int(vision["num_hidden_layers"]),
            vision_dim=int(vision["hidden_size"]), vision_ffn_dim=int(vision["intermediate_size"]),
            vision_heads=int(vision["num_attention_heads"]), vision_in_channels=int(vision["num_channels"]),
            image_size=int(vision["image_size"]), patch_size=int(vision["patch_size"]),
            vision_norm_eps=float(vision["layer_norm_eps"]),
            mm_tokens_per_image=int(cfg.get("mm_tokens_per_image", 256)),
            **{field: int(cfg.get(key, default)) for key, (field, default) in TOKENS.items()},
        )
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


def check_exportable(args: ModelArgs) -> None:
    """UserError unless ``args`` are Gemma 3's with a vision tower."""
    if not isinstance(args, Gemma3VLArgs):
        raise UserError(f"cannot export as Hugging Face model_type {MODEL_TYPE!r}: the model has no vision tower")
    GEMMA3_CONFIG.check_exportable(args)


def hf_config(args: ModelArgs, *, torch_dtype: str, bos_token_id: int | None = None,
              eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None) -> dict[str, Any]:
    """The config.json transformers builds ``args`` from."""
    check_exportable(args)
    assert isinstance(args, Gemma3VLArgs)
    text = GEMMA3_CONFIG.hf_config(args, torch_dtype=torch_dtype, bos_token_id=bos_token_id,
                                   eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    text.pop("architectures")
    vision = {
        "model_type": "siglip_vision_model", "hidden_size": args.vision_dim, "intermediate_size": args.vision_ffn_dim,
        "num_hidden_layers": args.vision_depth, "num_attention_heads": args.vision_heads,
        "num_channels": args.vision_in_channels, "image_size": args.image_size, "patch_size": args.patch_size,
        "layer_norm_eps": args.vision_norm_eps, "hidden_act": "gelu_pytorch_tanh", "vision_use_head": False,
        "attention_dropout": 0.0, "dtype": torch_dtype,
    }
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "text_config": text, "vision_config": vision,
        "mm_tokens_per_image": args.mm_tokens_per_image, "tie_word_embeddings": args.tie_embeddings,
        **{key: getattr(args, field) for key, (field, _) in TOKENS.items()}, "dtype": torch_dtype,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id,
    }
