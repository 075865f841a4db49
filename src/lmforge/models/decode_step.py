"""One decode step (a single new token per row) written as a flat function over fused weights.

At decode time every matmul has only ``batch`` rows, so a step's cost is mostly per-call
overhead: module calls, small kernels, and matmuls too thin to run near peak. This step does the
same math as ``Transformer.forward`` with a ``KVCache`` and one token, but

- calls no modules: the weights are read once per ``generate`` into :class:`DecodeWeights`;
- fuses ``wq|wk|wv`` and ``w1|w3`` into one matmul each (fewer calls; on the 2-vCPU CPU the
  matmul time itself was unchanged), and rotates q and k with one RoPE call since they sit side
  by side;
- takes the step's RoPE rows precomputed for all steps, and writes the cache slot directly;
- on CPU, for 4 rows or more, keeps the weights transposed ([in, out], contiguous) and multiplies
  ``x @ W``: with MKL the ``small`` model's step matmuls took 3.1 ms against 3.9 ms for
  ``linear(x, W)`` at 8 rows and 9.0 against 10.3 ms at 64 (medians of 15 interleaved
  repeats), bit-identical from 4 rows up (below 4 rows MKL takes a matrix-vector path that sums
  in another order, so small batches keep ``linear`` and match the model exactly).

Only plain models of a family whose spec says ``fused_decode`` qualify (:func:`supports`): adapters
(LoRA), sharded parameters (FSDP, TP) or forward hooks need the modules' own forward, which
``generate`` then uses instead. The step covers the dense decoder's switches: q/k/v bias, q/k
norms, explicit ``head_dim`` and the sliding window.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmforge.models.args import ModelArgs
from lmforge.models.layers.kv_cache import KVCache
from lmforge.models.layers.mlp import gated_activation
from lmforge.models.layers.norm import rms_norm
from lmforge.models.layers.rope import apply_rope
from lmforge.models.model import Transformer
from lmforge.models.spec import spec_for_args

FUSE_LIMIT_BYTES = 1 << 30
"""Fused copies of q|k|v and w1|w3 cost extra memory of about their own size; above this the
step multiplies by the separate weights instead (large models gain little from fusing)."""


@dataclass
class LayerWeights:
    attention_norm: Tensor
    qkv: Tensor | tuple[Tensor, ...]
    qkv_bias: Tensor | tuple[Tensor, ...] | None
    q_norm: Tensor | None
    k_norm: Tensor | None
    wo: Tensor
    ffn_norm: Tensor
    w13: Tensor | tuple[Tensor, ...]
    w2: Tensor


@dataclass
class DecodeWeights:
    """A model's weights laid out for :func:`decode_step` (fused where :data:`FUSE_LIMIT_BYTES` allows)."""

    embedding: Tensor
    layers: list[LayerWeights]
    norm: Tensor
    output: Tensor
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    eps: float
    sliding_window: int | None
    transposed: bool = False
    """Matrices stored as [in, out] (``x @ W``) instead of [out, in] (``linear(x, W)``)."""

    @classmethod
    def from_model(cls, model: Transformer, fuse: bool = True, transpose: bool = False) -> DecodeWeights:
        """``transpose`` (only with fusing, whose copies it then lays out) also copies ``wo``, ``w2``
        and the output matrix."""
        a = model.args
        fused = fuse and sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                    if n.rsplit(".", 2)[-2] in ("wq", "wk", "wv", "w1", "w3")) <= FUSE_LIMIT_BYTES
        transpose = transpose and fused
        t = (lambda w: w.t().contiguous()) if transpose else (lambda w: w)
        join = (lambda *ts: t(torch.cat(ts))) if fused else (lambda *ts: ts)
        layers = []
        for blk in model.layers:
            at, ff = blk.attention, blk.feed_forward
            bias = None if at.wq.bias is None else join(at.wq.bias, at.wk.bias, at.wv.bias)
            layers.append(LayerWeights(
                blk.attention_norm.weight, join(at.wq.weight, at.wk.weight, at.wv.weight), bias,
                None if at.q_norm is None else at.q_norm.weight, None if at.k_norm is None else at.k_norm.weight,
                t(at.wo.weight), blk.ffn_norm.weight, join(ff.w1.weight, ff.w3.weight), t(ff.w2.weight),
            ))
        return cls(model.tok_embeddings.weight, layers, model.norm.weight, t(model.output.weight), a.n_heads,
                   a.kv_heads, a.head_dim, a.ffn_dim, a.norm_eps, a.sliding_window, transpose)


def _plain_switches(a: ModelArgs) -> bool:
    """Whether ``a`` stays within what :func:`_forward` computes: SwiGLU, Llama's RMSNorm, per-head q/k
    norms, one window and one RoPE for every layer, the default softmax scale, a dense MLP."""
    return (a.hidden_act == "silu" and not (a.norm_unit_offset or a.embed_scale or a.sandwich_norm)
            and a.attn_scale is None and a.layer_types is None and a.local_rope_theta is None
            and a.n_experts == 0 and a.qk_norm_per_head)


def supports(model: nn.Module) -> bool:
    """Whether :func:`decode_step` computes exactly what ``model``'s own forward would.

    The family's spec must declare ``fused_decode`` and ``model.args`` may use only the switches the
    step implements (:func:`_plain_switches`: no Gemma norms, GeGLU, softmax scale, per-layer windows
    or experts, whatever the family). The step bypasses module calls, so anything
    that acts through them rules it out too: replaced linear layers (LoRA adapters), parameters
    that are not plain tensors (FSDP / tensor-parallel DTensors), and forward hooks (on any
    module, or global ones).
    """
    if type(model) is not Transformer or not spec_for_args(model.args).fused_decode or not _plain_switches(model.args):
        return False
    from torch.nn.modules import module as module_mod

    if module_mod._global_forward_hooks or module_mod._global_forward_pre_hooks:
        return False
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return False
    linears = [model.output] + [m for blk in model.layers for m in (
        blk.attention.wq, blk.attention.wk, blk.attention.wv, blk.attention.wo,
        blk.feed_forward.w1, blk.feed_forward.w2, blk.feed_forward.w3)]
    if any(type(m) is not nn.Linear for m in linears) or type(model.tok_embeddings) is not nn.Embedding:
        return False
    return all(type(p) in (Tensor, nn.Parameter) for p in model.parameters())


def _linear(x: Tensor, w: Tensor | tuple[Tensor, ...], b: Tensor | tuple[Tensor, ...] | None = None,
            transposed: bool = False) -> Tensor:
    if not isinstance(w, Tensor):  # unfused: one matmul per part
        bs = b if b is not None else (None,) * len(w)
        return torch.cat([F.linear(x, wi, bi) for wi, bi in zip(w, bs)], dim=-1)
    if transposed:
        return torch.mm(x, w) if b is None else torch.addmm(b, x, w)  # type: ignore[arg-type]
    return F.linear(x, w, b)  # type: ignore[arg-type]


KVWrite = Callable[[int, Tensor, Tensor], tuple[Tensor, Tensor]]
"""(layer, k [B, Hkv, hd], v [B, Hkv, hd]) -> the keys and values [B, Hkv, S, hd] to attend over."""


def _forward(w: DecodeWeights, tok: Tensor, cos: Tensor, sin: Tensor, write: KVWrite, mask: Tensor | None) -> Tensor:
    """The transformer over one token per row: logits [B, vocab]."""
    B = tok.shape[0]
    H, Hkv, hd = w.n_heads, w.n_kv_heads, w.head_dim
    nq, nk = H * hd, Hkv * hd
    h = F.embedding(tok, w.embedding)
    for i, lw in enumerate(w.layers):
        qkv = _linear(rms_norm(h, lw.attention_norm, w.eps), lw.qkv, lw.qkv_bias, w.transposed)
        if lw.q_norm is not None and lw.k_norm is not None:
            q = apply_rope(rms_norm(qkv[:, :nq].view(B, H, hd), lw.q_norm, w.eps), cos, sin)
            k = apply_rope(rms_norm(qkv[:, nq:nq + nk].view(B, Hkv, hd), lw.k_norm, w.eps), cos, sin)
        else:  # q and k are adjacent columns: rotate both at once
            qk = apply_rope(qkv[:, :nq + nk].view(B, H + Hkv, hd), cos, sin)
            q, k = qk[:, :H], qk[:, H:]
        keys, values = write(i, k, qkv[:, nq + nk:].view(B, Hkv, hd))
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, enable_gqa=H != Hkv)
        h = h + _linear(out.reshape(B, nq), lw.wo, transposed=w.transposed)
        gu = _linear(rms_norm(h, lw.ffn_norm, w.eps), lw.w13, transposed=w.transposed)
        h = h + _linear(gated_activation(gu[:, :w.ffn_dim], gu[:, w.ffn_dim:], "silu"), lw.w2, transposed=w.transposed)
    return _linear(rms_norm(h, w.norm, w.eps), w.output, transposed=w.transposed)


def decode_step(w: DecodeWeights, tok: Tensor, cos: Tensor, sin: Tensor, cache: KVCache) -> Tensor:
    """Logits [B, vocab] for tokens ``tok`` [B] written at the cache's next slot.

    ``cos``/``sin`` [B, 1, head_dim] are the rows' RoPE tables at their current positions (signed
    sin, as ``RotaryEmbedding`` returns them). Attends over the filled slots only (their number
    grows by one per step) and advances the cache by one slot.
    """
    slot = cache.pos
    end = slot + 1
    if end > cache.max_len:
        cache.attn_mask(1, None)  # raises the cache-full error
    lo = max(0, end - w.sliding_window) if w.sliding_window is not None else 0

    def write(i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        kc, vc = cache.k[i], cache.v[i]
        kc[:, :, slot] = k
        vc[:, :, slot] = v
        return kc[:, :, lo:end], vc[:, :, lo:end]

    logits = _forward(w, tok, cos, sin, write, None if cache.bias is None else cache.bias[:, None, None, lo:end])
    cache.advance(1)
    return logits


def decode_step_static(w: DecodeWeights, tok: Tensor, cos: Tensor, sin: Tensor, slot: Tensor,
                       k_cache: list[Tensor], v_cache: list[Tensor], bias: Tensor) -> Tensor:
    """:func:`decode_step` with every shape fixed, for CUDA graphs: the slot is a device tensor.

    Attends over the whole cache (``max_len`` slots) with an additive mask: ``bias`` [B, max_len]
    (0 or -inf for padding) plus -inf for the slots after ``slot`` (and before the sliding window).
    The caller advances ``slot``.
    """
    cols = torch.arange(bias.shape[1], device=bias.device)
    keep = cols <= slot
    if w.sliding_window is not None:
        keep = keep & (cols > slot - w.sliding_window)
    mask = bias.masked_fill(~keep, float("-inf"))[:, None, None, :]
    at = slot.view(1)

    def write(i: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        k_cache[i].index_copy_(2, at, k.unsqueeze(2))
        v_cache[i].index_copy_(2, at, v.unsqueeze(2))
        return k_cache[i], v_cache[i]

    return _forward(w, tok, cos, sin, write, mask)
