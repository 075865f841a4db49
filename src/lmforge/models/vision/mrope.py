"""Multimodal RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): every token has three positions (temporal, height,
width) and each rotary frequency turns with one of them, chosen by ``mrope_section`` (how many of the
``head_dim / 2`` frequencies follow each axis, in sections or interleaved). Text tokens have three equal
positions, so a text-only row rotates exactly as plain RoPE; an image's tokens (one per ``merge x merge``
block of patches) take
its block row and column, offset to follow the text before it, and the text after an image continues
from ``start + max(rows, columns)``, as transformers' ``get_rope_index`` numbers them.

Also here: placing the vision tower's features at the image tokens of the embedded text.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from lmforge.errors import UserError
from lmforge.models.configs import RopeConfig
from lmforge.models.layers.rope import RotaryEmbedding

__all__ = ["MultimodalRotaryEmbedding", "mrope_axes", "mrope_position_ids", "scatter_image_features"]


def mrope_axes(sections: Sequence[int], interleaved: bool = False) -> list[int]:
    """The axis (0 temporal, 1 height, 2 width) each of the ``sum(sections)`` frequencies follows: in
    contiguous sections (Qwen2-VL, Qwen2.5-VL), or interleaved T, H, W, T, H, W... while each axis has
    frequencies left, the rest temporal (Qwen3-VL's ``mrope_interleaved``)."""
    if len(sections) != 3:
        raise UserError(f"mrope_section {list(sections)} must have three parts (temporal, height, width)")
    if not interleaved:
        return [axis for axis, n in enumerate(sections) for _ in range(n)]
    axes = [0] * sum(sections)
    for axis in (1, 2):
        for j in range(axis, min(3 * sections[axis], len(axes)), 3):  # past the end: dropped, as transformers
            axes[j] = axis
    return axes


class MultimodalRotaryEmbedding(RotaryEmbedding):
    """The rotary table of :class:`RotaryEmbedding`, read per axis: ``position_ids`` [3, B, T] gather
    each feature's angle from its axis's position (``axes``, one per frequency, see :func:`mrope_axes`);
    [B, T] (text only) read the plain table."""

    def __init__(self, cfg: RopeConfig, axes: Sequence[int]) -> None:
        if 2 * len(axes) != cfg.dim:
            raise UserError(f"multimodal RoPE sections cover {len(axes)} frequencies; head_dim {cfg.dim} has "
                            f"{cfg.dim // 2}")
        self.axes = tuple(axes)
        super().__init__(cfg)

    def rebuild(self, device: torch.device | str | None = None) -> None:
        """The tables, and which axis each feature follows (rebuilt with them, e.g. after a meta-device build)."""
        super().rebuild(device)
        half = torch.tensor(self.axes, dtype=torch.long)
        self.axis = torch.cat([half, half]).to(self.cos.device)

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if position_ids.dim() == 2:
            return super().forward(position_ids, dtype)
        device = self.cos.device
        feature, axis = torch.arange(self.cfg.dim, device=device), self.axis.to(device)
        position_ids = position_ids.to(device)
        # [3, B, T, D] tables -> [D, B, T] with each feature from its axis -> [B, 1, T, D]
        cos = self.cos[position_ids].permute(0, 3, 1, 2)[axis, feature].permute(1, 2, 0)
        sin = self.sin[position_ids].permute(0, 3, 1, 2)[axis, feature].permute(1, 2, 0)
        return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)


def _segments(row: Tensor, documents: Tensor | None) -> list[tuple[int, int]]:
    """[start, end) of each document of a row (the whole row without ``document_ids``)."""
    if documents is None:
        return [(0, row.numel())]
    change = (documents[1:] != documents[:-1]).nonzero().flatten().add(1).tolist()
    bounds = [0, *change, row.numel()]
    return list(zip(bounds[:-1], bounds[1:]))


def mrope_position_ids(tokens: Tensor, grid_thw: Tensor | None, image_token_id: int, merge: int,
                       document_ids: Tensor | None = None) -> Tensor:
    """Positions [3, B, T] of ``tokens`` [B, T] whose image tokens stand for the images of ``grid_thw``
    in order (row by row, left to right). Each document of a packed row (``document_ids``) starts again at
    0; a run of image tokens is consumed image by image (``t * h * w / merge**2`` tokens each), so two
    images back to back are numbered as transformers numbers them with a separator between."""
    grids = [] if grid_thw is None else [tuple(g) for g in grid_thw.tolist()]
    out = torch.empty(3, *tokens.shape, dtype=torch.long)
    is_image = (tokens == image_token_id).cpu()
    docs = None if document_ids is None else document_ids.cpu()
    used = 0
    for b in range(tokens.shape[0]):
        for start, end in _segments(is_image[b], None if docs is None else docs[b]):
            pos, i = 0, start
            while i < end:
                if not is_image[b, i]:
                    j = i
                    while j < end and not is_image[b, j]:
                        j += 1
                    out[:, b, i:j] = torch.arange(pos, pos + j - i)
                    pos, i = pos + j - i, j
                    continue
                if used >= len(grids):
                    raise UserError(f"the batch has more image tokens than image_grid_thw describes "
                                    f"({len(grids)} images)")
                t, h, w = grids[used]
                used += 1
                gh, gw = h // merge, w // merge
                n = t * gh * gw
                if i + n > end or not bool(is_image[b, i:i + n].all()):
                    raise UserError(f"image {used - 1} (grid {t}x{h}x{w}) needs {n} consecutive image tokens "
                                    f"in row {b} at position {i}")
                tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
                out[:, b, i:i + n] = torch.stack([tt, hh, ww]).reshape(3, -1) + pos
                pos, i = pos + max(gh, gw), i + n
    if used != len(grids):
        raise UserError(f"image_grid_thw describes {len(grids)} images but the tokens hold {used}")
    return out.to(tokens.device)


def scatter_image_features(embeds: Tensor, tokens: Tensor, features: Tensor, image_token_id: int) -> Tensor:
    """``embeds`` [B, T, dim] with the image tokens' rows replaced by ``features`` [n, dim], in order."""
    mask = tokens == image_token_id
    n = int(mask.sum())
    if n != features.shape[0]:
        raise UserError(f"the batch has {n} image tokens but the images give {features.shape[0]} features")
    return embeds.masked_scatter(mask.unsqueeze(-1), features.to(embeds.dtype))
