"""Blockwise attention (context parallelism's kernel) against the definition: a dense masked softmax.

On a one-process gloo group (the gather an identity), so the layout's pieces, block kinds and the online
softmax are checked here in fp32 to 1e-5, values and gradients of q, k, v and the sinks, on both block
implementations (the CPU flash kernel, and the explicit matmul-softmax other devices run); exactness over
real ranks is tests/test_context_parallel.py's.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import lmforge.models.layers.blockwise_attention as blockwise
from lmforge.models.layers.blockwise_attention import CAUSAL, FULL, MASKED, Piece, plan_blocks
from lmforge.models.layers.context_attention import attend_context_parallel, context_layout
from lmforge.models.layers.masks import document_mask, sliding_window_mask
from lmforge.models.layers.sinks import reference_sink_attention

B, H, HKV, T, D = 2, 4, 2, 16, 8
DOCS = torch.tensor([[0] * 5 + [1] * 7 + [0] * 4, [3] * 16])  # id 0 comes back: a run is a document
RUNS = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [3] * 16])


@pytest.fixture(scope="module")
def group():
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture(params=["cpu_flash", "matmul"])
def impl(request, monkeypatch):
    monkeypatch.setattr(blockwise, "CPU_FLASH", request.param == "cpu_flash")
    return request.param


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g).requires_grad_()
    k = torch.randn(B, HKV, T, D, generator=g).requires_grad_()
    v = torch.randn(B, HKV, T, D, generator=g).requires_grad_()
    sinks = torch.randn(H, generator=g).requires_grad_()
    return q, k, v, sinks


def dense(q, k, v, sinks, mask):
    if sinks is not None:
        return reference_sink_attention(q, k, v, sinks, mask)
    kk, vv = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
    scores = (q @ kk.transpose(-1, -2) * D ** -0.5).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1) @ vv


@pytest.mark.parametrize("block", [3, 5, 1024])  # 3 and 5 cut the chunks of 8 unevenly
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("documents", [True, False])
def test_matches_dense_softmax(group, impl, block: int, window: int | None, with_sinks: bool, documents: bool) -> None:
    q, k, v, sinks = inputs()
    layout = context_layout(group, DOCS if documents else None, B, T, torch.device("cpu"), block=block)
    layout = layout.windowed(window)
    mask = document_mask(RUNS) if documents else torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    if window is not None:
        mask = mask & sliding_window_mask(T, window)
    assert torch.equal(layout.dense_mask().expand_as(mask), mask.expand_as(layout.dense_mask()))
    s = sinks if with_sinks else None
    got = attend_context_parallel(q, k, v, layout, True, None, s).transpose(1, 2)
    want = dense(q, k, v, s, mask)
    assert (got - want).abs().max() < 1e-5
    leaves = (q, k, v, sinks) if with_sinks else (q, k, v)
    w = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad((got * w).sum(), leaves), torch.autograd.grad((want * w).sum(), leaves)):
        assert (a - b).abs().max() < 1e-5


def test_plan_skips_and_kinds() -> None:
    """Causal: keys after the queries are skipped, the diagonal is SDPA-causal, earlier keys need no mask;
    a document boundary or a window edge inside a block makes it masked, and disjoint documents skip it."""
    pieces = [Piece(0, 0, 4), Piece(4, 4, 4), Piece(8, 8, 4)]
    kinds = {(a, b): kind for a, b, kind in plan_blocks(pieces, pieces, None, None).blocks}
    assert kinds == {(0, 0): CAUSAL, (1, 0): FULL, (1, 1): CAUSAL, (2, 0): FULL, (2, 1): FULL, (2, 2): CAUSAL}
    windowed = {(a, b): kind for a, b, kind in plan_blocks(pieces, pieces, None, 4).blocks}
    # queries 8..11 over keys 0..3: every distance >= 5 > window, skipped; over 4..7 the band cuts through
    assert windowed == {(0, 0): CAUSAL, (1, 0): MASKED, (1, 1): CAUSAL, (2, 1): MASKED, (2, 2): CAUSAL}
    runs = torch.tensor([[0] * 6 + [1] * 6])  # documents 0..5 and 6..11
    docs = {(a, b): kind for a, b, kind in plan_blocks(pieces, pieces, runs, None).blocks}
    assert docs == {(0, 0): CAUSAL, (1, 0): MASKED, (1, 1): MASKED, (2, 1): MASKED, (2, 2): CAUSAL}


def test_autocast_runs_in_bf16(group) -> None:
    q, k, v, _ = inputs()
    layout = context_layout(group, DOCS, B, T, torch.device("cpu"), block=5)
    want = dense(q, k, v, None, document_mask(RUNS)).detach()
    with torch.autocast("cpu", torch.bfloat16):
        got = attend_context_parallel(q, k, v, layout, True)
    assert got.dtype == torch.bfloat16
    assert (got.transpose(1, 2).float() - want).abs().max() < 3e-2
