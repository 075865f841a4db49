"""Rotary position embeddings in the Hugging Face ``rotate_half`` layout, with the frequency schemes a
:class:`~lmforge.models.configs.RopeConfig` names (default, ``linear``, Llama 3.1's ``llama3``, ``yarn``).

Using Hugging Face's layout (not Meta's interleaved one) is what lets Hugging Face checkpoints load
by renaming tensors alone, with no permutation of the q/k projections.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from lmforge.models.configs import RopeConfig

__all__ = ["ROPE_TYPES", "RotaryEmbedding", "apply_rope", "rope_frequencies", "yarn_mscale"]

ROPE_TYPES = ("default", "llama3", "linear", "yarn")
"""Frequency schemes computed once from the config (no run-time state)."""


def rope_kind(scaling: Mapping[str, Any] | None) -> str:
    """The scheme a Hugging Face ``rope_scaling`` dict names (``default`` for None)."""
    return "default" if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(factor) + 1`` (1 for ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(inv: Tensor, cfg: RopeConfig, sc: Mapping[str, Any]) -> tuple[Tensor, float]:
    """YaRN (arXiv 2309.00071): frequencies that rotate more than ``beta_fast`` times over the original
    context keep their value, those under ``beta_slow`` are slowed by ``factor``, a linear ramp between;
    cos and sin are scaled by the attention factor (``mscale`` / ``mscale_all_dim`` as DeepSeek sets them)."""
    old_ctx = float(sc["original_max_position_embeddings"])
    factor = float(sc.get("factor") or cfg.max_seq_len / old_ctx)
    attention = sc.get("attention_factor")
    if attention is None:
        m, m_all = sc.get("mscale"), sc.get("mscale_all_dim")
        attention = yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)
    dim, base = cfg.dim, cfg.theta

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(sc.get("beta_fast") or 32), correction_dim(sc.get("beta_slow") or 1)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(inv.device)
    keep = 1 - ramp
    return inv / factor * (1 - keep) + inv * keep, float(attention)


def rope_frequencies(cfg: RopeConfig, device: torch.device | str | None) -> tuple[Tensor, float]:
    """(inverse frequencies [dim / 2], the factor cos and sin are scaled by) of one rotary table."""
    hd = cfg.dim
    inv = 1.0 / (cfg.theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd))
    sc = cfg.scaling
    kind = rope_kind(sc)
    if kind == "default":
        return inv, 1.0
    if kind == "linear":  # positions divided by `factor`, i.e. every frequency slowed down
        return inv / float(sc["factor"]), 1.0
    if kind == "yarn":
        return _yarn(inv, cfg, sc)
    # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, and the band
    # in between interpolated smoothly.
    factor = float(sc["factor"])
    low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old_ctx = float(sc["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled), 1.0


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions ``[0, max_seq_len)``, always kept in fp32.

    The tables are non-persistent buffers (never checkpointed). ``_apply`` is overridden so
    that ``model.to(torch.bfloat16)`` does not round them: they are rebuilt in fp32 instead.
    """

    def __init__(self, cfg: RopeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.rebuild()

    def rebuild(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the tables, e.g. after ``to_empty`` from the meta device."""
        device = self.cos.device if device is None else device
        if torch.device(device).type == "meta":
            shape = (self.cfg.max_seq_len, self.cfg.dim)
            self.cos = torch.empty(shape, device="meta")
            self.sin = torch.empty(shape, device="meta")
            return
        inv, attention_factor = rope_frequencies(self.cfg, device)
        pos = torch.arange(self.cfg.max_seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        # sin carries rotate_half's sign (first half negated), so applying RoPE needs only
        # a roll of x instead of split + negate + concat: x*cos + roll(x, hd/2)*sin.
        half = emb.shape[-1] // 2
        cos, sin = emb.cos(), emb.sin()
        if attention_factor != 1.0:  # YaRN: as transformers, scaled in fp32 before the cast
            cos, sin = cos * attention_factor, sin * attention_factor
        sin[:, :half].neg_()
        self.cos, self.sin = cos, sin

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        super()._apply(fn, recurse)
        if self.cos.dtype != torch.float32:
            self.rebuild(self.cos.device)
        return self

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Gather tables for ``position_ids`` [B, T] -> cos, signed sin [B, 1, T, head_dim] in ``dtype``.

        The cast to the activation dtype matches Hugging Face, so bf16 runs agree with it too.
        """
        cos = self.cos[position_ids].unsqueeze(1).to(dtype)
        sin = self.sin[position_ids].unsqueeze(1).to(dtype)
        return cos, sin


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotate [B, H, T, head_dim] by the given angles (Hugging Face ``rotate_half`` layout).

    Equals ``x * cos + rotate_half(x) * sin`` exactly, with ``signed_sin`` as produced by
    ``RotaryEmbedding`` (its first half negated).
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
