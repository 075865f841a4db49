"""Blockwise attention with an online softmax: exact, differentiable, and never a whole ``T x S`` matrix.

Context parallelism (:mod:`lmforge.models.layers.context_attention`) has each rank's queries attend
over all ``T`` keys of the row under a mask (causal, per document, sliding window) that no single SDPA
call can express without a dense mask. Here the queries and keys are cut into *pieces* of at most
``block`` tokens, each contiguous in the row, and every (query piece, key piece) pair is a *block* of
one of four kinds, decided once per batch from positions and document runs (:class:`BlockPlan`):
skipped (nothing visible), full (every key visible: SDPA without a mask), causal (the diagonal: SDPA's
``is_causal``) or masked (a boolean ``[B, 1, n, m]`` mask built for that block only, then freed).

Each block gives an output and its log-sum-exp; blocks are merged with log-sum-exp weights (the online
softmax), so the largest temporaries are one block's. A sink logit (gpt-oss,
:mod:`lmforge.models.layers.sinks`) joins the final normaliser: ``lse' = logaddexp(lse, sink)``.

**Why a custom autograd Function** (:class:`_BlockwiseAttention`): autograd through the merge would keep
every block's output and weights for the backward (memory growing with the number of blocks). Flash
attention's backward needs only the final output ``y`` and normaliser ``lse'``: per block,
``P = exp(s - lse')`` and ``dS = P * (dP - rowsum(dy * y))``, which are exactly that block's share of
the gradient of the whole softmax. So the forward saves q, k, v, y and lse', and the backward recomputes
each block. On a CPU each block is PyTorch's flash kernel
(``_scaled_dot_product_flash_attention_for_cpu``, which returns the lse, and its backward, which takes
the lse and output it is handed); elsewhere an explicit matmul-softmax per block (exact; memory bounded
by the block; CUDA's flash ops could replace it, untested without a GPU). Memory: O(T) for the inputs,
outputs and gradients, plus one block's scores or mask, ``B x H x block^2``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["BLOCK", "BlockPlan", "Piece", "blockwise_attention", "plan_blocks"]

BLOCK = 1024
"""Default tokens per piece: masks of ``B x 1024 x 1024`` booleans, and few enough kernel calls."""

CPU_FLASH = True
"""On a CPU, run each block through the flash kernel; False: the explicit matmul-softmax (other devices)."""

SKIP, FULL, CAUSAL, MASKED = 0, 1, 2, 3

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@dataclass(frozen=True)
class Piece:
    """``length`` tokens at ``offset`` in their tensor, at positions ``start .. start + length - 1`` of the row."""

    offset: int
    start: int
    length: int


def split_pieces(spans: list[tuple[int, int, int]], block: int) -> list[Piece]:
    """Pieces of at most ``block`` tokens from ``(offset, start, length)`` spans contiguous in the row."""
    return [Piece(off + i, start + i, min(block, length - i))
            for off, start, length in spans for i in range(0, length, block)]


@dataclass(frozen=True)
class BlockPlan:
    """Which blocks of (query piece, key piece) to run and how; shared by forward and backward.

    ``runs`` [B, T]: each position's document number (a run of equal ids), None: one document per row.
    ``blocks``: ``(query piece index, key piece index, kind)`` for every block not skipped.
    """

    queries: tuple[Piece, ...]
    keys: tuple[Piece, ...]
    runs: Tensor | None
    window: int | None
    blocks: tuple[tuple[int, int, int], ...]

    def mask(self, qp: Piece, kp: Piece, device: torch.device) -> Tensor:
        """The boolean mask [B or 1, 1, n, m] of one masked block: causal, same document, in the window."""
        i = torch.arange(qp.start, qp.start + qp.length, device=device)[:, None]
        j = torch.arange(kp.start, kp.start + kp.length, device=device)[None, :]
        visible = j <= i
        if self.window is not None:
            visible = visible & (i - j < self.window)
        if self.runs is None:
            return visible[None, None]
        same = self.runs[:, qp.start:qp.start + qp.length, None] == self.runs[:, None, kp.start:kp.start + kp.length]
        return (visible & same).unsqueeze(1)


def _position_kind(qp: Piece, kp: Piece, window: int | None) -> int:
    """The block's kind from positions alone (causal and window)."""
    q_last, k_last = qp.start + qp.length - 1, kp.start + kp.length - 1
    if kp.start > q_last or (window is not None and qp.start - k_last >= window):
        return SKIP
    banded = window is not None and q_last - kp.start >= window
    if k_last <= qp.start and not banded:
        return FULL
    if kp.start == qp.start and kp.length == qp.length and not banded:
        return CAUSAL
    return MASKED


def plan_blocks(queries: list[Piece], keys: list[Piece], runs: Tensor | None, window: int | None) -> BlockPlan:
    """The plan of every block; with documents, one host sync per call (a ``[Pq, Pk]`` table from the
    first and last run of each piece: runs never decrease along the row, so those decide whether two
    pieces share no document, or lie in one)."""
    doc: list[list[int]] | None = None
    if runs is not None:
        def ends(pieces: list[Piece]) -> tuple[Tensor, Tensor]:
            first = torch.tensor([p.start for p in pieces], device=runs.device)
            last = torch.tensor([p.start + p.length - 1 for p in pieces], device=runs.device)
            return runs[:, first], runs[:, last]  # [B, P]

        qs, qe = ends(queries)
        ks, ke = ends(keys)
        disjoint = ((ke[:, None, :] < qs[:, :, None]) | (qe[:, :, None] < ks[:, None, :])).all(0)
        single = (torch.minimum(qs[:, :, None], ks[:, None, :]) == torch.maximum(qe[:, :, None], ke[:, None, :])).all(0)
        doc = torch.where(disjoint, SKIP, torch.where(single, FULL, MASKED)).tolist()
    blocks = []
    for a, qp in enumerate(queries):
        for b, kp in enumerate(keys):
            kind = _position_kind(qp, kp, window)
            if doc is not None and kind != SKIP:
                kind = SKIP if doc[a][b] == SKIP else kind if doc[a][b] == FULL else MASKED
            if kind != SKIP:
                blocks.append((a, b, kind))
    return BlockPlan(tuple(queries), tuple(keys), runs, window, tuple(blocks))


def _repeat_kv(x: Tensor, heads: int) -> Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _block_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
                   scale: float) -> tuple[Tensor, Tensor]:
    """(out [B, H, n, D], lse [B, H, n] fp32) of one block; a row with no visible key has lse -inf."""
    if CPU_FLASH and q.device.type == "cpu":
        additive = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        out, lse = _FLASH_CPU(q, k, v, 0.0, causal, attn_mask=additive, scale=scale)
        if mask is not None:  # the kernel reports lse 0 for a row with nothing visible
            lse = lse.masked_fill(~mask.any(-1), float("-inf"))
        return out, lse.float()
    s = (q.float() @ _repeat_kv(k, q.shape[1]).float().transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.nan_to_num(neginf=0.0).unsqueeze(-1))
    return (p @ _repeat_kv(v, q.shape[1]).float()).to(q.dtype), lse


def _block_backward(dy: Tensor, q: Tensor, k: Tensor, v: Tensor, y: Tensor, lse: Tensor, mask: Tensor | None,
                    causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """This block's share of (dq, dk, dv), given the output ``y`` and normaliser ``lse`` of the whole softmax."""
    if CPU_FLASH and q.device.type == "cpu":
        additive = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        return _FLASH_CPU_BACKWARD(dy, q, k, v, y, lse, 0.0, causal, attn_mask=additive, scale=scale)
    H, Hkv = q.shape[1], k.shape[1]
    kf, vf = _repeat_kv(k, H).float(), _repeat_kv(v, H).float()
    s = (q.float() @ kf.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))
    dyf = dy.float()
    dp = dyf @ vf.transpose(-1, -2)
    ds = p * (dp - (dyf * y.float()).sum(-1, keepdim=True))
    dq = (ds @ kf) * scale
    dk = (ds.transpose(-1, -2) @ q.float()) * scale
    dv = p.transpose(-1, -2) @ dyf
    if Hkv != H:
        B, _, m, D = dk.shape
        dk, dv = (t.view(B, Hkv, H // Hkv, m, D).sum(2) for t in (dk, dv))
    return dq, dk, dv


def _rows(x: Tensor, p: Piece) -> Tensor:
    return x[:, :, p.offset:p.offset + p.length]


class _BlockwiseAttention(torch.autograd.Function):
    """Forward: online softmax over the plan's blocks; backward: each block recomputed from y and lse'."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor,  # type: ignore[override]
                sinks: Tensor | None, plan: BlockPlan, scale: float) -> Tensor:
        B, H, n, D = q.shape
        out = torch.zeros(B, H, n, D, dtype=torch.float32, device=q.device)
        lse = torch.full((B, H, n), float("-inf"), dtype=torch.float32, device=q.device)
        for a, b, kind in plan.blocks:
            qp, kp = plan.queries[a], plan.keys[b]
            mask = plan.mask(qp, kp, q.device) if kind == MASKED else None
            o, l = _block_forward(_rows(q, qp), _rows(k, kp), _rows(v, kp), mask, kind == CAUSAL, scale)
            acc, acc_lse = _rows(out, qp), _rows(lse, qp)
            new = torch.logaddexp(acc_lse, l)
            safe = new.nan_to_num(neginf=0.0)  # a row with nothing visible yet keeps weight 0 on both sides
            acc.mul_(torch.exp(acc_lse - safe).unsqueeze(-1)).add_(o.float() * torch.exp(l - safe).unsqueeze(-1))
            acc_lse.copy_(new)
        if sinks is not None:
            total = torch.logaddexp(lse, sinks.float().view(1, -1, 1))
            out.mul_(torch.exp(lse - total).unsqueeze(-1))
            lse = total
        y = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, sinks, y, lse)
        ctx.plan, ctx.scale = plan, scale
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor):  # type: ignore[override]
        q, k, v, sinks, y, lse = ctx.saved_tensors
        plan: BlockPlan = ctx.plan
        dy = dy.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for a, b, kind in plan.blocks:
            qp, kp = plan.queries[a], plan.keys[b]
            mask = plan.mask(qp, kp, q.device) if kind == MASKED else None
            g = _block_backward(_rows(dy, qp).contiguous(), _rows(q, qp), _rows(k, kp), _rows(v, kp),
                                _rows(y, qp).contiguous(), _rows(lse, qp).contiguous(), mask, kind == CAUSAL,
                                ctx.scale)
            for acc, piece, grad in ((dq, qp, g[0]), (dk, kp, g[1]), (dv, kp, g[2])):
                _rows(acc, piece).add_(grad.float())
        dsink = None
        if sinks is not None:
            p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse)
            dsink = (-(p_sink * (dy.float() * y.float()).sum(-1)).sum((0, 2))).to(sinks.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsink, None, None


def blockwise_attention(q: Tensor, k: Tensor, v: Tensor, plan: BlockPlan, scale: float | None = None,
                        sinks: Tensor | None = None) -> Tensor:
    """Attention of q [B, H, n, D] over k, v [B, Hkv, S, D] under ``plan`` -> [B, H, n, D]; exact values
    and gradients (q, k, v and ``sinks`` [H]). Under CPU autocast it runs in the autocast dtype, as SDPA."""
    s = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type) else q.dtype
    q, k, v = (x.to(dtype).contiguous() for x in (q, k, v))
    with torch.autocast(q.device.type, enabled=False):
        return _BlockwiseAttention.apply(q, k, v, sinks, plan, s)
