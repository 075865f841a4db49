"""Exact attention when a sequence's tokens are spread over the ranks of a context-parallel group.

Context parallelism (see :mod:`lmforge.parallel.context_parallel`) gives each of ``cp`` ranks
``T / cp`` tokens of every row: the row is cut into ``2 cp`` chunks and rank ``r`` holds chunks ``r``
and ``2 cp - 1 - r``, so that under a causal mask every rank has the same amount of work (an early
chunk with few keys paired with a late one with many). Everything but attention is per token and runs
on the local tokens unchanged; attention needs every earlier key. Each layer therefore all-gathers
its keys and values over the group (one collective for both, as Llama 3's long-context training
does) and runs blockwise attention (:mod:`lmforge.models.layers.blockwise_attention`) of the local
queries over all ``T`` keys: pieces of at most ``BLOCK`` tokens, each block causal, per document and
within the sliding window where the layer has one, its mask (if it needs one) built for that block only,
blocks merged by an online softmax. Memory grows linearly with ``T`` (the gathered keys and values), not
with ``T^2 / cp`` as the dense ``[B, 1, T/cp, T]`` mask and SDPA's math kernel did before (kept as
:data:`DENSE`, for benchmarks). The load balancing is unchanged: each rank has one early and one late
chunk, so as many visible blocks as any other.

The gathered keys are left in gathered order (rank 0's tokens, rank 1's, ...) rather than permuted
back to sequence order: each piece knows its place in the row, and softmax does not care where a
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

from lmforge.models.layers import blockwise_attention as blockwise
from lmforge.models.layers.blockwise_attention import BlockPlan, Piece, blockwise_attention, plan_blocks, split_pieces
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

    ``queries`` / ``keys``: the local tokens and the gathered keys cut into pieces contiguous in the row
    (:class:`~lmforge.models.layers.blockwise_attention.Piece`); ``runs`` [B, T]: each position's document
    (None: one per row); ``window``: the sliding window of the layers using this layout (None: causal
    within documents); ``plan``: the blocks attention runs
    (:func:`~lmforge.models.layers.blockwise_attention.plan_blocks`).
    """

    group: Any
    device: torch.device
    queries: tuple[Piece, ...]
    keys: tuple[Piece, ...]
    runs: Tensor | None
    window: int | None
    plan: BlockPlan

    def windowed(self, window: int | None) -> ContextParallelLayout:
        """The same tokens under a sliding ``window`` (None: causal within documents), by position
        in the row, as the one-process path does (documents are contiguous, so that is also the
        distance within a document)."""
        if window == self.window:
            return self
        plan = plan_blocks(list(self.queries), list(self.keys), self.runs, window)
        return ContextParallelLayout(self.group, self.device, self.queries, self.keys, self.runs, window, plan)

    def dense_mask(self) -> Tensor:
        """The whole boolean mask [B or 1, 1, T/cp, T] of the local queries over the keys in gathered order
        (the all-gather path before blockwise attention: :data:`DENSE`, benchmarks and tests)."""
        rows = [torch.cat([self.plan.mask(qp, kp, self.device) for kp in self.keys], dim=-1) for qp in self.queries]
        return torch.cat(rows, dim=-2)


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


def _spans(rank: int, cp: int, chunk: int, offset: int) -> list[tuple[int, int, int]]:
    """``(offset, start, length)`` of cp rank ``rank``'s two chunks, placed at ``offset`` of a tensor."""
    return [(offset, rank * chunk, chunk), (offset + chunk, (2 * cp - 1 - rank) * chunk, chunk)]


@torch.compiler.disable
def context_layout(group: Any, document_ids: Tensor | None, batch: int, local_len: int,
                   device: torch.device, block: int | None = None) -> ContextParallelLayout:
    """The layout of a ``[batch, local_len]`` shard (see :func:`shard_index`) on its cp ``group``, with
    pieces of at most ``block`` tokens (None: :data:`~lmforge.models.layers.blockwise_attention.BLOCK`, read now).

    ``document_ids`` [B, T/cp] (None: one document per row) are all-gathered once per batch. As in
    :func:`~lmforge.models.layers.packed_attention.packed_layout`, a document is a run of equal ids in
    the row, so the ids are renumbered by run before they are compared.
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    T = cp * local_len
    chunk = local_len // 2
    block = blockwise.BLOCK if block is None else block
    queries = split_pieces(_spans(rank, cp, chunk, 0), block)
    keys = split_pieces([s for r in range(cp) for s in _spans(r, cp, chunk, r * local_len)], block)
    runs = None
    if document_ids is not None:
        key_index = torch.cat([shard_index(r, cp, T, device) for r in range(cp)])
        ids = document_ids.to(device, torch.long).contiguous()
        gathered = ids.new_empty(cp * batch, local_len)
        dist.all_gather_single(gathered, ids, group=group)
        row = torch.empty(batch, T, dtype=torch.long, device=device)
        row[:, key_index] = gathered.view(cp, batch, local_len).permute(1, 0, 2).reshape(batch, T)
        runs = torch.cat([row.new_zeros(batch, 1), (row[:, 1:] != row[:, :-1]).long()], dim=1).cumsum(1)
    plan = plan_blocks(queries, keys, runs, None)
    return ContextParallelLayout(group, device, tuple(queries), tuple(keys), runs, None, plan)


DENSE = False
"""True: the all-gather path with one dense mask per layer and SDPA (what blockwise attention replaced;
for benchmarks and as a reference)."""


@torch.compiler.disable
def attend_context_parallel(q: Tensor, k: Tensor, v: Tensor, layout: ContextParallelLayout, enable_gqa: bool,
                            scale: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """Attention of the local q [B, H, T/cp, D] over the group's k, v [B, Hkv, T/cp, D] -> [B, T/cp, H, D];
    ``sinks`` [H]: gpt-oss's per-head sink logits (:mod:`lmforge.models.layers.sinks`)."""
    k, v = _GatherKV.apply(torch.stack([k, v]), layout.group).unbind(0)
    if not DENSE:
        return blockwise_attention(q, k, v, layout.plan, scale, sinks).transpose(1, 2)
    mask = layout.dense_mask()
    if sinks is not None:
        return sink_attention(q, k, v, sinks, mask, False, enable_gqa, scale).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa, scale=scale)
    return out.transpose(1, 2)
