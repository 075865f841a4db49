"""Bidirectional self-attention over a packed sequence of image patches: each segment (an image's
frame, or a window of one) attends only within itself, as transformers' SDPA path computes it (one SDPA
call per segment, no mask), with the 2-D rotary embedding applied in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmforge.models.layers.rope import apply_rope

__all__ = ["VisionAttention", "segment_lengths"]


def segment_lengths(grid_thw: Tensor) -> list[int]:
    """Patches per attention segment when every frame of every image is one segment."""
    return [h * w for t, h, w in grid_thw.tolist() for _ in range(t)]


class VisionAttention(nn.Module):
    """Fused ``qkv`` projection (with bias) and output ``proj``, named as Qwen's checkpoints name them."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"vision dim {dim} is not divisible by its {n_heads} heads")
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x: Tensor, lengths: list[int], cos: Tensor, sin: Tensor) -> Tensor:
        """``x`` [n, dim]; ``lengths`` the segments' sizes in order (summing to n); cos/sin [n, head_dim]."""
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.n_heads, -1).permute(1, 0, 2, 3).unbind(0)
        c, s = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
        q, k = apply_rope(q.float(), c, s).to(x.dtype), apply_rope(k.float(), c, s).to(x.dtype)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, n, D]
        outs = [F.scaled_dot_product_attention(qs, ks, vs) for qs, ks, vs in
                zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2))]
        out = torch.cat(outs, dim=2).squeeze(0).transpose(0, 1).reshape(n, -1)
        return self.proj(out)
