"""Attention sinks (gpt-oss) on every attention path, against the definition: a softmax over the scores
plus one sink column per query head, with no value (``reference_sink_attention``, Hugging Face's eager
path). Values and gradients (q, k, v and the sinks) in fp32 to 1e-6; without sinks every path is
bit-for-bit the call it was."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lmforge.models.layers.attention import attend
from lmforge.models.layers.causal_attention import causal_attention
from lmforge.models.layers.context_attention import attend_context_parallel, context_layout
from lmforge.models.layers.kv_cache import KVCache
from lmforge.models.layers.masks import document_mask, sliding_window_mask
from lmforge.models.layers.packed_attention import attend_packed, packed_layout
from lmforge.models.layers.sinks import reference_sink_attention, sink_attention

B, H, HKV, T, D = 2, 4, 2, 11, 16


@pytest.fixture(autouse=True, params=["cpu_flash", "extra_key"])
def impl(request, monkeypatch):
    """Every test on both CPU implementations: the flash kernel's lse, and the sink as an extra key (what
    other devices run)."""
    import lmforge.models.layers.sinks as sinks_module

    monkeypatch.setattr(sinks_module, "CPU_FLASH", request.param == "cpu_flash")
    return request.param


def inputs(seed: int = 0, T_q: int = T, S: int = T, d: int = D, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T_q, d, generator=g, dtype=dtype).requires_grad_()
    k = torch.randn(B, HKV, S, d, generator=g, dtype=dtype).requires_grad_()
    v = torch.randn(B, HKV, S, d, generator=g, dtype=dtype).requires_grad_()
    sinks = (2 * torch.randn(H, generator=g, dtype=dtype)).requires_grad_()
    return q, k, v, sinks


def grads(out: torch.Tensor, *leaves: torch.Tensor, seed: int = 1) -> list[torch.Tensor]:
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return list(torch.autograd.grad((out * w).sum(), leaves, retain_graph=True))


def assert_same(got: torch.Tensor, want: torch.Tensor, leaves, tol: float = 1e-6) -> float:
    """Values and gradients of ``got`` equal ``want``'s to ``tol`` (relative to the tensor's largest entry
    where that exceeds 1); returns the largest such difference."""
    worst = 0.0
    for a, b in zip((got, *grads(got, *leaves)), (want, *grads(want, *leaves))):
        err = ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()
        assert err < tol, err
        worst = max(worst, err)
    return worst


def causal(T_: int, S: int | None = None) -> torch.Tensor:
    S = T_ if S is None else S
    return torch.ones(T_, S, dtype=torch.bool).tril()


@pytest.mark.parametrize("d,scale", [(16, None), (12, 0.3)])
def test_causal_and_full(d: int, scale: float | None) -> None:
    q, k, v, sinks = inputs(d=d)
    want = reference_sink_attention(q, k, v, sinks, causal(T), scale)
    assert_same(attend(q, k, v, None, True, True, scale, sinks).transpose(1, 2), want, (q, k, v, sinks))
    assert_same(causal_attention(q, k, v, True, scale, sinks), want, (q, k, v, sinks))
    want = reference_sink_attention(q, k, v, sinks, None, scale)  # no mask, not causal: every key
    assert_same(attend(q, k, v, None, False, True, scale, sinks).transpose(1, 2), want, (q, k, v, sinks))


def test_sliding_window_band() -> None:
    q, k, v, sinks = inputs()
    band = sliding_window_mask(T, 4)
    want = reference_sink_attention(q, k, v, sinks, band)
    assert_same(attend(q, k, v, band, False, True, None, sinks).transpose(1, 2), want, (q, k, v, sinks))


def test_sinks_change_the_result_and_huge_negative_sinks_remove_them() -> None:
    q, k, v, sinks = inputs()
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (sink_attention(q, k, v, sinks, None, True, True) - plain).abs().max() > 1e-2
    gone = sink_attention(q, k, v, torch.full((H,), -1e4), None, True, True)
    assert (gone - plain).abs().max() < 1e-6


def test_without_sinks_every_path_is_unchanged() -> None:
    q, k, v, _ = inputs()
    band = sliding_window_mask(T, 4)
    with torch.no_grad():
        assert torch.equal(attend(q, k, v, None, True, True), F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2))
        assert torch.equal(attend(q, k, v, band, False, True), F.scaled_dot_product_attention(
            q, k, v, attn_mask=band, enable_gqa=True).transpose(1, 2))
        assert torch.equal(attend(q, k, v, None, True, True, None, None),
                           attend(q, k, v, None, True, True))


@pytest.mark.parametrize("window", [None, 3])
def test_packed_documents(window: int | None) -> None:
    q, k, v, sinks = inputs(T_q=16, S=16)
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])
    layout = packed_layout(docs, window)
    mask = document_mask(docs)
    if window is not None:
        mask = mask & sliding_window_mask(16, window)
    want = reference_sink_attention(q, k, v, sinks, mask)
    assert_same(attend_packed(q, k, v, layout, True, None, sinks).transpose(1, 2), want, (q, k, v, sinks))
    assert_same(attend(q, k, v, layout, False, True, None, sinks).transpose(1, 2), want, (q, k, v, sinks))


@pytest.fixture
def one_rank_group():
    """A one-process gloo group: the context-parallel path with the gather an identity."""
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_context_parallel(one_rank_group) -> None:
    q, k, v, sinks = inputs(T_q=16, S=16)
    docs = torch.tensor([[0] * 5 + [1] * 7 + [0] * 4, [3] * 16])
    layout = context_layout(one_rank_group, docs, B, 16, torch.device("cpu")).windowed(6)
    mask = document_mask(torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [3] * 16])) & sliding_window_mask(16, 6)
    want = reference_sink_attention(q, k, v, sinks, mask)
    got = attend_context_parallel(q, k, v, layout, True, None, sinks).transpose(1, 2)
    assert_same(got, want, (q, k, v, sinks))
    assert_same(attend(q, k, v, layout, False, True, None, sinks).transpose(1, 2), want, (q, k, v, sinks))


def test_cached_decode_with_left_padding_and_window() -> None:
    """Prefill of left-padded prompts, then decode steps, each against the reference over the cache."""
    S = 9
    q, k, v, sinks = inputs(T_q=S, S=S)
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[0, :3] = False  # row 0: three pad slots on the left
    for window in (None, 4):
        cache = KVCache(1, B, HKV, S, D, device="cpu", dtype=torch.float32, valid=valid[:, :6])
        steps = [(0, 6), (6, 7), (7, 8), (8, 9)]
        for start, end in steps:
            n = end - start
            mask = cache.attn_mask(n, window)
            is_causal = mask is None and n > 1
            kk, vv = cache.update(0, k[:, :, start:end].detach(), v[:, :, start:end].detach())
            kk, vv = kk.clone().requires_grad_(), vv.clone().requires_grad_()
            qq = q[:, :, start:end].detach().clone().requires_grad_()
            got = attend(qq, kk, vv, mask, is_causal, True, None, sinks).transpose(1, 2)
            i = torch.arange(start, end).unsqueeze(1)
            j = torch.arange(end).unsqueeze(0)
            ref_mask = (valid[:, None, None, :end] & (j <= i) & ((j > i - window) if window else True)) | (j == i)
            want = reference_sink_attention(qq, kk, vv, sinks, ref_mask)
            assert_same(got, want, (qq, kk, vv, sinks))
            cache.advance(n)


def test_bf16_close_to_fp32_reference() -> None:
    q, k, v, sinks = inputs()
    want = reference_sink_attention(q, k, v, sinks, causal(T)).detach()
    with torch.no_grad():
        got = sink_attention(*(x.detach().bfloat16() for x in (q, k, v, sinks)), None, True, True)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max() < 3e-2
