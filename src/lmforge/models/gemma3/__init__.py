"""Gemma 3 text models (``model_type`` ``gemma3_text``: gemma-3-270m, 1b and the text towers' shape).

The shared decoder with Gemma's switches: embeddings scaled by sqrt(dim), RMSNorm scaling by
(1 + weight) in fp32, an RMSNorm before *and* after both attention and MLP, per-head q/k norms,
GeGLU (tanh-approximated GELU), the softmax scale ``query_pre_attn_scalar ** -0.5`` and (in every
published checkpoint) tied embeddings. Layers are local or global (``layer_types``; older files give ``sliding_window_pattern``,
default 6: five sliding layers, then one global): local layers attend to a ``sliding_window`` band
and rotate with their own base (``rope_local_base_freq``, 10k), global ones attend to everything
with ``rope_theta`` (1M) and its optional linear scaling. transformers >= 5 writes both RoPE
settings under ``rope_parameters`` keyed by layer type; both layouts are read.

Refused in one line: logit soft-capping (Gemma 2's; Gemma 3 has none), bidirectional attention
(EmbeddingGemma), attention biases and scaled RoPE on the local layers. The multimodal
``gemma3`` checkpoints (4b and up with a vision tower) are a different ``model_type``, read by
:mod:`lmforge.models.gemma3_vl` with this family's text decoder.
"""

from __future__ import annotations

from typing import Any, Mapping

from lmforge.errors import UserError
from lmforge.models.args import ModelArgs
from lmforge.models.common.gguf_names import LLAMA_GGUF_LAYER_NAMES
from lmforge.models.common.llama_style import LLAMA_LAYOUT, LlamaStyleConfig, rope_settings
from lmforge.models.spec import GGUFFormat

DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def _layer_types(cfg: Mapping[str, Any]) -> list[str]:
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    pattern = int(cfg.get("sliding_window_pattern", 6))
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(int(cfg["num_hidden_layers"]))]


def _rope(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``rope_theta``, ``rope_scaling`` (global layers) and ``local_rope_theta`` from either layout."""
    nested = cfg.get("rope_parameters") or {}
    if "full_attention" in nested or "sliding_attention" in nested:
        full = dict(nested.get("full_attention") or {})
        local = dict(nested.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise UserError(f"{where}: rope_parameters.sliding_attention.rope_type {local['rope_type']!r} "
                            "is not supported (the local layers use plain RoPE)")
        full.setdefault("rope_theta", cfg.get("rope_theta", DEFAULT_THETA["full_attention"]))
        theta, scaling = rope_settings({"rope_parameters": full}, where)
        local_theta = local.get("rope_theta", cfg.get("rope_local_base_freq", DEFAULT_THETA["sliding_attention"]))
    else:
        theta, scaling = rope_settings({"rope_theta": DEFAULT_THETA["full_attention"], **cfg}, where)
        local_theta = cfg.get("rope_local_base_freq", DEFAULT_THETA["sliding_attention"])
    return {"rope_theta": theta, "rope_scaling": scaling, "local_rope_theta": float(local_theta)}


def _read_extra(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise UserError(f"{where}: {key}={cfg[key]} is not supported (logit soft-capping)")
    scalar = float(cfg.get("query_pre_attn_scalar", 256))
    return {**_rope(cfg, where), "layer_types": _layer_types(cfg), "attn_scale": scalar ** -0.5}


def _query_pre_attn_scalar(args: ModelArgs) -> float | int:
    value = round((args.attn_scale or args.head_dim ** -0.5) ** -2, 6)
    return int(value) if value == int(value) else value


def _export_keys(args: ModelArgs) -> dict[str, Any]:
    local: dict[str, Any] = {"rope_type": "default", "rope_theta": args.local_rope_theta}
    full: dict[str, Any] = {**(args.rope_scaling or {"rope_type": "default"}), "rope_theta": args.rope_theta}
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": list(args.layer_types or ["full_attention"] * args.n_layers),
        "sliding_window": args.sliding_window,
        "query_pre_attn_scalar": _query_pre_attn_scalar(args),
        "rope_parameters": {"full_attention": full, "sliding_attention": local},
        "rope_scaling": None,
        "rope_local_base_freq": args.local_rope_theta,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        "use_bidirectional_attention": False,
    }


def _export_check(args: ModelArgs) -> str | None:
    if args.local_rope_theta is None:
        return "it requires local_rope_theta (the sliding layers' RoPE base)"
    return None


GEMMA3_CONFIG = LlamaStyleConfig(
    model_type="gemma3_text",
    architecture="Gemma3ForCausalLM",
    defaults={"num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072, "sliding_window": 4096},
    refused_flags=("attention_bias", "use_bidirectional_attention"),
    sliding_window=True,
    switches={"qk_norm": True, "norm_unit_offset": True, "embed_scale": True, "sandwich_norm": True},
    activations=("gelu_pytorch_tanh",),
    read_extra=_read_extra,
    export_check=_export_check,
    export_keys=_export_keys,
)

GEMMA3_LAYOUT = LLAMA_LAYOUT.extend(layer_names={
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
})



def _size(n_layers: int, dim: int, ffn: int) -> dict[str, Any]:
    """Gemma 3's text shape: 4 query heads, 1 kv head of 256, five local layers (window 512) per global one."""
    return dict(
        dim=dim, n_layers=n_layers, n_heads=4, n_kv_heads=1, head_dim=256, ffn_hidden_dim=ffn, norm_eps=1e-6,
        rope_theta=1_000_000.0, local_rope_theta=10_000.0, max_seq_len=32768, tie_embeddings=True, qk_norm=True,
        sliding_window=512, layer_types=["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layers)],
        hidden_act="gelu_tanh", norm_unit_offset=True, embed_scale=True, sandwich_norm=True, attn_scale=256 ** -0.5,
    )


# The fused decode step has no (1 + w) norms, sandwich norms or per-layer windows.
# google/gemma-3-270m, google/gemma-3-1b-pt
GEMMA3_GGUF = GGUFFormat("gemma3", {
    **LLAMA_GGUF_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    norm_shifted=True)
"""llama.cpp's ``gemma3``: its ``ffn_norm`` is the norm *before* the MLP, two more norms, and every
``*norm.weight`` stored plus one."""

GEMMA3 = GEMMA3_CONFIG.register(GEMMA3_LAYOUT, fused_decode=False, gguf=GEMMA3_GGUF, sizes={
    "gemma3-270m": _size(18, 640, 2048), "gemma3-1b": _size(26, 1152, 6912)})
