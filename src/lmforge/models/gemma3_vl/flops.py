"""FLOPs of Gemma 3's SigLIP tower and projector for ``n_images`` images (the language model's are the
decoder's). Matmuls only, 2 FLOPs per multiply-add: the patch embedding, each block's q/k/v/out and MLP
projections and its attention over the image's patches, the projector's matrix. Norms, pooling and
activations are left out. Training is three forwards' worth."""

from __future__ import annotations

from lmforge.models.gemma3_vl.args import Gemma3VLArgs

__all__ = ["vision_flops"]


def vision_flops(args: Gemma3VLArgs, n_images: int, training: bool = True) -> float:
    """FLOPs of the tower and projector over ``n_images`` images (forward only with ``training=False``)."""
    d, P = args.vision_dim, args.patches_per_side ** 2
    per_image = 2.0 * P * args.vision_in_channels * args.patch_size ** 2 * d
    per_image += args.vision_depth * (2.0 * P * (4 * d * d + 2 * d * args.vision_ffn_dim) + 4.0 * d * P * P)
    per_image += 2.0 * args.mm_tokens_per_image * d * args.dim
    return (3 if training else 1) * n_images * per_image
