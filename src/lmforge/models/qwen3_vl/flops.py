"""FLOPs of Qwen3-VL's vision tower for a batch of images (the language model's are the decoder's).

Matmuls only, 2 FLOPs per multiply-add, as :mod:`lmforge.models.qwen2_5_vl.flops` counts them: the patch
embedding, each block's qkv / output / MLP projections and its attention within each frame, the merger and
the DeepStack mergers. The position table's resampling (four rows per patch), norms, RoPE, softmax and
activations are elementwise and left out. Training is three forwards' worth."""

from __future__ import annotations

from torch import Tensor

from lmforge.models.qwen3_vl.args import Qwen3VLArgs
from lmforge.models.vision import segment_lengths

__all__ = ["vision_flops"]


def vision_flops(args: Qwen3VLArgs, grid_thw: Tensor, training: bool = True) -> float:
    """FLOPs of the vision tower over the images of ``grid_thw`` [n_images, 3] (forward only with
    ``training=False``)."""
    d, unit = args.vision_dim, args.spatial_merge_size ** 2
    n = int(grid_thw.prod(-1).sum())
    patch = args.vision_in_channels * args.temporal_patch_size * args.patch_size ** 2
    attention = 4.0 * d * sum(L * L for L in segment_lengths(grid_thw))
    forward = 2.0 * n * patch * d
    forward += args.vision_depth * (2.0 * n * (4 * d * d + 2 * d * args.vision_ffn_dim) + attention)
    hidden = d * unit
    forward += (1 + len(args.deepstack_layers)) * 2.0 * (n // unit) * (hidden * hidden + hidden * args.dim)
    return 3 * forward if training else forward
