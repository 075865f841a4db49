"""Qwen3-VL's vision tower: patch embedding (with bias) plus a learned position table resampled to each
image's grid, blocks of LayerNorm -> attention within each frame (2-D RoPE) -> LayerNorm -> GELU MLP, the
merger (LayerNorm per patch, then each ``merge x merge`` block through Linear-GELU-Linear into one
token of the language model's width), and one DeepStack merger per ``deepstack_layers`` block (LayerNorm
over the joined block instead) whose features the decoder adds to its first blocks' outputs.

Module names follow the checkpoints', so the tower's tensors load by their names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmforge.models.qwen3_vl.args import VISION_NORM_EPS, Qwen3VLArgs
from lmforge.models.vision import PatchEmbed, VisionAttention, segment_lengths, vision_rope
from lmforge.models.vision.rotary import patch_positions

__all__ = ["PatchMerger", "VisionBlock", "VisionTransformer", "position_taps"]


def _axis_taps(index: Tensor, size: Tensor, side: int) -> tuple[Tensor, Tensor]:
    """The two table rows each of ``index`` (of an axis of ``size``) reads, and their weights: bilinear
    with the corners aligned, as ``F.interpolate(align_corners=True)``."""
    src = index.to(torch.float32) * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(0, 2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def position_taps(grid_thw: Tensor, side: int, merge: int) -> tuple[Tensor, Tensor]:
    """(rows of the ``side x side`` position table [n_patches, 4], their weights [n_patches, 4]) of every
    patch in the processor's order: the table resampled bilinearly (corners aligned) to each image's grid."""
    pos = patch_positions(grid_thw, merge)
    sizes = torch.cat([torch.tensor([[h, w]]).expand(t * h * w, 2) for t, h, w in grid_thw.tolist()]).to(pos.device)
    h_taps, h_weights = _axis_taps(pos[:, 0], sizes[:, 0], side)
    w_taps, w_weights = _axis_taps(pos[:, 1], sizes[:, 1], side)
    taps = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return taps, weights


class VisionMLP(nn.Module):
    """``fc2(gelu_tanh(fc1 x))`` with biases."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden)
        self.linear_fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, args: Qwen3VLArgs) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(args.vision_dim, eps=VISION_NORM_EPS)
        self.norm2 = nn.LayerNorm(args.vision_dim, eps=VISION_NORM_EPS)
        self.attn = VisionAttention(args.vision_dim, args.vision_heads)
        self.mlp = VisionMLP(args.vision_dim, args.vision_ffn_dim)

    def forward(self, x: Tensor, lengths: list[int], cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x), lengths, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm (over each patch, or over the joined block: ``after_join``, the DeepStack mergers'), then
    each ``merge x merge`` block of consecutive patches through Linear -> GELU -> Linear to ``out_dim``."""

    def __init__(self, dim: int, out_dim: int, merge: int, after_join: bool) -> None:
        super().__init__()
        self.hidden, self.after_join = dim * merge * merge, after_join
        self.norm = nn.LayerNorm(self.hidden if after_join else dim, eps=VISION_NORM_EPS)
        self.linear_fc1 = nn.Linear(self.hidden, self.hidden)
        self.linear_fc2 = nn.Linear(self.hidden, out_dim)

    def forward(self, x: Tensor) -> Tensor:
        x = self.norm(x.view(-1, self.hidden) if self.after_join else x).view(-1, self.hidden)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTransformer(nn.Module):
    """pixel rows [n_patches, channels * temporal * patch**2] and ``grid_thw`` [n_images, 3] -> (one feature
    per merged token [n_patches / merge**2, dim of the language model], images in order; the DeepStack
    features, one such tensor per ``deepstack_layers`` block)."""

    def __init__(self, args: Qwen3VLArgs) -> None:
        super().__init__()
        self.args = args
        merge = args.spatial_merge_size
        self.patch_embed = PatchEmbed(args.patch_size, args.temporal_patch_size, args.vision_in_channels,
                                      args.vision_dim, bias=True)
        self.pos_embed = nn.Embedding(args.vision_positions, args.vision_dim)
        self.side = int(args.vision_positions ** 0.5)
        self.blocks = nn.ModuleList(VisionBlock(args) for _ in range(args.vision_depth))
        self.merger = PatchMerger(args.vision_dim, args.dim, merge, after_join=False)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(args.vision_dim, args.dim, merge, after_join=True)
                                                   for _ in args.deepstack_layers)

    def forward(self, pixels: Tensor, grid_thw: Tensor) -> tuple[Tensor, list[Tensor]]:
        merge = self.args.spatial_merge_size
        taps, weights = position_taps(grid_thw, self.side, merge)
        x = self.patch_embed(pixels)
        x = x + (self.pos_embed(taps) * weights[:, :, None]).sum(1).to(x.dtype)
        cos, sin = vision_rope(grid_thw, merge, self.args.vision_head_dim, self.args.vision_rope_theta)
        frames = segment_lengths(grid_thw)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, frames, cos, sin)
            if i in self.args.deepstack_layers:
                deepstack.append(self.deepstack_merger_list[self.args.deepstack_layers.index(i)](x))
        return self.merger(x), deepstack

    def init_weights(self, std: float = 0.02) -> None:
        """N(0, std) matrices and position table, zero biases, unit LayerNorms (a tower trained from scratch)."""
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Conv3d, nn.Embedding)):
                    nn.init.normal_(m.weight, 0.0, std)
                    if getattr(m, "bias", None) is not None:
                        m.bias.zero_()
                elif isinstance(m, nn.LayerNorm):
                    m.reset_parameters()
