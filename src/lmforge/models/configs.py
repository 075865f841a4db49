"""Per-module configs: each shared layer takes its own small, frozen config, and a decoder is a list
of block configs.

A family's argument class (``ModelArgs`` or a family's own subclass) turns its hyper-parameters into a
:class:`DecoderConfig` (``args.decoder_config()``); :class:`~lmforge.models.model.Transformer` builds
one module per config, choosing the module by the config's type (:class:`AttentionConfig` ->
``Attention``, :class:`LatentAttentionConfig` -> ``LatentAttention``, :class:`MLPConfig` ->
``FeedForward``, :class:`MoEConfig` -> ``MoEFeedForward``). So a family with other attention or another
router adds a config here (or in its folder) and a module beside it, not a switch on every model.

Configs are pure data (no torch), so anything may import this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

__all__ = [
    "AttentionConfig", "BlockConfig", "DecoderConfig", "LatentAttentionConfig", "MLPConfig", "MoEConfig",
    "NormConfig", "RopeConfig", "RouterConfig",
]


@dataclass(frozen=True)
class NormConfig:
    """RMSNorm over ``dim``: Llama's (scale by ``w``) or Gemma's (``unit_offset``: scale by ``1 + w`` in fp32)."""

    dim: int
    eps: float = 1e-5
    unit_offset: bool = False
    weight_in_fp32: bool = False
    """Low-precision inputs: scale the fp32 normalised values by the weight in fp32 and cast last (gpt-oss,
    as transformers computes it), instead of casting first and scaling in the input's dtype (Llama)."""


@dataclass(frozen=True)
class RopeConfig:
    """One rotary table: ``dim`` rotated features per head, base ``theta``, positions ``[0, max_seq_len)``.

    ``scaling`` is the Hugging Face ``rope_scaling`` dict (``rope_type`` ``linear``, ``llama3`` or
    ``yarn``), None for plain RoPE. The table is always in the rotate-half layout; an attention whose
    checkpoint pairs adjacent features says so in its own config (``rope_interleave``)."""

    dim: int
    theta: float
    max_seq_len: int
    scaling: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class AttentionConfig:
    """Grouped-query attention with q/k/v/o projections.

    ``qk_norm``: RMSNorm on q and k before RoPE, over each head (``"head"``: Qwen3, Gemma) or over the
    whole projection (``"projection"``: OLMoE). ``scale`` None is ``1/sqrt(head_dim)``. ``window``: a
    sliding window of keys (None: full causal). ``rope``: the name of the decoder's rotary table the
    layer uses. ``sinks``: a learned per-head logit that joins every softmax (gpt-oss).
    """

    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: Literal["head", "projection"] | None = None
    norm: NormConfig | None = None
    """The q/k norms' eps and convention (their ``dim`` is derived); required with ``qk_norm``."""
    scale: float | None = None
    window: int | None = None
    rope: str = "global"
    sinks: bool = False


@dataclass(frozen=True)
class LatentAttentionConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): queries through an optional low-rank ``q_lora_rank``
    bottleneck, keys and values from one ``kv_lora_rank`` latent per token plus a shared rotary key of
    ``qk_rope_head_dim`` features; each head's key is ``[nope | rope]``. ``scale`` None is
    ``1/sqrt(qk_nope_head_dim + qk_rope_head_dim)``."""

    dim: int
    n_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    norm: NormConfig
    """The latent norms' eps (their ``dim`` is derived)."""
    scale: float | None = None
    window: int | None = None
    rope: str = "global"
    rope_interleave: bool = False
    """The checkpoint's rotary features are adjacent pairs (DeepSeek-V3's ``rope_interleave``)."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MLPConfig:
    """Gated MLP ``down(act(gate x) * up x)``. ``activation``: ``silu`` (SwiGLU), ``gelu_tanh`` (GeGLU) or
    ``clamped_swiglu`` (gpt-oss: gate clamped above, up clamped both sides at ``limit``, ``(up + 1) *
    gate * sigmoid(alpha * gate)``). ``bias``: biases on the three projections."""

    dim: int
    hidden_dim: int
    activation: str = "silu"
    bias: bool = False
    limit: float | None = None
    alpha: float | None = None


@dataclass(frozen=True)
class RouterConfig:
    """How a token picks its ``top_k`` of ``n_experts`` experts and weighs them.

    ``scoring``: ``softmax`` of the logits (Mixtral, Qwen3-MoE, OLMoE), ``sigmoid`` (DeepSeek-V3) or
    ``topk_softmax`` (gpt-oss: the top-k logits, then a softmax over those k). ``norm_topk``: the chosen
    weights renormalised to sum to one. ``n_groups`` / ``topk_groups``: group-limited routing (DeepSeek-V3:
    experts in ``n_groups`` groups, a token keeps the ``topk_groups`` groups whose two best scores sum
    highest). ``correction_bias``: DeepSeek-V3's ``e_score_correction_bias``, added to the scores for the
    choice only (not the weights) and balanced after each optimizer step. ``bias``: a bias on the router's
    linear layer (gpt-oss). ``scaling``: the weights' factor (``routed_scaling_factor``)."""

    n_experts: int
    top_k: int
    scoring: Literal["softmax", "sigmoid", "topk_softmax"] = "softmax"
    norm_topk: bool = True
    n_groups: int = 1
    topk_groups: int = 1
    correction_bias: bool = False
    bias: bool = False
    scaling: float = 1.0
    aux_scope: Literal["batch", "sequence"] = "batch"
    """The load-balancing loss's scope: over the forward's tokens and layers together (``batch``, as
    transformers computes it), or DeepSeek-V3's complementary sequence-wise loss (``sequence``: per row and
    layer, ``sum_i f_i P_i`` with ``f_i = E / (k T) * slots_i``, averaged over rows and layers)."""


@dataclass(frozen=True)
class MoEConfig:
    """A mixture of experts in place of the MLP: the ``router``, routed experts shaped by ``expert``
    (its ``hidden_dim`` is each expert's), and optionally an always-on shared MLP (``shared``: DeepSeek's
    shared experts, one MLP of ``n_shared * moe_intermediate_size``)."""

    dim: int
    router: RouterConfig
    expert: MLPConfig
    shared: MLPConfig | None = None


@dataclass(frozen=True)
class BlockConfig:
    """One residual block: pre-norm attention then pre-norm feed-forward; ``sandwich_norm`` (Gemma) also
    normalises each sublayer's output before it joins the residual stream."""

    attention: AttentionConfig | LatentAttentionConfig
    feed_forward: MLPConfig | MoEConfig
    norm: NormConfig
    sandwich_norm: bool = False


@dataclass(frozen=True)
class DecoderConfig:
    """A decoder-only model: embedding (optionally scaled by sqrt(dim): Gemma), ``blocks``, final norm and
    output projection (optionally tied to the embedding); ``ropes`` holds every rotary table the blocks
    name (Gemma 3's local and global layers use two)."""

    vocab_size: int
    dim: int
    blocks: tuple[BlockConfig, ...]
    norm: NormConfig
    ropes: Mapping[str, RopeConfig] = field(default_factory=dict)
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    embed_scale: bool = False
