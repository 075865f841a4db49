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
from lmforge.models.vision.config_json import (check_vision_language_export, decoder_fields, mrope_settings,
                                               token_ids, tower_config, tower_fields, vision_language_config)

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
    try:
        return Qwen2_5_VLArgs(
            **decoder_fields(cfg, text, vision), norm_eps=float(text.get("rms_norm_eps", 1e-5)), rope_theta=theta,
            max_seq_len=int(text.get("max_position_embeddings", 32768)), mrope_section=sections,
            **tower_fields(vision), window_size=int(vision["window_size"]),
            vision_full_attention_layers=[  # transformers never reaches indices past the depth
                int(i) for i in vision["fullatt_block_indexes"] if int(i) < int(vision["depth"])],
            tokens_per_second=int(vision["tokens_per_second"]), **token_ids(cfg),
        )
    except KeyError as e:
        raise UserError(f"{where}: missing field {e.args[0]!r}") from None
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


def check_exportable(args: ModelArgs) -> None:
    """UserError unless ``args`` are Qwen2.5-VL's (its own argument class, Qwen2's decoder switches)."""
    check_vision_language_export(args, Qwen2_5_VLArgs, MODEL_TYPE, (
        ("qk_norm", args.qk_norm), ("head_dim", args.head_dim * args.n_heads != args.dim)))


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
        "model_type": "qwen2_5_vl_vision", **tower_config(args, torch_dtype), "window_size": args.window_size,
        "fullatt_block_indexes": list(args.vision_full_attention_layers), "tokens_per_second": args.tokens_per_second,
        "hidden_act": "silu",
    }
    return vision_language_config(args, ARCHITECTURE, MODEL_TYPE, text, vision, torch_dtype, bos_token_id,
                                  eos_token_id, pad_token_id)
