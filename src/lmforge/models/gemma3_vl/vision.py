"""Gemma 3's image side: the SigLIP vision tower (patches of a fixed-size image through a Conv2d, a learned
position per patch, pre-LayerNorm blocks of bidirectional attention and a tanh-GELU MLP, a final
LayerNorm) and the projector (the patches average-pooled to ``mm_tokens_per_image``, Gemma's RMSNorm,
one matrix into the language model's width). Module names follow the checkpoints'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmforge.models.configs import NormConfig
from lmforge.models.gemma3_vl.args import Gemma3VLArgs
from lmforge.models.layers.norm import RMSNorm

__all__ = ["Gemma3Vision", "SiglipTower"]


class SiglipEmbeddings(nn.Module):
    def __init__(self, args: Gemma3VLArgs) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(args.vision_in_channels, args.vision_dim, args.patch_size, args.patch_size)
        self.position_embedding = nn.Embedding(args.patches_per_side ** 2, args.vision_dim)

    def forward(self, pixels: Tensor) -> Tensor:
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return x + self.position_embedding.weight


class SiglipAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        B, P, _ = x.shape
        q, k, v = (p(x).view(B, P, self.n_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, P, -1))


class SiglipMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipLayer(nn.Module):
    def __init__(self, args: Gemma3VLArgs) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(args.vision_dim, eps=args.vision_norm_eps)
        self.self_attn = SiglipAttention(args.vision_dim, args.vision_heads)
        self.layer_norm2 = nn.LayerNorm(args.vision_dim, eps=args.vision_norm_eps)
        self.mlp = SiglipMLP(args.vision_dim, args.vision_ffn_dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, args: Gemma3VLArgs) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipLayer(args) for _ in range(args.vision_depth))


class SiglipTower(nn.Module):
    """[n_images, channels, image_size, image_size] -> [n_images, patches, vision_dim]."""

    def __init__(self, args: Gemma3VLArgs) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(args)
        self.encoder = SiglipEncoder(args)
        self.post_layernorm = nn.LayerNorm(args.vision_dim, eps=args.vision_norm_eps)

    def forward(self, pixels: Tensor) -> Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Projector(nn.Module):
    """Average-pool each image's patch grid to ``mm_tokens_per_image`` tokens, RMSNorm (Gemma's ``1 + w``),
    then ``@ mm_input_projection_weight`` [vision_dim, dim]."""

    def __init__(self, args: Gemma3VLArgs) -> None:
        super().__init__()
        self.side = args.patches_per_side
        self.kernel = self.side // int(round(args.mm_tokens_per_image ** 0.5))
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(args.vision_dim, args.dim))
        self.mm_soft_emb_norm = RMSNorm(NormConfig(args.vision_dim, args.vision_norm_eps, unit_offset=True))

    def forward(self, x: Tensor) -> Tensor:
        B, _, D = x.shape
        grid = x.transpose(1, 2).reshape(B, D, self.side, self.side).contiguous()
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(x)


class Gemma3Vision(nn.Module):
    """pixel_values [n_images, channels, H, W] -> (image features [n_images * mm_tokens_per_image, dim], [])
    (the second item: no DeepStack features; ``grid_thw`` is ignored, every image has the same size)."""

    def __init__(self, args: Gemma3VLArgs) -> None:
        super().__init__()
        self.vision_tower = SiglipTower(args)
        self.multi_modal_projector = Projector(args)

    def forward(self, pixels: Tensor, grid_thw: Tensor | None = None) -> tuple[Tensor, list[Tensor]]:
        features = self.multi_modal_projector(self.vision_tower(pixels))
        return features.flatten(0, 1), []

    def init_weights(self, std: float = 0.02) -> None:
        """N(0, std) matrices and positions, zero biases, identity norms (a tower trained from scratch)."""
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Conv2d, nn.Embedding)):
                    nn.init.normal_(m.weight, 0.0, std)
                    if getattr(m, "bias", None) is not None:
                        m.bias.zero_()
                elif isinstance(m, (nn.LayerNorm, RMSNorm)):
                    m.reset_parameters()
            nn.init.normal_(self.multi_modal_projector.mm_input_projection_weight, 0.0, std)
