"""gpt-oss's Hugging Face ``config.json`` <-> :class:`GptOssArgs`, both ways.

Missing keys take transformers' ``GptOssConfig`` defaults, so a terse config means the same to both.
Read: the transformers 5 layout (``rope_parameters`` holding ``rope_theta``) and the published one
(``rope_theta`` + ``rope_scaling``, and OpenAI's own spellings ``experts_per_token`` / ``num_experts``);
``quantization_config`` with ``quant_method`` ``mxfp4`` is accepted (the expert weights are dequantized on
load). Refused, each in one line naming the file and the key: ``attention_bias`` false, other quantization
methods, RoPE schemes lmforge lacks, layer types other than sliding/full, sliding layers without a window.
"""

from __future__ import annotations

from typing import Any, Mapping

from lmforge.errors import UserError
from lmforge.models.args import ROPE_TYPES, ModelArgs
from lmforge.models.gpt_oss.args import YARN_DEFAULTS, GptOssArgs, alternating_layer_types

__all__ = ["ARCHITECTURE", "MODEL_TYPE", "args_from_hf", "check_exportable", "hf_config"]

MODEL_TYPE = "gpt_oss"
ARCHITECTURE = "GptOssForCausalLM"
DEFAULTS: dict[str, Any] = {  # transformers' GptOssConfig
    "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
    "sliding_window": 128, "tie_word_embeddings": False, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "router_aux_loss_coef": 0.001,
    "attention_bias": True, "rope_theta": 150000.0,
}


def _rope(cfg: Mapping[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", DEFAULTS["rope_theta"])))
    scaling = cfg.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"} or dict(YARN_DEFAULTS)
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ROPE_TYPES:
        raise UserError(f"{where}: rope type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if "type" in scaling:
        scaling["rope_type"] = scaling.pop("type")
    return theta, scaling


def args_from_hf(cfg: Mapping[str, Any], where: str) -> GptOssArgs:
    """:class:`GptOssArgs` for a parsed gpt-oss ``config.json``; ``where`` names the file in errors."""
    if cfg.get("model_type") != MODEL_TYPE:
        raise UserError(f"{where}: model_type {cfg.get('model_type')!r} is not {MODEL_TYPE!r}")

    def get(key: str, *aliases: str) -> Any:
        for k in (key, *aliases):
            if cfg.get(k) is not None:
                return cfg[k]
        return DEFAULTS[key]

    if not get("attention_bias"):
        raise UserError(f"{where}: attention_bias=false is not supported for gpt_oss")
    quant = cfg.get("quantization_config")
    if quant and quant.get("quant_method") != "mxfp4":
        raise UserError(f"{where}: quantization_config quant_method {quant.get('quant_method')!r} is not supported "
                        "(mxfp4 expert weights are dequantized on load)")
    n_layers = int(get("num_hidden_layers"))
    layer_types = list(cfg.get("layer_types") or alternating_layer_types(n_layers))
    if any(t not in ("sliding_attention", "full_attention") for t in layer_types):
        raise UserError(f"{where}: layer_types other than sliding_attention/full_attention are not supported")
    window = cfg.get("sliding_window", DEFAULTS["sliding_window"])
    if window is None and "sliding_attention" in layer_types:
        raise UserError(f"{where}: layer_types has sliding_attention layers but sliding_window is null")
    theta, scaling = _rope(cfg, where)
    n_heads = int(get("num_attention_heads"))
    try:
        return GptOssArgs(
            dim=int(get("hidden_size")), n_layers=n_layers, n_heads=n_heads,
            n_kv_heads=int(get("num_key_value_heads")), vocab_size=int(get("vocab_size")),
            ffn_hidden_dim=int(get("intermediate_size")), norm_eps=float(get("rms_norm_eps")), rope_theta=theta,
            max_seq_len=int(get("max_position_embeddings")), tie_embeddings=bool(get("tie_word_embeddings")),
            rope_scaling=scaling, head_dim=int(get("head_dim")), sliding_window=int(window) if window else None,
            layer_types=layer_types, n_experts=int(get("num_local_experts", "num_experts")),
            n_experts_per_token=int(get("num_experts_per_tok", "experts_per_token")),
            swiglu_limit=float(get("swiglu_limit")), swiglu_alpha=float(get("swiglu_alpha")),
            router_aux_loss_coef=float(get("router_aux_loss_coef")),
        )
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


_FIXED = {"qkv_bias": True, "out_bias": True, "attention_sinks": True, "router_bias": True, "expert_bias": True,
          "moe_norm_topk": False, "qk_norm": False, "norm_unit_offset": False, "embed_scale": False,
          "sandwich_norm": False, "attn_scale": None, "local_rope_theta": None, "moe_layers": None,
          "hidden_act": "silu"}
"""What every gpt-oss has (``GptOssArgs`` may switch these off for experiments; such a model cannot be exported)."""


def check_exportable(args: ModelArgs) -> None:
    """UserError unless ``args`` is a gpt-oss transformers can build."""
    def refuse(why: str) -> UserError:
        return UserError(f"cannot export as Hugging Face model_type {MODEL_TYPE!r}: {why}")

    if not isinstance(args, GptOssArgs):
        raise refuse(f"its arguments are {type(args).__name__}, not GptOssArgs")
    for key, need in _FIXED.items():
        if getattr(args, key) != need:
            raise refuse(f"it needs {key}={need}")
    if args.moe_ffn_dim is not None and args.moe_ffn_dim != args.ffn_dim:
        raise refuse("its experts' hidden size is intermediate_size (moe_ffn_dim must be unset)")


def hf_config(args: ModelArgs, *, torch_dtype: str, bos_token_id: int | None = None,
              eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None) -> dict[str, Any]:
    """The ``config.json`` transformers needs to build ``args`` as ``GptOssForCausalLM`` with the same shapes."""
    check_exportable(args)
    assert isinstance(args, GptOssArgs)
    rope = {"rope_type": "default"} if args.rope_scaling is None else dict(args.rope_scaling)
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "hidden_size": args.dim, "intermediate_size": args.ffn_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps,
        "rope_parameters": {**rope, "rope_theta": args.rope_theta},
        "tie_word_embeddings": args.tie_embeddings, "hidden_act": "silu", "attention_bias": True,
        "attention_dropout": 0.0, "sliding_window": args.sliding_window, "layer_types": list(args.layer_types or []),
        "num_local_experts": args.n_experts, "num_experts_per_tok": args.n_experts_per_token,
        "swiglu_limit": args.swiglu_limit, "swiglu_alpha": args.swiglu_alpha,
        "router_aux_loss_coef": args.router_aux_loss_coef, "output_router_logits": False,
        "initializer_range": 0.02, "use_cache": True, "torch_dtype": torch_dtype,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id,
    }
