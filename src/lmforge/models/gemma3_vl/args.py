"""Gemma 3's multimodal arguments (:class:`Gemma3VLArgs`): the Gemma 3 text decoder's ``ModelArgs`` plus
the SigLIP vision tower's (``vision_*``), the projector's token count and the special tokens."""

from __future__ import annotations

from dataclasses import dataclass

from lmforge.errors import UserError
from lmforge.models.args import ModelArgs

__all__ = ["Gemma3VLArgs"]


@dataclass
class Gemma3VLArgs(ModelArgs):
    """Defaults are transformers' ``Gemma3Config`` vision tower (SigLIP so400m, 896x896 images)."""

    vision_depth: int = 27
    vision_dim: int = 1152
    vision_ffn_dim: int = 4304
    vision_heads: int = 16
    vision_in_channels: int = 3
    image_size: int = 896
    patch_size: int = 14
    vision_norm_eps: float = 1e-6
    mm_tokens_per_image: int = 256
    """Image tokens per image: the tower's patches average-pooled to a square of this many."""
    image_token_id: int = 262144
    boi_token_id: int = 255999
    eoi_token_id: int = 256000
    hf_model_type: str = "gemma3"

    def __post_init__(self) -> None:
        super().__post_init__()
        side, tokens = self.patches_per_side, int(round(self.mm_tokens_per_image ** 0.5))
        if self.image_size % self.patch_size:
            raise UserError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if tokens * tokens != self.mm_tokens_per_image or side % tokens:
            raise UserError(f"mm_tokens_per_image {self.mm_tokens_per_image} must be a square whose side divides the "
                            f"{side} patches per side")
        if self.vision_dim % self.vision_heads:
            raise UserError(f"vision_dim {self.vision_dim} is not divisible by its {self.vision_heads} heads")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size
