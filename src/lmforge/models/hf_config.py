"""Hugging Face ``config.json`` <-> ``ModelArgs`` for the families lmforge runs exactly.

Reading refuses, with one line naming the file and the key, every setting lmforge cannot
reproduce exactly (other model types, mixtures of experts, other activations, biases Llama
can switch on, RoPE schemes other than default/llama3/linear, Qwen's per-layer sliding
window...). Missing keys take the defaults transformers itself uses for that family, so a
terse config means the same thing to both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmforge.errors import UserError
from lmforge.models.args import HF_ARCHITECTURES, ROPE_TYPES, ModelArgs

# transformers' defaults for keys a config.json may leave out (per model_type).
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048},
    "mistral": {"num_key_value_heads": 8, "head_dim": None, "max_position_embeddings": 4096 * 32,
                "sliding_window": 4096},
    "qwen2": {"num_key_value_heads": 32, "head_dim": None, "max_position_embeddings": 32768},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768},
}
# Boolean switches that add something lmforge does not implement for that family.
_REFUSED_FLAGS: dict[str, tuple[str, ...]] = {
    "llama": ("attention_bias", "mlp_bias"),
    "mistral": (),
    "qwen2": ("use_sliding_window",),
    "qwen3": ("attention_bias", "use_sliding_window"),
}
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def _rope_settings(cfg: dict[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from either config layout.

    transformers >= 5 nests everything in ``rope_parameters``; older files use a top-level
    ``rope_theta`` plus an optional ``rope_scaling``.
    """
    rope = dict(cfg.get("rope_parameters") or {})
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise UserError(f"{where}: partial_rotary_factor is not supported (lmforge rotates the whole head)")
    if scaling is None:
        return theta, None
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return theta, None
    if kind not in ROPE_TYPES:
        raise UserError(f"{where}: rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    return theta, scaling


def args_from_hf_config(cfg: dict[str, Any], where: str | Path) -> ModelArgs:
    """``ModelArgs`` for a parsed ``config.json``; ``where`` names the file in error messages."""
    where = str(where)
    family = cfg.get("model_type")
    if family not in HF_ARCHITECTURES:
        raise UserError(f"{where}: model_type {family!r} is not supported (supported: {', '.join(HF_ARCHITECTURES)})")
    for key in _MOE_KEYS:
        if cfg.get(key):
            raise UserError(f"{where}: {key} is set: mixture-of-experts models are not supported")
    for key in _REFUSED_FLAGS[family]:
        if cfg.get(key):
            raise UserError(f"{where}: {key}=true is not supported for model_type {family!r}")
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act != "silu":
        raise UserError(f"{where}: hidden_act {act!r} is not supported (need silu)")
    layer_types = cfg.get("layer_types") or []
    if family != "mistral" and any(t != "full_attention" for t in layer_types):
        raise UserError(f"{where}: layer_types other than full_attention are not supported")
    defaults = _FAMILY_DEFAULTS[family]

    def get(key: str) -> Any:
        return cfg[key] if key in cfg else defaults[key]

    theta, scaling = _rope_settings(cfg, where)
    try:
        n_heads = int(cfg["num_attention_heads"])
        n_kv = get("num_key_value_heads")
        head_dim = get("head_dim")
        window = get("sliding_window") if family == "mistral" else None
        return ModelArgs(
            dim=int(cfg["hidden_size"]),
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(n_kv) if n_kv else n_heads,
            vocab_size=int(cfg["vocab_size"]),
            ffn_hidden_dim=int(cfg["intermediate_size"]),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_seq_len=int(get("max_position_embeddings")),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            head_dim=int(head_dim) if head_dim else None,
            qkv_bias=family == "qwen2",
            qk_norm=family == "qwen3",
            sliding_window=int(window) if window else None,
            hf_model_type=family,
        )
    except KeyError as e:
        raise UserError(f"{where}: missing field {e.args[0]!r}") from None
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


def check_exportable(args: ModelArgs) -> None:
    """UserError unless ``args`` is exactly what its ``hf_model_type`` can express."""
    family = args.hf_model_type
    wanted = {
        "qkv_bias": family == "qwen2",
        "qk_norm": family == "qwen3",
        "sliding_window": family == "mistral" and args.sliding_window is not None,
    }
    have = {"qkv_bias": args.qkv_bias, "qk_norm": args.qk_norm, "sliding_window": args.sliding_window is not None}
    for key, need in wanted.items():
        if have[key] != need:
            state = "requires" if need else "cannot have"
            raise UserError(f"cannot export as Hugging Face model_type {family!r}: it {state} {key}")


def hf_config_from_args(
    args: ModelArgs, *, torch_dtype: str, bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
) -> dict[str, Any]:
    """The ``config.json`` transformers needs to build ``args``' family with the same shapes."""
    check_exportable(args)
    family = args.hf_model_type
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling is not None:
        rope = {**args.rope_scaling, "rope_theta": args.rope_theta}
    config: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURES[family]],
        "model_type": family,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": args.rope_scaling,
        "rope_parameters": rope,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": torch_dtype,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
    }
    if family == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    elif family == "mistral":
        config.update(sliding_window=args.sliding_window)
    else:  # qwen2 / qwen3: full attention in every layer
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=args.n_layers)
        if family == "qwen3":
            config.update(attention_bias=False)
    return config
