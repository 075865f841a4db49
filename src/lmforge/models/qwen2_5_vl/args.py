"""Qwen2.5-VL's arguments (:class:`Qwen2_5_VLArgs`) and its named sizes.

The language model is Qwen2's decoder (q/k/v biases) whose RoPE is multimodal (``mrope_section``); the
vision tower is a ViT over 14x14 patches of two frames with a 2-D RoPE, RMSNorm, gated SiLU MLPs with
biases, window attention except in ``vision_full_attention_layers``, and a merger that joins each
``merge x merge`` block of patches into one token of the language model's width.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmforge.errors import UserError
from lmforge.models.args import ModelArgs

__all__ = ["QWEN2_5_VL_SIZES", "Qwen2_5_VLArgs"]

VISION_NORM_EPS = 1e-6
"""transformers builds the tower's RMSNorms (blocks and merger) with eps 1e-6 whatever the config says."""


@dataclass
class Qwen2_5_VLArgs(ModelArgs):
    """``ModelArgs`` of the language model plus the vision tower's (``vision_*``) and the special tokens.
    Defaults are transformers' ``Qwen2_5_VLVisionConfig``'s (its 7B tower)."""

    vision_depth: int = 32
    vision_dim: int = 1280
    vision_ffn_dim: int = 3420
    vision_heads: int = 16
    vision_in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    """Side of an attention window in pixels (``window_size // merge // patch`` merged tokens)."""
    vision_full_attention_layers: list[int] = field(default_factory=lambda: [7, 15, 23, 31])
    """Blocks attending over the whole image; the others attend within windows."""
    vision_rope_theta: float = 10000.0
    tokens_per_second: int = 4
    """Video timing (kept for export; lmforge reads images, not videos)."""
    mrope_section: list[int] = field(default_factory=lambda: [16, 24, 24])
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    qkv_bias: bool = True
    hf_model_type: str = "qwen2_5_vl"

    def __post_init__(self) -> None:
        super().__post_init__()
        self.vision_full_attention_layers = sorted(int(i) for i in self.vision_full_attention_layers)
        self.mrope_section = [int(n) for n in self.mrope_section]
        if self.vision_dim % self.vision_heads or (self.vision_dim // self.vision_heads) % 4:
            raise UserError(f"vision_dim {self.vision_dim} must split into {self.vision_heads} heads of a multiple "
                            "of 4 features (the 2-D RoPE rotates a quarter per axis)")
        if any(not 0 <= i < self.vision_depth for i in self.vision_full_attention_layers):
            raise UserError(f"vision_full_attention_layers must be block indices in [0, {self.vision_depth})")
        if len(self.mrope_section) != 3 or 2 * sum(self.mrope_section) != self.head_dim:
            raise UserError(f"mrope_section {self.mrope_section} must have three parts summing to head_dim / 2 = "
                            f"{self.head_dim // 2}")
        if self.window_size < self.spatial_merge_size * self.patch_size:
            raise UserError(f"window_size {self.window_size} is smaller than one merged token "
                            f"({self.spatial_merge_size * self.patch_size} pixels)")
        if not self.qkv_bias:
            raise UserError("Qwen2.5-VL's language model has q/k/v biases: qkv_bias must be true")

    @property
    def vision_head_dim(self) -> int:
        return self.vision_dim // self.vision_heads

    @property
    def window_tokens(self) -> int:
        """Side of an attention window in merged tokens."""
        return self.window_size // self.spatial_merge_size // self.patch_size


_TOWER = dict(vision_depth=32, vision_dim=1280, vision_ffn_dim=3420, vision_heads=16, window_size=112,
              vision_full_attention_layers=[7, 15, 23, 31], tokens_per_second=2, mrope_section=[16, 24, 24])
# Copied from the published config.json files (Qwen/Qwen2.5-VL-3B-Instruct, Qwen/Qwen2.5-VL-7B-Instruct);
# vocab_size comes from the tokenizer.
QWEN2_5_VL_SIZES: dict[str, dict[str, Any]] = {
    "qwen2.5-vl-3b": dict(dim=2048, n_layers=36, n_heads=16, n_kv_heads=2, ffn_hidden_dim=11008, norm_eps=1e-6,
                          rope_theta=1000000.0, max_seq_len=128000, tie_embeddings=True, **_TOWER),
    "qwen2.5-vl-7b": dict(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_hidden_dim=18944, norm_eps=1e-6,
                          rope_theta=1000000.0, max_seq_len=128000, tie_embeddings=False, **_TOWER),
    # A tiny random model for CPU runs (configs/sft_vlm_debug.toml) with the byte tokenizer: its image ids sit in
    # the byte vocabulary's padding (263-319), which the tokenizer never produces.
    "qwen2.5-vl-debug": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_dim=384, norm_eps=1e-6,
                             rope_theta=10000.0, max_seq_len=1024, tie_embeddings=True, vision_depth=2,
                             vision_dim=64, vision_ffn_dim=128, vision_heads=2, window_size=112,
                             vision_full_attention_layers=[1], mrope_section=[4, 6, 6], image_token_id=300,
                             video_token_id=301, vision_start_token_id=302, vision_end_token_id=303),
}
