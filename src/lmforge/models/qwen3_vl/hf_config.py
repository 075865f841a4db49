"""Qwen3-VL's ``config.json`` both ways (the language model's keys in ``text_config``, the tower's in
``vision_config``). Missing keys take transformers' defaults; what lmforge cannot reproduce (attention
biases, another activation, a RoPE scaling besides mrope, a merger width other than the language
model's) is refused in one line naming the file and the key.
"""

from __future__ import annotations

from typing import Any, Mapping

from lmforge.errors import UserError
from lmforge.models.args import ModelArgs
from lmforge.models.qwen3_vl.args import Qwen3VLArgs
from lmforge.models.vision.config_json import (check_vision_language_export, decoder_fields, mrope_settings,
                                               token_ids, tower_config, tower_fields, vision_language_config)

__all__ = ["ARCHITECTURE", "MODEL_TYPE", "args_from_hf", "check_exportable", "hf_config"]

MODEL_TYPE = "qwen3_vl"
ARCHITECTURE = "Qwen3VLForConditionalGeneration"
VISION_DEFAULTS = {"depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 4304,
                   "num_heads": 16, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
                   "temporal_patch_size": 2, "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24]}


def args_from_hf(cfg: Mapping[str, Any], where: str) -> Qwen3VLArgs:
    """``Qwen3VLArgs`` of a parsed config.json; ``where`` names the file in errors."""
    if cfg.get("model_type") != MODEL_TYPE:
        raise UserError(f"{where}: model_type {cfg.get('model_type')!r} is not {MODEL_TYPE!r}")
    text = cfg.get("text_config") or {}
    vision = {**VISION_DEFAULTS, **(cfg.get("vision_config") or {})}
    if text.get("attention_bias"):
        raise UserError(f"{where}: text_config.attention_bias=true is not supported for model_type {MODEL_TYPE!r}")
    for key, section, need in (("hidden_act", text, "silu"), ("vision_config.hidden_act", vision, "gelu_pytorch_tanh")):
        act = section.get(key.rpartition(".")[2], need)
        if act != need:
            raise UserError(f"{where}: {key} {act!r} is not supported for model_type {MODEL_TYPE!r} (need {need})")
    theta, sections = mrope_settings(text, where, MODEL_TYPE, 500000.0, [24, 20, 20])
    try:
        return Qwen3VLArgs(
            **decoder_fields(cfg, text, vision), head_dim=int(text.get("head_dim", 128)),
            norm_eps=float(text.get("rms_norm_eps", 1e-6)), rope_theta=theta,
            max_seq_len=int(text.get("max_position_embeddings", 128000)), mrope_section=sections,
            **tower_fields(vision), vision_positions=int(vision["num_position_embeddings"]),
            deepstack_layers=list(vision["deepstack_visual_indexes"]), **token_ids(cfg),
        )
    except KeyError as e:
        raise UserError(f"{where}: missing field text_config.{e.args[0]}") from None
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


def check_exportable(args: ModelArgs) -> None:
    """UserError unless ``args`` are Qwen3-VL's (its own argument class, Qwen3's decoder switches)."""
    check_vision_language_export(args, Qwen3VLArgs, MODEL_TYPE, (
        ("qkv_bias", args.qkv_bias), ("qk_norm_per_head=false", not args.qk_norm_per_head)))


def hf_config(args: ModelArgs, *, torch_dtype: str, bos_token_id: int | None = None,
              eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None) -> dict[str, Any]:
    """The config.json transformers builds ``args`` from."""
    check_exportable(args)
    assert isinstance(args, Qwen3VLArgs)
    rope = {"rope_type": "default", "rope_theta": args.rope_theta, "mrope_section": list(args.mrope_section),
            "mrope_interleaved": True}
    text = {
        "model_type": "qwen3_vl_text", "hidden_size": args.dim, "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim, "vocab_size": args.vocab_size, "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "initializer_range": 0.02, "use_cache": True, "rope_parameters": rope,
        "tie_word_embeddings": args.tie_embeddings, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id, "dtype": torch_dtype,
    }
    vision = {
        "model_type": "qwen3_vl_vision", **tower_config(args, torch_dtype), "hidden_act": "gelu_pytorch_tanh",
        "num_position_embeddings": args.vision_positions, "deepstack_visual_indexes": list(args.deepstack_layers),
    }
    return vision_language_config(args, ARCHITECTURE, MODEL_TYPE, text, vision, torch_dtype, bos_token_id,
                                  eos_token_id, pad_token_id)
