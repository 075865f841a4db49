"""The 2-D rotary embedding of image patches (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): a quarter of each head's
features rotates with the patch's row, a quarter with its column (the same frequencies for both), in
the ``rotate_half`` layout. Patches come in the order the image processor emits them: merge blocks of
``merge x merge`` patches, row-major over the blocks and within each block."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["patch_positions", "vision_rope"]


def patch_positions(grid_thw: Tensor, merge: int) -> Tensor:
    """(row, column) of every patch [n_patches, 2], images one after another, each frame of an image
    repeating its rows and columns."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        blocks = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(blocks).transpose(1, 2).flatten()
        cols = cols.reshape(blocks).transpose(1, 2).flatten()
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out).to(grid_thw.device)


def vision_rope(grid_thw: Tensor, merge: int, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and signed sin [n_patches, head_dim] in fp32 for :func:`~lmforge.models.layers.rope.apply_rope`
    (sin's first half negated, so ``x * cos + roll(x) * sin`` is ``x * cos + rotate_half(x) * sin``).
    Computed as transformers does (its inverse frequencies over ``head_dim // 2``), so the angles are the
    same bits."""
    pos = patch_positions(grid_thw, merge)
    half = head_dim // 2
    inv = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float, device=pos.device) / half))
    freqs = pos[..., None].float() * inv  # [n, 2, head_dim // 4]
    freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)
