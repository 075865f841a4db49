"""Grouped-query self-attention, and the one place that picks its SDPA call.

Attention always goes through ``F.scaled_dot_product_attention`` so PyTorch can pick flash /
memory-efficient kernels. The plain causal case passes ``is_causal=True`` (no mask tensor at all),
the fast path on GPUs; a boolean mask (sliding-window band, KV-cache padding) goes to SDPA as is;
a packed batch's :class:`~lmforge.models.layers.packed_attention.PackedLayout` runs causal SDPA per
document instead.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmforge.models.configs import AttentionConfig
from lmforge.models.layers.causal_attention import causal_attention
from lmforge.models.layers.context_attention import ContextParallelLayout, attend_context_parallel
from lmforge.models.layers.norm import RMSNorm
from lmforge.models.layers.packed_attention import PackedLayout, attend_packed
from lmforge.models.layers.rope import apply_rope
from lmforge.models.layers.sinks import sink_attention

if TYPE_CHECKING:  # pragma: no cover
    from lmforge.models.layers.kv_cache import KVCache

__all__ = ["Attention", "attend"]


class Attention(nn.Module):
    """q/k/v/o projections (optional q/k/v bias: Qwen2; output bias: gpt-oss), optional q/k RMSNorm (per
    head: Qwen3, Gemma; over the whole projection: OLMoE), RoPE, SDPA with the family's softmax scale
    (Gemma's ``query_pre_attn_scalar``) and optional per-head sinks (gpt-oss)."""

    def __init__(self, cfg: AttentionConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.scale = cfg.scale
        self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=cfg.out_bias)
        self.norm_per_head = cfg.qk_norm != "projection"
        self.q_norm = self.k_norm = None
        if cfg.qk_norm is not None:
            if cfg.norm is None:
                raise ValueError("AttentionConfig.qk_norm needs AttentionConfig.norm (its eps and convention)")
            q_dim, k_dim = (self.head_dim, self.head_dim) if self.norm_per_head else (
                self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim)
            self.q_norm = RMSNorm(replace(cfg.norm, dim=q_dim))
            self.k_norm = RMSNorm(replace(cfg.norm, dim=k_dim))
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if cfg.sinks else None

    def weight_groups(self) -> tuple[list[Tensor], list[Tensor]]:
        """(matrices reading the block's input, matrices writing the residual stream), for the init."""
        return [self.wq.weight, self.wk.weight, self.wv.weight], [self.wo.weight]

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | PackedLayout | None, is_causal: bool,
        kv_cache: KVCache | None = None, layer_idx: int = 0,
    ) -> Tensor:
        B, T, _ = x.shape
        q, k = self.wq(x), self.wk(x)
        if self.q_norm is not None and self.k_norm is not None and not self.norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        # -1 heads: under tensor parallelism a rank holds only its share of the heads.
        q = q.view(B, T, -1, self.head_dim)
        k = k.view(B, T, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None and self.norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(layer_idx, k, v)
        out = attend(q, k, v, mask, is_causal, enable_gqa=self.n_kv_heads != self.n_heads, scale=self.scale,
                     sinks=self.sinks)
        return self.wo(out.reshape(B, T, -1))


def attend(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | PackedLayout | None, is_causal: bool, enable_gqa: bool,
    scale: float | None = None, sinks: Tensor | None = None,
) -> Tensor:
    """Attention of q [B, H, T, D] over k, v [B, Hkv, S, D] -> [B, T, H, D].

    ``mask`` is a boolean SDPA mask (or the KV cache's additive one), a :class:`PackedLayout`
    (block-diagonal causal attention per document), or None (``is_causal`` decides). ``scale`` None is
    SDPA's 1/sqrt(D). ``sinks`` [H]: a learned logit per query head that joins every softmax with no
    value (gpt-oss; see :mod:`lmforge.models.layers.sinks`); None leaves every path as it was.
    """
    if isinstance(mask, PackedLayout):
        return attend_packed(q, k, v, mask, enable_gqa, scale, sinks)
    if isinstance(mask, ContextParallelLayout):  # this rank's queries over the cp group's keys
        return attend_context_parallel(q, k, v, mask, enable_gqa, scale, sinks)
    if mask is None and is_causal:
        return causal_attention(q, k, v, enable_gqa, scale, sinks).transpose(1, 2)
    if sinks is not None:
        return sink_attention(q, k, v, sinks, mask, is_causal, enable_gqa, scale).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=enable_gqa,
                                         scale=scale)
    return out.transpose(1, 2)
