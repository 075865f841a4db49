"""Attention over the documents of a packed batch: per-document causal SDPA, never a T x T mask.

Packed sequences (several documents per row, ``document_ids``) need block-diagonal causal
attention. A dense ``[B, 1, T, T]`` mask does that, but costs O(T^2) memory per row and rules
out flash kernels. Instead, :func:`packed_layout` cuts every row into its documents once per
batch, and :func:`attend_packed` runs ``is_causal=True`` SDPA on each group of similar-length
documents, padded at the end to a common length. Padding at the end of a causal sequence is
never attended by a real token, so the result is exact; the work and memory grow with the
tokens per document, not with T.

Why not the alternatives (torch 2.13; ``bench/packed_attention.py`` probes them): ``flex_attention``
has no backward on CPU (eager or compiled) and, uncompiled, materialises the full score matrix;
nested (jagged) tensors find no SDPA backend for causal attention (``is_causal=True``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import Tensor

from lmforge.models.layers.causal_attention import causal_attention
from lmforge.models.layers.masks import sliding_window_mask
from lmforge.models.layers.sinks import sink_attention

__all__ = ["LengthGroup", "PackedLayout", "attend_packed", "packed_layout"]


@dataclass(frozen=True)
class LengthGroup:
    """Documents padded to one length: ``index`` [n, length] picks their tokens from the
    flattened batch; ``mask`` is the sliding-window band when ``length`` exceeds the window."""

    length: int
    index: Tensor
    mask: Tensor | None


@dataclass(frozen=True)
class PackedLayout:
    """Where the documents of a packed ``[B, T]`` batch sit; built once, shared by all layers.

    ``unpack`` [B*T] gives each token's row in the concatenated outputs of ``groups``.
    """

    batch: int
    seq_len: int
    groups: tuple[LengthGroup, ...]
    unpack: Tensor

    @cached_property
    def gather(self) -> Tensor:
        """Every group's token index, concatenated: one ``index_select`` picks all groups' tokens."""
        return torch.cat([g.index.reshape(-1) for g in self.groups])

    @cached_property
    def sizes(self) -> list[int]:
        """Tokens (padding slots included) of each group in :attr:`gather`."""
        return [g.index.numel() for g in self.groups]

    def windowed(self, window: int | None) -> PackedLayout:
        """The same documents under a sliding ``window`` (None: plain causal): only the groups' band
        masks change, so layers with different windows (Gemma 3) share one read of the ids."""
        groups = tuple(LengthGroup(g.length, g.index, None if window is None or g.length <= window
                                   else sliding_window_mask(g.length, window, g.index.device)) for g in self.groups)
        return PackedLayout(self.batch, self.seq_len, groups, self.unpack)


def _padded_length(n: int) -> int:
    """Round up to a quarter of the length's octave: at most 25% padding, and few groups."""
    step = max(1, (1 << (n.bit_length() - 1)) // 4)
    return -(-n // step) * step


@torch.compiler.disable
def packed_layout(document_ids: Tensor, window: int | None = None) -> PackedLayout:
    """Group the documents of ``document_ids`` [B, T] by padded length.

    A document is a run of equal ids within a row (as packing writes them); padding that
    carries its own id is just one more document. Reads the ids on the host once per batch.
    """
    B, T = document_ids.shape
    device = document_ids.device
    ids = document_ids.detach().to("cpu", torch.long)
    first = torch.ones(B, T, dtype=torch.bool)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    starts = first.reshape(-1).nonzero().squeeze(1)
    lengths = torch.diff(starts, append=torch.tensor([B * T]))
    padded = torch.tensor([_padded_length(n) for n in lengths.tolist()])
    unpack = torch.empty(B * T, dtype=torch.long)
    groups = []
    offset = 0
    for length in sorted(set(padded.tolist())):
        pick = padded == length
        s, n = starts[pick], lengths[pick]
        j = torch.arange(length)
        valid = j < n[:, None]
        # Padding slots repeat the document's last token: causal attention never lets a real
        # query see them, and their outputs are dropped by `unpack`.
        index = s[:, None] + torch.minimum(j, n[:, None] - 1)
        rows = offset + torch.arange(index.numel()).view_as(index)
        unpack[index[valid]] = rows[valid]
        offset += index.numel()
        mask = None
        if window is not None and length > window:
            mask = sliding_window_mask(length, window, device)
        groups.append(LengthGroup(length, index.to(device, non_blocking=True), mask))
    return PackedLayout(B, T, tuple(groups), unpack.to(device, non_blocking=True))


@torch.compiler.disable
def attend_packed(q: Tensor, k: Tensor, v: Tensor, layout: PackedLayout, enable_gqa: bool,
                  scale: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """Per-document causal attention of q [B, H, T, D] over k, v [B, Hkv, T, D] -> [B, T, H, D];
    ``sinks`` [H]: gpt-oss's per-head sink logits (:mod:`lmforge.models.layers.sinks`), in every document."""
    B, _, T, _ = q.shape
    # [B, H, T, D] -> [B*T, H, D], so one index picks a document's tokens for every head. All groups
    # are gathered by one index_select and split into views: the backward is then one zero-filled
    # [B*T, H, D] gradient and one index_add per input, where gathering each group on its own costs
    # a zero-filled full-size gradient per group (9 groups of a 256-token SFT batch: ~8x slower).
    q, k, v = (x.transpose(1, 2).reshape(B * T, x.shape[1], x.shape[3]).index_select(0, layout.gather)
               .split(layout.sizes) for x in (q, k, v))
    outs = []
    for g, qg, kg, vg in zip(layout.groups, q, k, v):
        qg, kg, vg = (x.view(*g.index.shape, *x.shape[1:]).transpose(1, 2) for x in (qg, kg, vg))  # [n, H, length, D]
        if sinks is not None:
            out = sink_attention(qg, kg, vg, sinks, g.mask, g.mask is None, enable_gqa, scale)
        elif g.mask is None:
            out = causal_attention(qg, kg, vg, enable_gqa, scale)
        else:
            out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, enable_gqa=enable_gqa, scale=scale)
        outs.append(out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3]))
    H, D = outs[0].shape[1:]
    return torch.cat(outs).index_select(0, layout.unpack).view(B, T, H, D)
