"""Rotary position embeddings in the Hugging Face ``rotate_half`` layout, with the frequency schemes
``ModelArgs.rope_scaling`` names (default, Llama 3.1's ``llama3``, ``linear``).

Using Hugging Face's layout (not Meta's interleaved one) is what lets Hugging Face checkpoints load
by renaming tensors alone, with no permutation of the q/k projections.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lmforge.models.args import ModelArgs

__all__ = ["RotaryEmbedding", "apply_rope", "rope_inv_freq"]


def rope_inv_freq(args: ModelArgs, device: torch.device | str | None, local: bool = False) -> Tensor:
    """Inverse frequencies [head_dim / 2] of ``args``' RoPE, after its ``rope_scaling`` (if any).

    ``local``: the sliding layers' RoPE (``local_rope_theta``, never scaled), as Gemma 3 has.
    """
    hd = args.head_dim
    theta = args.local_rope_theta if local and args.local_rope_theta is not None else args.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd))
    sc = None if local else args.rope_scaling
    kind = None if sc is None else sc.get("rope_type", sc.get("type"))
    if kind is None or kind == "default":
        return inv
    if kind == "linear":  # positions divided by `factor`, i.e. every frequency slowed down
        return inv / float(sc["factor"])
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
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions ``[0, max_seq_len)``, always kept in fp32.

    The tables are non-persistent buffers (never checkpointed). ``_apply`` is overridden so
    that ``model.to(torch.bfloat16)`` does not round them: they are rebuilt in fp32 instead.
    """

    def __init__(self, args: ModelArgs, local: bool = False) -> None:
        super().__init__()
        self.args = args
        self.local = local
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.rebuild()

    def rebuild(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the tables, e.g. after ``to_empty`` from the meta device."""
        device = self.cos.device if device is None else device
        if torch.device(device).type == "meta":
            shape = (self.args.max_seq_len, self.args.head_dim)
            self.cos = torch.empty(shape, device="meta")
            self.sin = torch.empty(shape, device="meta")
            return
        inv = rope_inv_freq(self.args, device, self.local)
        pos = torch.arange(self.args.max_seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        # sin carries rotate_half's sign (first half negated), so applying RoPE needs only
        # a roll of x instead of split + negate + concat: x*cos + roll(x, hd/2)*sin.
        half = emb.shape[-1] // 2
        sin = emb.sin()
        sin[:, :half].neg_()
        self.cos, self.sin = emb.cos(), sin

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
