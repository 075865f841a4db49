"""Qwen3-VL's arguments (:class:`Qwen3VLArgs`) and its named sizes.

The language model is Qwen3's decoder (per-head q/k RMSNorm, explicit ``head_dim``) whose RoPE is
multimodal with interleaved axes; the vision tower is a ViT over 16x16 patches of two frames with a
learned position table resampled to each image's grid, the 2-D RoPE, LayerNorms, a GELU MLP (tanh
approximation) and full attention in every block; a merger joins each ``merge x merge`` block of patches
into one token, and DeepStack mergers take the outputs of ``deepstack_layers`` to add to the first
decoder blocks' outputs at the image tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmforge.errors import UserError
from lmforge.models.args import ModelArgs

__all__ = ["QWEN3_VL_SIZES", "Qwen3VLArgs", "VISION_NORM_EPS"]

VISION_NORM_EPS = 1e-6
"""transformers builds the tower's LayerNorms (blocks and mergers) with eps 1e-6 whatever the config says."""


@dataclass
class Qwen3VLArgs(ModelArgs):
    """``ModelArgs`` of the language model plus the vision tower's (``vision_*``) and the special tokens.
    Defaults are transformers' ``Qwen3VLVisionConfig``'s."""

    vision_depth: int = 27
    vision_dim: int = 1152
    vision_ffn_dim: int = 4304
    vision_heads: int = 16
    vision_in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    vision_positions: int = 2304
    """Entries of the learned position table (a square grid, resampled bilinearly to each image)."""
    deepstack_layers: list[int] = field(default_factory=lambda: [8, 16, 24])
    """Tower blocks whose outputs (each through its own merger) are added to decoder blocks 0, 1, ..."""
    vision_rope_theta: float = 10000.0
    mrope_section: list[int] = field(default_factory=lambda: [24, 20, 20])
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    qk_norm: bool = True
    hf_model_type: str = "qwen3_vl"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.deepstack_layers = [int(i) for i in self.deepstack_layers]
        self.mrope_section = [int(n) for n in self.mrope_section]
        if self.vision_dim % self.vision_heads or (self.vision_dim // self.vision_heads) % 4:
            raise UserError(f"vision_dim {self.vision_dim} must split into {self.vision_heads} heads of a multiple "
                            "of 4 features (the 2-D RoPE rotates a quarter per axis)")
        if any(not 0 <= i < self.vision_depth for i in self.deepstack_layers):
            raise UserError(f"deepstack_layers must be block indices in [0, {self.vision_depth})")
        if len(self.deepstack_layers) > self.n_layers:
            raise UserError(f"{len(self.deepstack_layers)} deepstack_layers feed more decoder blocks than the "
                            f"{self.n_layers} there are")
        if len(self.mrope_section) != 3 or 2 * sum(self.mrope_section) != self.head_dim:
            raise UserError(f"mrope_section {self.mrope_section} must have three parts summing to head_dim / 2 = "
                            f"{self.head_dim // 2}")
        side = int(self.vision_positions ** 0.5)
        if side * side != self.vision_positions:
            raise UserError(f"vision_positions {self.vision_positions} must be a square number (a grid of positions)")
        if not self.qk_norm:
            raise UserError("Qwen3-VL's language model normalises q and k: qk_norm must be true")

    @property
    def vision_head_dim(self) -> int:
        return self.vision_dim // self.vision_heads


# The 8B model: Qwen3-8B's decoder shape with transformers' default tower (Qwen/Qwen3-VL-8B-Instruct);
# vocab_size comes from the tokenizer.
QWEN3_VL_SIZES: dict[str, dict[str, Any]] = {
    "qwen3-vl-8b": dict(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, ffn_hidden_dim=12288,
                        norm_eps=1e-6, rope_theta=5000000.0, max_seq_len=262144, tie_embeddings=False,
                        vision_depth=27, vision_dim=1152, vision_ffn_dim=4304, vision_heads=16,
                        deepstack_layers=[8, 16, 24], mrope_section=[24, 20, 20]),
}
