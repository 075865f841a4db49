"""Qwen2.5-VL's vision tower: patch embedding, blocks of RMSNorm -> attention (2-D RoPE, within windows of
``window_tokens x window_tokens`` merged tokens, or within the whole image in the full-attention blocks)
-> RMSNorm -> gated SiLU MLP with biases, and the merger (RMSNorm, then each ``merge x merge`` block of
patches through Linear-GELU-Linear into one token of the language model's width).

Window attention needs each window's patches to be contiguous, so the tower reorders the patches
window by window once after the embedding (a permutation of merge blocks within each image) and undoes
it after the merger, as transformers does; images stay contiguous, so full attention sees each image
whole. Module names follow the checkpoints', so the tower's tensors load by their names.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lmforge.models.configs import MLPConfig, NormConfig
from lmforge.models.layers.mlp import gated_unit
from lmforge.models.layers.norm import RMSNorm
from lmforge.models.qwen2_5_vl.args import VISION_NORM_EPS, Qwen2_5_VLArgs
from lmforge.models.vision import PatchEmbed, VisionAttention, segment_lengths, vision_rope

__all__ = ["PatchMerger", "VisionBlock", "VisionTransformer", "window_order"]


def window_order(grid_thw: Tensor, merge: int, window: int) -> tuple[Tensor, list[int]]:
    """(the merge blocks in window order [n_blocks], the windows' sizes in patches). Windows tile each
    frame from its top-left corner, ``window x window`` merge blocks each (smaller at the right and bottom
    edges); blocks keep their row-major order inside a window."""
    order, lengths, offset = [], [], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        for f in range(t):
            for r in range(0, gh, window):
                for c in range(0, gw, window):
                    block = index[f, r:r + window, c:c + window].flatten()
                    order.append(block + offset)
                    lengths.append(block.numel() * merge * merge)
        offset += t * gh * gw
    return torch.cat(order).to(grid_thw.device), lengths


class VisionMLP(nn.Module):
    """``down(silu(gate x) * up x)`` with biases (lmforge's gated unit under the checkpoint's names)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.cfg = MLPConfig(dim, hidden, "silu", bias=True)
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(gated_unit(self.gate_proj(x), self.up_proj(x), self.cfg))


class VisionBlock(nn.Module):
    def __init__(self, args: Qwen2_5_VLArgs) -> None:
        super().__init__()
        norm = NormConfig(args.vision_dim, VISION_NORM_EPS)
        self.norm1, self.norm2 = RMSNorm(norm), RMSNorm(norm)
        self.attn = VisionAttention(args.vision_dim, args.vision_heads)
        self.mlp = VisionMLP(args.vision_dim, args.vision_ffn_dim)

    def forward(self, x: Tensor, lengths: list[int], cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x), lengths, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm over each patch, then each ``merge x merge`` block (consecutive patches) as one row through
    Linear -> GELU -> Linear to ``out_dim``."""

    def __init__(self, dim: int, out_dim: int, merge: int) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.ln_q = RMSNorm(NormConfig(dim, VISION_NORM_EPS))
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class VisionTransformer(nn.Module):
    """pixel rows [n_patches, channels * temporal * patch**2] and ``grid_thw`` [n_images, 3] -> (one
    feature per merged token [n_patches / merge**2, dim of the language model], images in order; no
    DeepStack features)."""

    def __init__(self, args: Qwen2_5_VLArgs) -> None:
        super().__init__()
        self.args = args
        self.merge = args.spatial_merge_size
        self.patch_embed = PatchEmbed(args.patch_size, args.temporal_patch_size, args.vision_in_channels,
                                      args.vision_dim)
        self.blocks = nn.ModuleList(VisionBlock(args) for _ in range(args.vision_depth))
        self.merger = PatchMerger(args.vision_dim, args.dim, self.merge)
        self.full_attention = set(args.vision_full_attention_layers)

    def forward(self, pixels: Tensor, grid_thw: Tensor) -> tuple[Tensor, list[Tensor]]:
        unit = self.merge * self.merge
        order, windows = window_order(grid_thw, self.merge, self.args.window_tokens)
        frames = segment_lengths(grid_thw)
        x = self.patch_embed(pixels)
        n = x.shape[0]

        def windowed(t: Tensor) -> Tensor:  # merge blocks into window order
            return t.reshape(n // unit, unit, -1)[order].reshape(n, -1)

        x = windowed(x)
        cos, sin = (windowed(t) for t in vision_rope(grid_thw, self.merge, self.args.vision_head_dim,
                                                    self.args.vision_rope_theta))
        for i, block in enumerate(self.blocks):
            x = block(x, frames if i in self.full_attention else windows, cos, sin)
        return self.merger(x)[torch.argsort(order)], []

    def init_weights(self, std: float = 0.02) -> None:
        """N(0, std) matrices, zero biases, unit norms (a tower trained from scratch; checkpoints overwrite it)."""
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Conv3d)):
                    nn.init.normal_(m.weight, 0.0, std)
                    if m.bias is not None:
                        m.bias.zero_()
                elif isinstance(m, RMSNorm):
                    m.reset_parameters()


