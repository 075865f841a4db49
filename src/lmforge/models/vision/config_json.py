"""What the config.json files of Qwen's vision-language families share: the multimodal RoPE settings
(``rope_parameters`` now, ``rope_scaling`` ``{"type": "mrope", ...}`` in older files), the special
token ids, the decoder's and the tower's common keys both ways, and the nested layout written out.
Each family's ``hf_config`` module adds only what its own config has (Qwen2.5-VL's windows, Qwen3-VL's
position table and DeepStack layers) and what it refuses."""

from __future__ import annotations

from typing import Any, Mapping

from lmforge.errors import UserError
from lmforge.models.args import ModelArgs

__all__ = ["TOKEN_IDS", "mrope_settings", "token_ids", "decoder_fields", "tower_fields", "tower_config",
           "vision_language_config", "check_vision_language_export"]

TOKEN_IDS = {"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
             "vision_end_token_id": 151653}
"""The special tokens' config.json keys and transformers' defaults (the same for every Qwen-VL)."""


def mrope_settings(text: Mapping[str, Any], where: str, family: str, default_theta: float,
                   default_sections: list[int]) -> tuple[float, list[int]]:
    """(rope_theta, mrope_section) of a language model's config section; one line for any scaling."""
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise UserError(f"{where}: rope type {kind!r} is not supported for {family} (only mrope)")
    theta = float(rope.get("rope_theta", text.get("rope_theta", default_theta)))
    return theta, [int(n) for n in rope.get("mrope_section", default_sections)]


def token_ids(cfg: Mapping[str, Any]) -> dict[str, int]:
    """The special token ids of a config.json (transformers' defaults for missing ones)."""
    return {k: int(cfg.get(k, v)) for k, v in TOKEN_IDS.items()}


def decoder_fields(cfg: Mapping[str, Any], text: Mapping[str, Any], vision: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's ``ModelArgs`` fields every Qwen-VL config.json gives the same way
    (``KeyError`` for a missing one; the caller says where). The tower's merger must project to the
    language model's width: lmforge has no other projection."""
    dim = int(text["hidden_size"])
    if int(vision.get("out_hidden_size", dim)) != dim:
        raise UserError(f"vision_config.out_hidden_size {vision['out_hidden_size']} must equal hidden_size {dim}")
    n_heads = int(text["num_attention_heads"])
    return dict(dim=dim, n_layers=int(text["num_hidden_layers"]), n_heads=n_heads,
                n_kv_heads=int(text.get("num_key_value_heads") or n_heads), vocab_size=int(text["vocab_size"]),
                ffn_hidden_dim=int(text["intermediate_size"]),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))))


def tower_fields(vision: Mapping[str, Any]) -> dict[str, Any]:
    """The vision tower's argument fields every Qwen-VL ``vision_config`` gives the same way (``KeyError``
    for a missing one)."""
    return dict(vision_depth=int(vision["depth"]), vision_dim=int(vision["hidden_size"]),
                vision_ffn_dim=int(vision["intermediate_size"]), vision_heads=int(vision["num_heads"]),
                vision_in_channels=int(vision["in_channels"]), patch_size=int(vision["patch_size"]),
                temporal_patch_size=int(vision["temporal_patch_size"]),
                spatial_merge_size=int(vision["spatial_merge_size"]),
                vision_rope_theta=float((vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)))


def tower_config(args: Any, torch_dtype: str) -> dict[str, Any]:
    """The ``vision_config`` keys of :func:`tower_fields`, written from a Qwen-VL's arguments."""
    return {"depth": args.vision_depth, "hidden_size": args.vision_dim, "intermediate_size": args.vision_ffn_dim,
            "num_heads": args.vision_heads, "in_channels": args.vision_in_channels, "patch_size": args.patch_size,
            "temporal_patch_size": args.temporal_patch_size, "spatial_merge_size": args.spatial_merge_size,
            "out_hidden_size": args.dim,
            "rope_parameters": {"rope_type": "axial", "rope_theta": args.vision_rope_theta},
            "initializer_range": 0.02, "dtype": torch_dtype}


def vision_language_config(args: ModelArgs, architecture: str, model_type: str, text: dict[str, Any],
                           vision: dict[str, Any], torch_dtype: str, bos_token_id: int | None,
                           eos_token_id: int | list[int] | None, pad_token_id: int | None) -> dict[str, Any]:
    """The whole config.json in transformers' nested layout: the family's ``text_config`` and
    ``vision_config`` with the special tokens and the top-level keys every Qwen-VL writes."""
    return {
        "architectures": [architecture], "model_type": model_type, "text_config": text, "vision_config": vision,
        **{k: getattr(args, k) for k in TOKEN_IDS},
        "tie_word_embeddings": args.tie_embeddings, "dtype": torch_dtype,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id,
    }


def check_vision_language_export(args: ModelArgs, args_class: type, model_type: str,
                                 own: tuple[tuple[str, bool], ...]) -> None:
    """UserError unless ``args`` are of the family's ``args_class`` (a model with its tower) and have none
    of the decoder switches a Qwen-VL config.json cannot say: ``own`` are the family's own (name, present)
    besides those every Qwen-VL shares."""
    if not isinstance(args, args_class):
        raise UserError(f"cannot export as Hugging Face model_type {model_type!r}: the model has no vision tower")
    problems = [name for name, bad in (
        ("sliding_window", args.sliding_window is not None), ("rope_scaling", args.rope_scaling is not None),
        ("n_experts", args.n_experts > 0), ("hidden_act", args.hidden_act != "silu"), *own,
        ("Gemma's norms", args.norm_unit_offset or args.embed_scale or args.sandwich_norm),
    ) if bad]
    if problems:
        raise UserError(f"cannot export as Hugging Face model_type {model_type!r}: it cannot have "
                        f"{', '.join(problems)}")
