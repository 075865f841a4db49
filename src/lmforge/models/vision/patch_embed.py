"""The patch embedding of Qwen's vision towers: each flattened ``[channels, temporal, patch, patch]``
patch (what Qwen's image processor emits, one row per patch) through a Conv3d whose kernel is its stride,
i.e. one linear map per patch, kept a Conv3d so the checkpoint tensor loads as it is."""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["PatchEmbed"]


class PatchEmbed(nn.Module):
    """[n_patches, channels * temporal * patch * patch] pixel rows -> [n_patches, dim]."""

    def __init__(self, patch_size: int, temporal_patch_size: int, in_channels: int, dim: int,
                 bias: bool = False) -> None:
        super().__init__()
        self.shape = (in_channels, temporal_patch_size, patch_size, patch_size)
        self.dim = dim
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, dim, kernel_size=kernel, stride=kernel, bias=bias)

    def forward(self, pixels: Tensor) -> Tensor:
        x = pixels.view(-1, *self.shape).to(self.proj.weight.dtype)
        return self.proj(x).view(-1, self.dim)
