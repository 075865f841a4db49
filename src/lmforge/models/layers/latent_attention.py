"""Multi-head latent attention (MLA: DeepSeek-V2 / V3, Kimi-K2), built from a
:class:`~lmforge.models.configs.LatentAttentionConfig`.

Queries go through an optional low-rank bottleneck (``wq_a`` -> ``q_norm`` -> ``wq_b``; one ``wq`` when
``q_lora_rank`` is None). Keys and values come from one normalised latent of ``kv_lora_rank`` features
per token (``wkv_a`` -> ``kv_norm``) expanded per head by ``wkv_b`` into ``qk_nope_head_dim`` key and
``v_head_dim`` value features, plus a rotary key of ``qk_rope_head_dim`` features that ``wkv_a`` also
produces and every head shares. Each head's query and key are ``[nope | rope]``.

Names follow torchtitan's DeepSeek-V3 (``wq_a``, ``q_norm``, ``wq_b``, ``wkv_a``, ``kv_norm``, ``wkv_b``,
``wo``); the family's state-dict layout maps them onto transformers' ``q_a_proj``, ``q_a_layernorm``,
``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``.

``rope_interleave`` (DeepSeek-V3's): the checkpoint's rotary features are adjacent pairs.
transformers rotates the pairs ``(x[0::2], x[1::2])`` and writes the result de-interleaved
(``[even | odd]``); that is exactly "take ``[x[0::2] | x[1::2]]``, then rotate-half", which is what is
done here with the block's ordinary rotate-half table, so the values are transformers' own.

With a KV cache (:class:`~lmforge.models.layers.kv_cache.KVCache` built by ``for_model`` from
:attr:`LatentAttention.cache_dims`), a layer caches its normalised latent ``[B, 1, S, kv_lora_rank]`` and
its rotated shared key ``[B, 1, S, qk_rope_head_dim]`` (``kv_lora_rank + qk_rope_head_dim`` values per
token instead of ``n_heads * (qk_head_dim + v_head_dim)``); masks, padding and ``select_rows`` are the
cache's usual ones. A prefill expands keys and values from the latents, as transformers does; a decode step
(one new token) absorbs ``wkv_b`` into the query and the output instead, attending over the latents
themselves (``absorb``, on by default; equal to the expanded form up to rounding).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmforge.models.configs import LatentAttentionConfig
from lmforge.models.layers.attention import attend
from lmforge.models.layers.context_attention import ContextParallelLayout
from lmforge.models.layers.norm import RMSNorm
from lmforge.models.layers.packed_attention import PackedLayout
from lmforge.models.layers.rope import apply_rope

if TYPE_CHECKING:  # pragma: no cover
    from lmforge.models.layers.kv_cache import KVCache

__all__ = ["LatentAttention", "deinterleave"]


def deinterleave(x: Tensor) -> Tensor:
    """``[x0, x1, x2, x3, ...]`` -> ``[x0, x2, ..., x1, x3, ...]`` over the last dimension."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class LatentAttention(nn.Module):
    """Multi-head latent attention; ``forward`` has :class:`~lmforge.models.layers.attention.Attention`'s
    signature, with ``cos``/``sin`` the block's rotary table of ``qk_rope_head_dim`` features."""

    def __init__(self, cfg: LatentAttentionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.n_heads = cfg.n_heads
        self.q_lora_rank, self.kv_lora_rank = cfg.q_lora_rank, cfg.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qk_dim = cfg.qk_head_dim
        self.scale = cfg.scale if cfg.scale is not None else self.qk_dim ** -0.5
        self.interleaved = cfg.rope_interleave
        self.absorb = True
        """Decode steps attend on the cached latents directly (see :meth:`_absorbed`); False re-expands
        every cached token's keys and values each step, as transformers does. Only while ``wkv_b`` is a
        plain linear layer (a LoRA adapter or a 4-bit layer on it: expanded, which runs it as it is)."""
        self.wq: nn.Linear | None = None
        self.wq_a: nn.Linear | None = None
        self.q_norm: RMSNorm | None = None
        self.wq_b: nn.Linear | None = None
        if cfg.q_lora_rank is None:
            self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.qk_dim, bias=False)
        else:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(replace(cfg.norm, dim=cfg.q_lora_rank))
            self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.n_heads * self.qk_dim, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(replace(cfg.norm, dim=cfg.kv_lora_rank))
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, cfg.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.v_dim, cfg.dim, bias=False)

    def weight_groups(self) -> tuple[list[Tensor], list[Tensor]]:
        """(matrices reading the block's input or a latent, matrices writing the residual stream), for the init."""
        reads = [self.wq] if self.wq is not None else [self.wq_a, self.wq_b]
        return [m.weight for m in (*reads, self.wkv_a, self.wkv_b)], [self.wo.weight]  # type: ignore[union-attr]

    def _absorbed(self, q_nope: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, mask: Tensor | None,
                  is_causal: bool) -> Tensor:
        """Decode-step attention on the cached latents without expanding them: ``wkv_b``'s key part is
        folded into the queries and its value part applied after the softmax, so a step costs
        ``S * H * (kv_lora_rank + qk_rope_head_dim)`` for the scores instead of expanding all ``S`` cached
        tokens (DeepSeek's "absorb"). Equal to the expanded form up to rounding. -> [B, T, H, v_head_dim]"""
        w = self.wkv_b.weight.view(-1, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_k, w_v = w[:, : self.nope_dim], w[:, self.nope_dim:]  # [H, nope, r], [H, v, r]
        q = torch.cat([torch.einsum("bhtd,hdr->bhtr", q_nope, w_k), q_rope], dim=-1)
        k = torch.cat([latent, k_rope], dim=-1)  # one shared "head" of r + rope features
        out = attend(q, k, latent, mask, is_causal, enable_gqa=True, scale=self.scale)  # [B, T, H, r]
        return torch.einsum("bthr,hvr->bthv", out, w_v)

    @property
    def cache_dims(self) -> tuple[int, int, int]:
        """What a KV cache keeps per token for this layer: (heads, "key" features, "value" features) =
        (1, the latent, the rotated shared key)."""
        return 1, self.kv_lora_rank, self.rope_dim

    def queries(self, x: Tensor) -> Tensor:
        """[B, T, dim] -> [B, H, T, qk_head_dim], rotary part not yet rotated."""
        B, T, _ = x.shape
        if self.wq is not None:
            q = self.wq(x)
        else:
            q = self.wq_b(self.q_norm(self.wq_a(x)))  # type: ignore[misc]
        return q.view(B, T, -1, self.qk_dim).transpose(1, 2)

    def latents(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """[B, T, dim] -> (normalised latent [B, 1, T, kv_lora_rank], shared rotary key [B, 1, T, rope_dim],
        not yet rotated)."""
        kv, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return self.kv_norm(kv).unsqueeze(1), k_rope.unsqueeze(1)

    def expand(self, latent: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor]:
        """(latent [B, 1, S, r], rotated key [B, 1, S, rope_dim]) -> keys [B, H, S, qk_head_dim], values
        [B, H, S, v_head_dim]."""
        B, _, S, _ = latent.shape
        kv = self.wkv_b(latent.squeeze(1)).view(B, S, -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        return k, v

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | PackedLayout | None, is_causal: bool,
        kv_cache: KVCache | None = None, layer_idx: int = 0,
    ) -> Tensor:
        B, T, _ = x.shape
        q_nope, q_rope = self.queries(x).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.latents(x)
        if self.interleaved:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope, cos, sin)
        if kv_cache is not None:
            latent, k_rope = kv_cache.update(layer_idx, latent, k_rope)
            if T == 1 and self.absorb and type(self.wkv_b) is nn.Linear:  # adapters, 4-bit: expand instead
                return self.wo(self._absorbed(q_nope, q_rope, latent, k_rope, mask, is_causal).reshape(B, T, -1))
        q = torch.cat([q_nope, q_rope], dim=-1)
        k, v = self.expand(latent, k_rope)
        pad = self.qk_dim - self.v_dim if isinstance(mask, ContextParallelLayout) else 0
        if pad:  # the context-parallel gather stacks k and v: give v k's width, then drop the zeros
            v = F.pad(v, (0, pad))
        out = attend(q, k, v, mask, is_causal, enable_gqa=False, scale=self.scale)
        if pad:
            out = out[..., : self.v_dim]
        return self.wo(out.reshape(B, T, -1))
