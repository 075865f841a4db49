"""DeepSeek-V3's ``config.json`` <-> :class:`~lmforge.models.deepseek_v3.args.DeepseekV3Args`.

Missing keys take transformers' ``DeepseekV3Config`` defaults, so a terse file means the same to both.
Refused, in one line naming the file and the key: quantized checkpoints (the published DeepSeek-V3 and
Kimi-K2 weights are FP8 / INT4: dequantize them to bf16 first), ``attention_bias``, a router other than
DeepSeek-V3's (``scoring_func`` other than sigmoid, ``topk_method`` other than ``noaux_tc``), dense layers
other than the first ``first_k_dense_replace`` (``moe_layer_freq`` != 1), activations other than SiLU, no
shared expert. Multi-token-prediction layers (``num_nextn_predict_layers`` > 0, tensors
``model.layers.{num_hidden_layers}...``) are read past: their tensors are dropped on load, with one
warning line, and exports write ``num_nextn_predict_layers: 0``.

Kimi-K2 is this architecture, but its own files say ``model_type: kimi_k2`` (transformers runs them through
remote code): set ``model_type`` to ``deepseek_v3`` in such a file to load it.
"""

from __future__ import annotations

from typing import Any, Mapping

from lmforge.errors import UserError
from lmforge.models.args import ROPE_TYPES, ModelArgs
from lmforge.models.deepseek_v3.args import DeepseekV3Args

__all__ = ["ARCHITECTURE", "MODEL_TYPE", "args_from_hf", "check_exportable", "hf_config"]

MODEL_TYPE = "deepseek_v3"
ARCHITECTURE = "DeepseekV3ForCausalLM"

DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_interleave": True,
}
"""transformers' ``DeepseekV3Config`` defaults (5.x) for the keys read here."""

# lmforge fields a DeepSeek-V3 model keeps at ModelArgs' defaults (they are other families' switches).
_FIXED = {"n_kv_heads": (None,), "qkv_bias": (False,), "qk_norm": (False,), "sliding_window": (None,),
          "layer_types": (None,), "local_rope_theta": (None,), "hidden_act": ("silu",), "norm_unit_offset": (False,),
          "embed_scale": (False,), "sandwich_norm": (False,), "attn_scale": (None,)}


def _rope(cfg: Mapping[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from transformers >= 5's ``rope_parameters`` or older files'
    ``rope_theta`` + ``rope_scaling`` (whose ``type`` is written ``rope_type`` here)."""
    rope = dict(cfg.get("rope_parameters") or {})
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = dict(cfg.get("rope_scaling") or rope)
    if float(scaling.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise UserError(f"{where}: partial_rotary_factor is not supported")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ROPE_TYPES:
        raise UserError(f"{where}: rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    rest = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type", "rope_type")}
    return theta, {"rope_type": kind, **rest}


def args_from_hf(cfg: Mapping[str, Any], where: str) -> DeepseekV3Args:
    """``DeepseekV3Args`` for a parsed DeepSeek-V3 ``config.json``."""
    if cfg.get("model_type") != MODEL_TYPE:
        raise UserError(f"{where}: model_type {cfg.get('model_type')!r} is not {MODEL_TYPE!r}")
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, Mapping) else "?"
        raise UserError(f"{where}: quantization_config ({method}) is set: lmforge reads unquantized weights only; "
                        "dequantize the checkpoint to bf16 first")
    if cfg.get("attention_bias"):
        raise UserError(f"{where}: attention_bias=true is not supported for model_type {MODEL_TYPE!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UserError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (need silu)")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise UserError(f"{where}: scoring_func {cfg['scoring_func']!r} is not supported (DeepSeek-V3's is sigmoid)")
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise UserError(f"{where}: topk_method {cfg['topk_method']!r} is not supported (DeepSeek-V3's is noaux_tc)")
    if int(cfg.get("moe_layer_freq", 1)) != 1:
        raise UserError(f"{where}: moe_layer_freq={cfg['moe_layer_freq']} is not supported (transformers ignores "
                        "it: every layer from first_k_dense_replace on is a mixture of experts)")

    def get(key: str) -> Any:  # q_lora_rank null is meaningful (no query bottleneck); other nulls are defaults
        if key == "q_lora_rank":
            return cfg[key] if key in cfg else DEFAULTS[key]
        return cfg[key] if cfg.get(key) is not None else DEFAULTS[key]

    theta, scaling = _rope(cfg, where)
    try:
        q_lora = get("q_lora_rank")
        return DeepseekV3Args(
            dim=int(get("hidden_size")), n_layers=int(get("num_hidden_layers")),
            n_heads=int(get("num_attention_heads")), vocab_size=int(get("vocab_size")),
            ffn_hidden_dim=int(get("intermediate_size")), norm_eps=float(get("rms_norm_eps")), rope_theta=theta,
            max_seq_len=int(get("max_position_embeddings")), tie_embeddings=bool(get("tie_word_embeddings")),
            rope_scaling=scaling, n_experts=int(get("n_routed_experts")),
            n_experts_per_token=int(get("num_experts_per_tok")), moe_ffn_dim=int(get("moe_intermediate_size")),
            moe_norm_topk=bool(get("norm_topk_prob")), q_lora_rank=None if q_lora is None else int(q_lora),
            kv_lora_rank=int(get("kv_lora_rank")), qk_nope_head_dim=int(get("qk_nope_head_dim")),
            qk_rope_head_dim=int(get("qk_rope_head_dim")), v_head_dim=int(get("v_head_dim")),
            n_shared_experts=int(get("n_shared_experts")), n_groups=int(get("n_group")),
            topk_groups=int(get("topk_group")), routed_scaling_factor=float(get("routed_scaling_factor")),
            first_k_dense_replace=int(get("first_k_dense_replace")), rope_interleave=bool(get("rope_interleave")),
            hf_model_type=MODEL_TYPE,
        )
    except UserError as e:
        raise UserError(f"{where}: {e}") from None


def check_exportable(args: ModelArgs) -> None:
    """UserError unless ``args`` is a DeepSeek-V3 model transformers can build."""
    if not isinstance(args, DeepseekV3Args):
        raise UserError(f"cannot export as Hugging Face model_type {MODEL_TYPE!r}: the arguments are not "
                        "DeepseekV3Args (no latent attention)")
    for key, allowed in _FIXED.items():
        value = getattr(args, key)
        if key == "n_kv_heads" and value == args.n_heads:
            continue
        if value not in allowed:
            raise UserError(f"cannot export as Hugging Face model_type {MODEL_TYPE!r}: it needs {key}={allowed[0]}")
    if args.first_k_dense_replace < args.n_layers and args.n_experts == 0:
        raise UserError(f"cannot export as Hugging Face model_type {MODEL_TYPE!r}: it needs experts")


def hf_config(
    args: ModelArgs, *, torch_dtype: str, bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
) -> dict[str, Any]:
    """The ``config.json`` transformers builds ``args`` from, as ``DeepseekV3ForCausalLM``."""
    check_exportable(args)
    assert isinstance(args, DeepseekV3Args)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling is not None:
        rope = {**args.rope_scaling, "rope_theta": args.rope_theta}
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "moe_intermediate_size": args.expert_ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "n_shared_experts": args.n_shared_experts,
        "n_routed_experts": args.n_experts,
        "num_experts_per_tok": args.n_experts_per_token,
        "routed_scaling_factor": args.routed_scaling_factor,
        "n_group": args.n_groups,
        "topk_group": args.topk_groups,
        "norm_topk_prob": args.moe_norm_topk,
        "first_k_dense_replace": args.first_k_dense_replace,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "q_lora_rank": args.q_lora_rank,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "rope_interleave": args.rope_interleave,
        "rope_parameters": rope,
        "num_nextn_predict_layers": 0,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": torch_dtype,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
    }
