"""Attention with sinks (gpt-oss): a learned per-head logit that joins every query's softmax.

Each query head ``h`` has one more logit, ``sinks[h]``, beside its scores; it takes its share of the
softmax but carries no value: ``out = softmax([scores, sink])[:-1] @ V``. So a query may attend to
"nothing" (the outputs shrink towards zero) instead of being forced to spread a unit of attention
over the keys. Both implementations below are exact (values and gradients of q, k, v and the sinks)
and never hold the ``T x S`` probabilities for the backward, as an explicit softmax over
``[scores, sink]`` (Hugging Face's eager path, :func:`reference_sink_attention`) does.

**On a CPU: the flash kernel's log-sum-exp** (:class:`_FlashSinkCPU`). With the sink, the softmax's
normaliser is ``lse' = logaddexp(lse, sink)``, so the output is SDPA's rescaled:
``y = o * exp(lse - lse') = o * sigmoid(lse - sink)``. PyTorch gives no gradient through SDPA's lse, but
none is needed: ``y`` *is* flash attention with probabilities ``exp(s - lse')`` and output ``y``, so the
kernel's own backward, handed ``lse'`` and ``y`` in place of what its forward returned, gives the exact
gradients of q, k and v; the sink's is one reduction. Cost over plain SDPA: the rescale (measured fp32,
B 4, 8 heads over 2 kv heads, T 512, head_dim 64, forward + backward on the 2-vCPU CPU: 244 ms against
216 ms for causal SDPA without sinks; the explicit softmax took 875 ms). The kernel wants an additive
mask, so a boolean one (sliding window, KV-cache padding, context parallelism) is converted per call.

**Elsewhere (GPUs): the sink as one extra key**, through ``F.scaled_dot_product_attention`` and whatever
kernel it picks. Every head gets ``P`` extra features (8, or up to the next multiple of 8: flash kernels
want aligned head sizes), zero except the query's first, ``sinks[h] / scale``, and that of an extra key,
placed first, which is 1 (its value is 0). That key's score is exactly the sink and every real score is
unchanged, so SDPA's softmax is the one with the sink column, and its zero value drops it from the output;
gradients come from SDPA's backward. Causal attention keeps a mask-free call (with the sink key first it
is the lower-right causal bias ``causal_lower_right(T, T + 1)``); other masks gain one visible column.
Cost: ``(D + P) / D`` the score FLOPs (+12.5% at gpt-oss's 64) and copies of q, k, v. On CPUs this path is
slow (the CPU kernel runs head sizes that are not a power of two several times slower), hence the
lse path there; on CUDA the same lse trick would need the flash / memory-efficient kernels' backward ops
called the same way (not done: untested without a GPU).

Rounding: the extra key rounds ``sinks / scale`` to the activation dtype (exact when ``scale`` is a power
of two, as at head_dim 64); the lse path rescales in fp32. In fp32 both agree with the explicit softmax to
about 1e-7 relative.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.nn.attention.bias import causal_lower_right

__all__ = ["sink_attention", "reference_sink_attention"]


CPU_FLASH = True
"""On a CPU, run sinks through the flash kernel's log-sum-exp (:class:`_FlashSinkCPU`); False: the extra key."""

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _FlashSinkCPU(torch.autograd.Function):
    """Sink attention on PyTorch's CPU flash kernel, from its log-sum-exp, with an exact backward.

    Forward: ``o, lse = flash(q, k, v)``; with the sink, the softmax's normaliser is ``lse' = logaddexp(lse,
    sink)``, so ``y = o * exp(lse - lse')``. Backward: ``y`` is flash attention whose probabilities are
    ``exp(s - lse')`` (the sink's column dropped) and whose output is ``y``; the kernel's backward recomputes
    ``P = exp(s - lse)`` from the lse it is given and forms ``dS = P * (dP - rowsum(dy * out))`` from the
    output it is given, so handing it ``lse'`` and ``y`` gives the exact gradients of q, k and v. The sink's
    own: ``d sink = -sum_i p_sink_i * rowsum(dy_i * y_i)`` with ``p_sink = exp(sink - lse')``."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, mask: Tensor | None,  # type: ignore[override]
                is_causal: bool, scale: float) -> Tensor:
        out, lse = _FLASH_CPU(q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
        lse_all = torch.logaddexp(lse, sinks.float().view(1, -1, 1))
        y = (out.float() * torch.exp(lse - lse_all).unsqueeze(-1)).to(out.dtype)
        ctx.save_for_backward(q, k, v, sinks, mask, y, lse_all)
        ctx.is_causal, ctx.scale = is_causal, scale
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        q, k, v, sinks, mask, y, lse_all = ctx.saved_tensors
        dy = dy.contiguous()
        dq, dk, dv = _FLASH_CPU_BACKWARD(dy, q, k, v, y, lse_all, 0.0, ctx.is_causal, attn_mask=mask, scale=ctx.scale)
        p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse_all)
        dsink = -(p_sink * (dy.float() * y.float()).sum(-1)).sum((0, 2))
        return dq, dk, dv, dsink.to(sinks.dtype), None, None, None


def _flash_cpu_sink_attention(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, mask: Tensor | None, is_causal: bool,
                              scale: float) -> Tensor:
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else q.dtype
    q, k, v = (x.to(dtype) for x in (q, k, v))
    if mask is not None:  # the kernel takes an additive mask in the activation dtype
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf")) if mask.dtype == torch.bool \
            else mask.to(dtype)
        is_causal = False
    with torch.autocast("cpu", enabled=False):
        return _FlashSinkCPU.apply(q, k, v, sinks, mask, is_causal and q.shape[-2] == k.shape[-2], scale)


def _extra_features(head_dim: int) -> int:
    return 8 - head_dim % 8 if head_dim % 8 else 8


def sink_attention(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, mask: Tensor | None, is_causal: bool, enable_gqa: bool,
    scale: float | None = None,
) -> Tensor:
    """Attention of q [B, H, T, D] over k, v [B, Hkv, S, D] with per-head ``sinks`` [H] -> [B, H, T, D].

    ``mask``: a boolean SDPA mask (True: may attend) or an additive float one, [..., T, S]; None with
    ``is_causal``: causal (key ``j`` visible to query ``i`` iff ``j <= i``, SDPA's convention), None
    without: every key. ``scale`` None is ``1/sqrt(D)``.
    """
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    s = D ** -0.5 if scale is None else scale
    if CPU_FLASH and q.device.type == "cpu" and not any(isinstance(x, DTensor) for x in (q, k, v, sinks)) and (
            mask is not None or not is_causal or T == S):
        return _flash_cpu_sink_attention(q, k, v, sinks, mask, is_causal, s)
    P = _extra_features(D)
    sink_q = (sinks.float() / s).to(q.dtype).view(1, H, 1, 1).expand(B, H, T, 1)
    q = torch.cat([q, sink_q, q.new_zeros(B, H, T, P - 1)], dim=-1)
    sink_key = k.new_zeros(B, Hkv, 1, D + P)
    sink_key[..., D] = 1
    k = torch.cat([sink_key, torch.cat([k, k.new_zeros(B, Hkv, S, P)], dim=-1)], dim=2)
    v = torch.cat([v.new_zeros(B, Hkv, 1, D), v], dim=2)
    attn_mask: Tensor | object | None
    if mask is None:
        if not is_causal:
            attn_mask = None
        elif T == S:
            attn_mask = causal_lower_right(T, S + 1)
        else:  # SDPA's top-left convention: query i sees keys j <= i
            i = torch.arange(T, device=q.device).unsqueeze(1)
            j = torch.arange(S + 1, device=q.device).unsqueeze(0)
            attn_mask = j <= i + 1
    else:
        first = (mask.new_ones if mask.dtype == torch.bool else mask.new_zeros)(*mask.shape[:-1], 1)
        attn_mask = torch.cat([first, mask], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa,  # type: ignore[arg-type]
                                          scale=s)


def reference_sink_attention(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, mask: Tensor | None, scale: float | None = None,
) -> Tensor:
    """The definition, written out (Hugging Face's eager gpt-oss attention): ``softmax([q k^T * scale + mask,
    sink])[..., :-1] @ v`` with k, v repeated per query head; ``mask`` boolean or additive, None: none.
    For tests; keeps the ``T x S`` probabilities of every head."""
    B, H, T, D = q.shape
    g = H // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = (q @ k.transpose(-1, -2)) * (D ** -0.5 if scale is None else scale)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    logits = torch.cat([scores, sinks.view(1, H, 1, 1).expand(B, H, T, 1).to(scores.dtype)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v
