"""DeepSeek-V3's arguments (:class:`DeepseekV3Args`) and its named sizes.

A DeepSeek-V3 decoder differs from the Llama-shaped ones in two modules: multi-head latent attention
(:class:`~lmforge.models.layers.latent_attention.LatentAttention`: low-rank q and kv projections with
their norms, decoupled rotary dimensions, YaRN with its softmax ``mscale``) and, after
``first_k_dense_replace`` dense layers, a mixture of experts with always-on shared experts and a
sigmoid router that picks among the best ``topk_groups`` of ``n_groups`` expert groups, with a
correction bias for the choice only and ``routed_scaling_factor`` on the weights. So the family
subclasses ``ModelArgs`` with those hyper-parameters and overrides :meth:`decoder_config`.

Kimi-K2 is the same architecture (its checkpoints say ``DeepseekV3ForCausalLM``), with other sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lmforge.errors import UserError
from lmforge.models.args import ModelArgs
from lmforge.models.configs import (
    BlockConfig, DecoderConfig, LatentAttentionConfig, MLPConfig, MoEConfig, NormConfig, RopeConfig, RouterConfig,
)

__all__ = ["DEEPSEEK_V3_SIZES", "DeepseekV3Args", "yarn_softmax_scale"]

LATENT_NORM_EPS = 1e-6
"""transformers builds ``q_a_layernorm`` and ``kv_a_layernorm`` with its RMSNorm's default eps, whatever
``rms_norm_eps`` says."""


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_softmax_scale(qk_head_dim: int, rope_scaling: dict[str, Any] | None) -> float:
    """The softmax scale of latent attention: ``qk_head_dim ** -0.5``, times ``mscale(factor,
    mscale_all_dim) ** 2`` under a scaled RoPE with ``mscale_all_dim`` (DeepSeek's reference code and
    transformers' ``yarn_apply_mscale``: YaRN's temperature applied to the whole q.k, not only the rotary
    features)."""
    scale = qk_head_dim ** -0.5
    if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type", "default")) != "default":
        m_all = rope_scaling.get("mscale_all_dim", 0)
        if m_all:
            m = _mscale(float(rope_scaling["factor"]), float(m_all))
            scale = scale * m * m
    return scale


@dataclass
class DeepseekV3Args(ModelArgs):
    """``ModelArgs`` of DeepSeek-V3 (and Kimi-K2). Of the shared fields, ``ffn_hidden_dim`` is the dense
    layers' MLP, ``n_experts`` / ``n_experts_per_token`` / ``moe_ffn_dim`` / ``moe_norm_topk`` the routed
    experts, ``rope_scaling`` may be YaRN; ``head_dim`` is the rotary width (``qk_rope_head_dim``, as
    transformers sets it); ``n_kv_heads``, the Llama switches and ``moe_layers`` (derived from
    ``first_k_dense_replace``) are not the family's. Defaults are transformers' ``DeepseekV3Config``'s."""

    q_lora_rank: int | None = 1536
    """The query bottleneck; None: one ``wq`` projection (DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_shared_experts: int = 1
    """Always-on experts, run as one MLP of ``n_shared_experts * moe_ffn_dim``."""
    n_groups: int = 8
    topk_groups: int = 4
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 3
    """Layers before this one keep a dense MLP of ``ffn_hidden_dim``; the others are mixtures of experts."""
    rope_interleave: bool = True
    """The checkpoint's rotary features are adjacent pairs (rotated as transformers does, see
    ``lmforge.models.layers.latent_attention``)."""
    bias_update_speed: float = 0.001
    """Auxiliary-loss-free balancing: how far each step moves ``e_score_correction_bias`` towards even
    expert loads (DeepSeek-V3's gamma; 0 keeps the bias fixed)."""
    aux_loss_scope: str = "sequence"
    """The load-balancing loss ``training.router_aux_loss_coef`` weighs (off by default, as the family
    balances through the correction bias): DeepSeek-V3's complementary sequence-wise loss (``sequence``,
    its alpha 0.0001 in the paper), or transformers' batch-wise one (``batch``)."""
    hf_model_type: str = "deepseek_v3"

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.qk_rope_head_dim
        super().__post_init__()
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be positive, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise UserError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even for rotary embeddings")
        if self.head_dim != self.qk_rope_head_dim:
            raise UserError(f"head_dim is the rotary width of latent attention: {self.qk_rope_head_dim}, "
                            f"not {self.head_dim}")
        if self.first_k_dense_replace < 0:
            raise UserError(f"first_k_dense_replace must be >= 0, got {self.first_k_dense_replace}")
        if self.aux_loss_scope not in ("sequence", "batch"):
            raise UserError(f"aux_loss_scope must be 'sequence' or 'batch', got {self.aux_loss_scope!r}")
        if self.first_k_dense_replace < self.n_layers:
            if not self.n_experts:
                raise UserError("DeepSeek-V3 layers from first_k_dense_replace on are mixtures of experts: "
                                "n_experts must be > 0")
            if self.n_groups < 1 or self.n_experts % self.n_groups or not 1 <= self.topk_groups <= self.n_groups:
                raise UserError(f"n_experts ({self.n_experts}) must split into n_groups ({self.n_groups}) equal "
                                f"groups and 1 <= topk_groups ({self.topk_groups}) <= n_groups")
            if self.n_experts_per_token > self.topk_groups * (self.n_experts // self.n_groups):
                raise UserError(f"n_experts_per_token {self.n_experts_per_token} exceeds the experts of "
                                f"topk_groups={self.topk_groups} groups")
            if self.n_shared_experts < 1:
                raise UserError("n_shared_experts must be >= 1 (transformers always builds the shared MLP)")
        self.moe_layers = None if self.first_k_dense_replace == 0 else list(range(self.first_k_dense_replace,
                                                                                  self.n_layers))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return yarn_softmax_scale(self.qk_head_dim, self.rope_scaling)

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_experts > 0 and layer >= self.first_k_dense_replace

    def decoder_config(self) -> DecoderConfig:
        norm = NormConfig(self.dim, self.norm_eps)
        rope = RopeConfig(self.qk_rope_head_dim, self.rope_theta, self.max_seq_len, self.rope_scaling)
        attention = LatentAttentionConfig(
            dim=self.dim, n_heads=self.n_heads, q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim, norm=NormConfig(self.kv_lora_rank, LATENT_NORM_EPS), scale=self.softmax_scale,
            rope_interleave=self.rope_interleave,
        )
        return DecoderConfig(
            vocab_size=self.vocab_size, dim=self.dim, norm=norm, ropes={"global": rope}, max_seq_len=self.max_seq_len,
            tie_embeddings=self.tie_embeddings,
            blocks=tuple(BlockConfig(attention, self._feed_forward(i), norm) for i in range(self.n_layers)),
        )

    def _feed_forward(self, layer: int) -> MLPConfig | MoEConfig:
        if not self.is_moe_layer(layer):
            return MLPConfig(self.dim, self.ffn_dim, self.hidden_act)
        router = RouterConfig(
            self.n_experts, self.n_experts_per_token, "sigmoid", self.moe_norm_topk, n_groups=self.n_groups,
            topk_groups=self.topk_groups, correction_bias=True, scaling=self.routed_scaling_factor,
            aux_scope=self.aux_loss_scope,  # type: ignore[arg-type]
        )
        return MoEConfig(self.dim, router, MLPConfig(self.dim, self.expert_ffn_dim, self.hidden_act),
                         shared=MLPConfig(self.dim, self.n_shared_experts * self.expert_ffn_dim, self.hidden_act))


# Copied from the published config.json files (deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Instruct) and
# registered with the family's spec (``model.size``); vocab_size comes from the tokenizer. Neither counts the
# multi-token-prediction layer (DeepSeek-V3's 14B of its 685B on disk), which lmforge does not load.
DEEPSEEK_V3_SIZES: dict[str, dict[str, Any]] = {
    "deepseek-v3-671b": dict(
        dim=7168, n_layers=61, n_heads=128, ffn_hidden_dim=18432, norm_eps=1e-6, rope_theta=10000.0,
        max_seq_len=163840, tie_embeddings=False,
        rope_scaling=dict(rope_type="yarn", factor=40.0, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
                          original_max_position_embeddings=4096),
        n_experts=256, n_experts_per_token=8, moe_ffn_dim=2048, moe_norm_topk=True, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_shared_experts=1,
        n_groups=8, topk_groups=4, routed_scaling_factor=2.5, first_k_dense_replace=3, rope_interleave=True,
    ),
    "kimi-k2": dict(
        dim=7168, n_layers=61, n_heads=64, ffn_hidden_dim=18432, norm_eps=1e-6, rope_theta=50000.0,
        max_seq_len=131072, tie_embeddings=False,
        rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                          original_max_position_embeddings=4096),
        n_experts=384, n_experts_per_token=8, moe_ffn_dim=2048, moe_norm_topk=True, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_shared_experts=1,
        n_groups=1, topk_groups=1, routed_scaling_factor=2.827, first_k_dense_replace=1, rope_interleave=True,
    ),
}
