"""Exact attention when a sequence's tokens are spread over the ranks of a context-parallel group.

Context parallelism (see :mod:`lmforge.parallel.context_parallel`) gives each of ``cp`` ranks
``T / cp`` tokens of every row: the row is cut into ``2 cp`` chunks and rank ``r`` holds chunks ``r``
and ``2 cp - 1 - r``, so that under a causal mask every rank has the same amount of work (an early
chunk with few keys paired with a late one with many). Everything but attention is per token and runs
on the local tokens unchanged; attention needs every earlier key. Each layer therefore all-gathers
its keys and values over the group (one collective for both, as Llama 3's long-context training
does) and runs SDPA of the local queries over all ``T`` keys with a boolean mask ``[B, 1, T/cp, T]``:
same document, key not after the query, and within the sliding window where the layer has one.

The gathered keys are left in gathered order (rank 0's tokens, rank 1's, ...) rather than permuted
back to sequence order: the mask is built over the same order, and softmax does not care where a
key sits, so the copy is saved. Backward is the adjoint of the all-gather: every rank's queries send
gradient to every rank's keys, and a reduce-scatter sums those contributions onto the rank that owns
each key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lmforge.models.layers.sinks import sink_attention

__all__ = ["ContextParallelLayout", "attend_context_parallel", "context_layout", "shard_index"]


def shard_index(rank: int, cp: int, seq_len: int, device: torch.device | str | None = None) -> Tensor:
    """Positions in the row of the ``seq_len / cp`` tokens that cp rank ``rank`` holds: chunks ``rank``
    and ``2 cp - 1 - rank`` of ``2 cp`` equal chunks, in that order."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, last])


@dataclass(frozen=True)
class ContextParallelLayout:
    """This rank's share of a context-parallel batch; built once per forward, shared by all layers.

    ``visible`` [B or 1, 1, T/cp, T] is the causal, same-document mask of the local queries over the keys in
    gathered order; ``mask`` is what a layer uses (``visible`` narrowed to a sliding window, or itself).
    ``query_index`` [T/cp] and ``key_index`` [T] are the positions in the row of the local tokens and of
    the gathered keys.
    """

    group: Any
    query_index: Tensor
    key_index: Tensor
    visible: Tensor
    mask: Tensor

    def windowed(self, window: int | None) -> ContextParallelLayout:
        """The same tokens under a sliding ``window`` (None: causal within documents), by position
        in the row, as the one-process path does (documents are contiguous, so that is also the
        distance within a document)."""
        mask = self.visible
        if window is not None:
            band = (self.query_index[:, None] - self.key_index[None, :]) < window
            mask = mask & band
        return ContextParallelLayout(self.group, self.query_index, self.key_index, self.visible, mask)


class _GatherKV(torch.autograd.Function):
    """All-gather of stacked keys and values ``[2, B, H, T/cp, D]`` along the token dimension.

    Forward: ``all_gather_single`` (ranks stacked first), then the rank dimension moved next to
    the token one, giving ``[2, B, H, T, D]`` in gathered order. Backward: each rank holds gradient for
    every key from its own queries; ``reduce_scatter_single`` sums them over the group and hands each
    rank the slice of the keys it owns (gloo on CPU has it in torch 2.13).
    """

    @staticmethod
    def forward(ctx: Any, kv: Tensor, group: Any) -> Tensor:
        ctx.group = group
        cp = dist.get_world_size(group)
        two, B, H, n, D = kv.shape
        out = kv.new_empty(cp * two, B, H, n, D)
        dist.all_gather_single(out, kv.contiguous(), group=group)
        return out.view(cp, two, B, H, n, D).permute(1, 2, 3, 0, 4, 5).reshape(two, B, H, cp * n, D)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        cp = dist.get_world_size(ctx.group)
        two, B, H, T, D = grad.shape
        n = T // cp
        per_rank = grad.reshape(two, B, H, cp, n, D).permute(3, 0, 1, 2, 4, 5).contiguous()
        out = grad.new_empty(two, B, H, n, D)
        dist.reduce_scatter_single(out, per_rank.view(cp * two, B, H, n, D), group=ctx.group)
        return out, None


@torch.compiler.disable
def context_layout(group: Any, document_ids: Tensor | None, batch: int, local_len: int,
                   device: torch.device) -> ContextParallelLayout:
    """The layout of a ``[batch, local_len]`` shard (see :func:`shard_index`) on its cp ``group``.

    ``document_ids`` [B, T/cp] (None: one document per row) are all-gathered once per batch. As in
    :func:`~lmforge.models.layers.packed_attention.packed_layout`, a document is a run of equal ids in
    the row, so the ids are renumbered by run before they are compared.
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    T = cp * local_len
    query_index = shard_index(rank, cp, T, device)
    key_index = torch.cat([shard_index(r, cp, T, device) for r in range(cp)])
    causal = key_index[None, :] <= query_index[:, None]  # [T/cp, T]
    if document_ids is None:
        visible = causal[None, None]  # SDPA broadcasts it over rows and heads
    else:
        ids = document_ids.to(device, torch.long).contiguous()
        gathered = ids.new_empty(cp * batch, local_len)
        dist.all_gather_single(gathered, ids, group=group)
        row = torch.empty(batch, T, dtype=torch.long, device=device)
        row[:, key_index] = gathered.view(cp, batch, local_len).permute(1, 0, 2).reshape(batch, T)
        runs = torch.cat([row.new_zeros(batch, 1), (row[:, 1:] != row[:, :-1]).long()], dim=1).cumsum(1)
        same = runs[:, query_index, None] == runs[:, None, key_index]  # [B, T/cp, T]
        visible = (causal & same).unsqueeze(1)
    return ContextParallelLayout(group, query_index, key_index, visible, visible)


@torch.compiler.disable
def attend_context_parallel(q: Tensor, k: Tensor, v: Tensor, layout: ContextParallelLayout, enable_gqa: bool,
                            scale: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """Attention of the local q [B, H, T/cp, D] over the group's k, v [B, Hkv, T/cp, D] -> [B, T/cp, H, D];
    ``sinks`` [H]: gpt-oss's per-head sink logits (:mod:`lmforge.models.layers.sinks`)."""
    k, v = _GatherKV.apply(torch.stack([k, v]), layout.group).unbind(0)
    if sinks is not None:
        return sink_attention(q, k, v, sinks, layout.mask, False, enable_gqa, scale).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.mask, enable_gqa=enable_gqa, scale=scale)
    return out.transpose(1, 2)
