"""gpt-oss's hyper-parameters (:class:`GptOssArgs`) and its named sizes.

gpt-oss (OpenAI, 2025) is a mixture of experts whose every layer differs from a Llama in small ways:
attention with q/k/v *and* output biases and a learned sink logit per head, alternating sliding-window
(128 tokens) and full layers, YaRN RoPE, a router with a bias that softmaxes its top-k logits (not all
of them), and experts with biases and a clamped SwiGLU (``(clamp(up, -l, l) + 1) * g * sigmoid(alpha g)``,
``g = clamp(gate, max=l)``). Its RMSNorm multiplies the weight in fp32 before casting back.

The fields below are the ones ``ModelArgs`` lacks; the shared ones keep their meaning (``ffn_hidden_dim``
is each expert's hidden size: gpt-oss has no dense MLP).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmforge.errors import UserError
from lmforge.models.args import ModelArgs
from lmforge.models.configs import (
    AttentionConfig, BlockConfig, DecoderConfig, MLPConfig, MoEConfig, NormConfig, RopeConfig, RouterConfig,
)

__all__ = ["GPT_OSS_SIZES", "GptOssArgs", "alternating_layer_types", "gpt_oss_args_for"]

YARN_DEFAULTS = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}
"""transformers' ``GptOssConfig`` rope parameters when a config.json has none (the published ones)."""
YARN_KEYS = ("rope_type", "type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "truncate", "attention_factor", "mscale", "mscale_all_dim")


def alternating_layer_types(n_layers: int) -> list[str]:
    """transformers' default for gpt-oss: sliding layers first, then full, alternating."""
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]


@dataclass
class GptOssArgs(ModelArgs):
    """``ModelArgs`` for gpt-oss; the defaults are transformers' ``GptOssConfig`` defaults where both have
    the setting (``gpt-oss-120b``'s shape), lmforge's small ones otherwise."""

    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    attention_sinks: bool = True
    out_bias: bool = True  # a bias on the attention's output projection (gpt-oss's attention_bias covers all four)
    router_bias: bool = True
    expert_bias: bool = True
    qkv_bias: bool = True
    moe_norm_topk: bool = False
    n_experts: int = 4
    n_experts_per_token: int = 2
    sliding_window: int | None = 128
    rope_theta: float = 150000.0
    norm_eps: float = 1e-5
    router_aux_loss_coef: float = 0.001
    hf_model_type: str = "gpt_oss"

    def __post_init__(self) -> None:
        if self.layer_types is None:
            self.layer_types = alternating_layer_types(self.n_layers)
        super().__post_init__()
        scaling = self.rope_scaling
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "yarn":
            unknown = sorted(set(scaling) - set(YARN_KEYS))
            if unknown:
                raise UserError(f"unsupported yarn rope_scaling key(s) {unknown}")
            if "factor" not in scaling or "original_max_position_embeddings" not in scaling:
                raise UserError("yarn rope_scaling needs 'factor' and 'original_max_position_embeddings'")
        if self.n_experts < 1:
            raise UserError("gpt-oss needs n_experts >= 1 (every layer is a mixture of experts)")
        if self.moe_layers is not None:
            raise UserError("gpt-oss has experts in every layer: moe_layers must be unset")
        if self.swiglu_limit <= 0:
            raise UserError(f"swiglu_limit must be positive, got {self.swiglu_limit}")

    def decoder_config(self) -> DecoderConfig:
        """Every block: biased grouped-query attention with sinks (windowed on the sliding layers) and a mixture
        of biased clamped-SwiGLU experts behind a biased top-k-softmax router."""
        norm = NormConfig(self.dim, self.norm_eps, weight_in_fp32=True)  # transformers' GptOssRMSNorm
        ropes = {"global": RopeConfig(self.head_dim, self.rope_theta, self.max_seq_len, self.rope_scaling)}  # type: ignore[arg-type]
        router = RouterConfig(self.n_experts, self.n_experts_per_token, "topk_softmax", norm_topk=self.moe_norm_topk,
                              bias=self.router_bias)
        expert = MLPConfig(self.dim, self.expert_ffn_dim, "clamped_swiglu", bias=self.expert_bias,
                           limit=self.swiglu_limit, alpha=self.swiglu_alpha)
        blocks = tuple(
            BlockConfig(
                AttentionConfig(dim=self.dim, n_heads=self.n_heads, n_kv_heads=self.kv_heads,
                                head_dim=self.head_dim, qkv_bias=self.qkv_bias, out_bias=self.out_bias,  # type: ignore[arg-type]
                                scale=self.attn_scale, window=self.layer_window(i), sinks=self.attention_sinks),
                MoEConfig(self.dim, router, expert), norm)
            for i in range(self.n_layers))
        return DecoderConfig(vocab_size=self.vocab_size, dim=self.dim, blocks=blocks, norm=norm, ropes=ropes,
                             max_seq_len=self.max_seq_len, tie_embeddings=self.tie_embeddings)


def _gpt_oss(n_layers: int, n_experts: int) -> dict[str, Any]:
    return dict(
        dim=2880, n_layers=n_layers, n_heads=64, n_kv_heads=8, head_dim=64, ffn_hidden_dim=2880, norm_eps=1e-5,
        rope_theta=150000.0, rope_scaling=dict(YARN_DEFAULTS), max_seq_len=131072, tie_embeddings=False,
        sliding_window=128, layer_types=alternating_layer_types(n_layers), n_experts=n_experts,
        n_experts_per_token=4, swiglu_limit=7.0, swiglu_alpha=1.702, router_aux_loss_coef=0.9,
    )


GPT_OSS_SIZES: dict[str, dict[str, Any]] = {
    # https://huggingface.co/openai/gpt-oss-20b/raw/main/config.json and .../gpt-oss-120b/raw/main/config.json
    # (vocab_size 201088 comes from the tokenizer, as for every named size)
    "gpt-oss-20b": _gpt_oss(24, 32),
    "gpt-oss-120b": _gpt_oss(36, 128),
}


def gpt_oss_args_for(size: str, vocab_size: int, **overrides: Any) -> GptOssArgs:
    """``GptOssArgs`` of a named size (``model_args_for``: the spec registers :data:`GPT_OSS_SIZES`)."""
    from lmforge.models.args import model_args_for

    if size not in GPT_OSS_SIZES:
        raise UserError(f"unknown gpt-oss size {size!r}; known: {', '.join(GPT_OSS_SIZES)}")
    args = model_args_for(size, vocab_size, **overrides)
    assert isinstance(args, GptOssArgs)
    return args
