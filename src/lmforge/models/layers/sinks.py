"""Attention with sinks (gpt-oss): a learned per-head logit that joins every query's softmax.

Each query head ``h`` has one more logit, ``sinks[h]``, beside its scores; it takes its share of the
softmax but carries no value: ``out = softmax([scores, sink])[:-1] @ V``. So a query may attend to
"nothing" (the outputs shrink towards zero) instead of being forced to spread a unit of attention
over the keys.

How it is computed, exactly and differentiably, through SDPA's kernels: the sink becomes one extra
key. Every head gets ``P`` extra features (``P = 8`` when ``head_dim`` is a multiple of 8, else up to
the next multiple: flash kernels want aligned head sizes), zero everywhere except

- the query's first extra feature, ``sinks[h] / scale`` (per query head, so grouped-query attention
  keeps one sink per query head);
- an extra key, placed first, whose first extra feature is 1 and whose value is 0.

That key's score is ``scale * (sinks[h] / scale) * 1 = sinks[h]`` and every real score is unchanged
(the extra features multiply zeros), so SDPA's softmax is the one with the sink column and its value
row of zeros drops the sink from the output. Gradients reach q, k, v and the sinks through SDPA's own
backward. The cost over the same attention without sinks: copies of q, k and v with ``P`` more
features (``(D + P) / D`` the score FLOPs: +12.5% at gpt-oss's 64) and one more key; no ``T x T``
tensor beyond what the mask already needs. Causal attention (queries and keys at the same positions)
keeps a mask-free call: with the sink key first, it is SDPA's lower-right causal bias
(``causal_lower_right(T, T + 1)``), which GPU kernels run without a mask tensor. Other masks (the
sliding-window band, KV-cache padding, context parallelism's gathered keys) gain one visible column.

The alternatives: an explicit softmax over ``[scores, sink]`` (Hugging Face's eager path) keeps the
``T x T`` probabilities of every head for the backward; rescaling SDPA's output by
``sigmoid(lse - sink)`` needs the kernel's log-sum-exp with a gradient, which PyTorch's SDPA does not
expose (a flash kernel that returns a differentiable lse could do it with no extra features).

Rounding: ``sinks / scale`` is rounded to the activation dtype (exact when ``scale`` is a power of two,
as at head_dim 64), and the kernel sums ``D + P`` products; in fp32 the result agrees with the
explicit softmax to about 1e-7.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

__all__ = ["sink_attention", "reference_sink_attention"]


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
