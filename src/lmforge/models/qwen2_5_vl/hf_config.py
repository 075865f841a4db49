"""Qwen2.5-VL's ``config.json`` both ways.

Reads both layouts: transformers' current one (the language model's keys in ``text_config``) and the
one the models were published in (the language model's keys at the top level, ``rope_scaling``
``{"type": "mrope", "mrope_section": ...}``). Missing keys take transformers' defaults; what lmforge
cannot reproduce (a sliding window, another activation, a RoPE scaling besides mrope, a merger width other
than the language model's) is refused in one line naming the file and the key. Writes the current layout.
"""

from __future__ import annotations

from typing import Any, Mapping

from lmforge.errors import UserError
from lmforge.models.args import ModelArgs
from lmforge.models.qwen2_5_vl.args import Qwen2_5_VLArgs
from lmforge.models.vision.config_json import mrope_settings, token_ids

__all__ = ["ARCHITECTURE", "MODEL_TYPE", "args_from_hf", "check_exportable", "hf_config"]

MODEL_TYPE = "qwen2_5_vl"
ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
VISION_DEFAULTS = {"depth": 32, "hidden_size": 3584, "intermediate_size": 3420, "num_heads": 16, "in_channels": 3,
                   "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "tokens_per_second": 4,
                   "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]}


def args_from_hf(cfg: Mapping[str, Any], where: str) -> Qwen2_5_VLArgs:
    """``Qwen2_5_VLArgs`` of a parsed config.json; ``where`` names the file in errors."""
    if cfg.get("model_type") != MODEL_TYPE:
        raise UserError(f"{where}: model_type {cfg.get('model_type')!r} is not {MODEL_TYPE!r}")
    text = cfg.get("text_config") or cfg
    vision = {**VISION_DEFAULTS, **(cfg.get("vision_config") or {})}
    if text.get("use_sliding_window"):
        raise UserError(f"{where}: use_sliding_window=true is not supported for model_type {MODEL_TYPE!r}")
    for key, section in (("hidden_act", text), ("vision_config.hidden_act", vision)):
        act = section.get(key.rpartition(".")[2], "silu")
        if act != "silu":
            raise UserError(f"{where}: {key} {act!r} is not supported for model_type {MODEL_TYPE!r} (need silu)")
    theta, sections = mrope_settings(text, where, MODEL_TYPE, 1000000.0, [16, 24, 24])
    vision_theta = float((vision.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    try:
        dim = int(text["hidden_size"])
        if int(vision.get("out_hidden_size", dim)) != dim:
            raise UserError(f"vision_config.out_hidden_size {vision['out_hidden_size']} must equal hidden_size {dim}")
        n_heads = int(text["num_attention_heads"])
        tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        return Qwen2_5_VLArgs(
            dim=dim, n_layers=int(text["num_hidden_layers"]), n_heads=n_heads,
            n_kv_heads=int(text.get("num_key_value_heads") or n_heads), vocab_size=int(text["vocab_size"]),
            ffn_hidden_dim=int(text["intermediate_size"]), norm_eps=float(text.get("rms_norm_eps", 1e-5)),
            rope_theta=theta, max_seq_len=int(text.get("max_position_embeddings", 32768)), tie_embeddings=bool(tie),
            mrope_section=sections, vision_depth=int(vision["depth"]), vision_dim=int(vision["hidden_size"]),
            vision_ffn_dim=int(vision["intermediate_size"]), vision_heads=int(vision["num_heads"]),
            vision_in_channels=int(vision["in_channels"]), patch_size=int(vision["patch_size"]),
            temporal_patch_size=int(vision["temporal_patch_size"]),
            spatial_merge_size=int(vision["spatial_merge_size"]),
            window_size=int(vision["window_size"]),
            vision_full_attention_layers=[  # transformers never reaches indices past the depth
                int(i) for i in vision["fullatt_block_indexes"] if int(i) < int(vision["depth"])],
            vision_rope_theta=vision_theta, tokens_per_second=int(vision["tokens_per_second"]),
            **token_ids(cfg),
        )
    except KeyError as e:
        raise UserError(f"{where}: missing field {e.args[0]!r}") from None
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


def check_exportable(args: ModelArgs) -> None:
    """UserError unless ``args`` are Qwen2.5-VL's (its own argument class, Qwen2's decoder switches)."""
    if not isinstance(args, Qwen2_5_VLArgs):
        raise UserError(f"cannot export as Hugging Face model_type {MODEL_TYPE!r}: the model has no vision tower")
    problems = [name for name, bad in (
        ("sliding_window", args.sliding_window is not None), ("qk_norm", args.qk_norm),
        ("rope_scaling", args.rope_scaling is not None), ("n_experts", args.n_experts > 0),
        ("hidden_act", args.hidden_act != "silu"), ("head_dim", args.head_dim * args.n_heads != args.dim),
        ("Gemma's norms", args.norm_unit_offset or args.embed_scale or args.sandwich_norm),
    ) if bad]
    if problems:
        raise UserError(f"cannot export as Hugging Face model_type {MODEL_TYPE!r}: it cannot have "
                        f"{', '.join(problems)}")


def hf_config(args: ModelArgs, *, torch_dtype: str, bos_token_id: int | None = None,
              eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None) -> dict[str, Any]:
    """The config.json transformers builds ``args`` from, in its current (nested) layout."""
    check_exportable(args)
    assert isinstance(args, Qwen2_5_VLArgs)
    text = {
        "model_type": "qwen2_5_vl_text", "hidden_size": args.dim, "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads, "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps, "hidden_act": "silu", "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": args.n_layers, "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta,
                            "mrope_section": list(args.mrope_section)},
        "tie_word_embeddings": args.tie_embeddings, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id, "dtype": torch_dtype,
    }
    vision = {
        "model_type": "qwen2_5_vl_vision", "depth": args.vision_depth, "hidden_size": args.vision_dim,
        "intermediate_size": args.vision_ffn_dim, "num_heads": args.vision_heads,
        "in_channels": args.vision_in_channels,
        "patch_size": args.patch_size, "temporal_patch_size": args.temporal_patch_size,
        "spatial_merge_size": args.spatial_merge_size, "window_size": args.window_size, "out_hidden_size": args.dim,
        "fullatt_block_indexes": list(args.vision_full_attention_layers), "tokens_per_second": args.tokens_per_second,
        "hidden_act": "silu", "rope_parameters": {"rope_type": "axial", "rope_theta": args.vision_rope_theta},
        "initializer_range": 0.02, "dtype": torch_dtype,
    }
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "text_config": text, "vision_config": vision,
        "image_token_id": args.image_token_id, "video_token_id": args.video_token_id,
        "vision_start_token_id": args.vision_start_token_id, "vision_end_token_id": args.vision_end_token_id,
        "tie_word_embeddings": args.tie_embeddings, "dtype": torch_dtype,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id,
    }
