"""FLOPs of Qwen2.5-VL's vision tower for a batch of images (the language model's are the decoder's,
:mod:`lmforge.models.flops`, counted over the text and image tokens alike).

Matmuls only, 2 FLOPs per multiply-add, as :func:`lmforge.models.flops.flops_per_token` counts: the patch
embedding, each block's qkv / output / gated MLP projections and its attention scores and values within
each window (or each frame in the full-attention blocks), and the merger's two layers. Norms, RoPE,
softmax and activations are elementwise and left out. Training is three forwards' worth (the backward
computes two products per forward one)."""

from __future__ import annotations

from torch import Tensor

from lmforge.models.qwen2_5_vl.args import Qwen2_5_VLArgs
from lmforge.models.qwen2_5_vl.vision import window_order
from lmforge.models.vision import segment_lengths

__all__ = ["vision_flops"]


def vision_flops(args: Qwen2_5_VLArgs, grid_thw: Tensor, training: bool = True) -> float:
    """FLOPs of the vision tower over the images of ``grid_thw`` [n_images, 3] (forward only with
    ``training=False``)."""
    d, unit = args.vision_dim, args.spatial_merge_size ** 2
    n = int(grid_thw.prod(-1).sum())
    patch = args.vision_in_channels * args.temporal_patch_size * args.patch_size ** 2
    frames = segment_lengths(grid_thw)
    windows = window_order(grid_thw, args.spatial_merge_size, args.window_tokens)[1]
    forward = 2.0 * n * patch * d
    for i in range(args.vision_depth):
        segments = frames if i in args.vision_full_attention_layers else windows
        forward += 2.0 * n * (4 * d * d + 3 * d * args.vision_ffn_dim) + 4.0 * d * sum(L * L for L in segments)
    hidden = d * unit
    forward += 2.0 * (n // unit) * (hidden * hidden + hidden * args.dim)
    return 3 * forward if training else forward
