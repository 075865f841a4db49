"""Causal self-attention: SDPA's kernel, or explicit bf16 matmuls for short sequences on a CPU.

On a CPU, PyTorch's flash-attention kernel runs bf16 no faster than fp32 at the head sizes of small
models (head_dim 32-64): it works in small tiles whose bookkeeping outweighs the matmuls. At 256
tokens it took 45% of a ``small`` model's bf16 training step, against 8% of the step's FLOPs. Written
out as two bf16 batched matmuls around a softmax, the same attention runs about twice as fast
forward and backward (``bench/step_profile.py``), because the matmuls go to the bf16 GEMM at full
speed. The price is memory: the [T, T] probabilities of each head are kept for the backward (bf16,
``2 * heads * T^2`` bytes per sequence and layer), which is why it is used only up to
:data:`EXPLICIT_MAX_LEN` tokens, where flash's tiling wins anyway (measured: at 512 tokens the two
are even, at 1024 flash is faster).

Numerics are those of eager bf16 attention (Hugging Face's ``eager`` path): scores rounded to bf16,
softmax computed in fp32 inside the kernel and rounded to bf16 before the value matmul. The flash
kernel keeps scores in fp32 but rounds the probabilities to bf16 as well; against an fp32 reference
both are off by a few bf16 ulps (the test in tests/test_bf16_numerics.py bounds it). fp32 and every
GPU keep SDPA unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from lmforge.models.layers.sinks import sink_attention

__all__ = ["EXPLICIT_MAX_LEN", "causal_attention", "explicit_causal_attention"]

EXPLICIT_MAX_LEN = 256
"""Longest sequence the explicit bf16 path takes on a CPU; longer ones go to SDPA's flash kernel."""

_masks: dict[tuple[int, torch.device], Tensor] = {}


def _causal_bias(T: int, device: torch.device) -> Tensor:
    """[T, T] bf16: 0 on and below the diagonal, -inf above; added to the scores. An addition (not
    ``masked_fill``) has a free backward, and the softmax already gives the masked entries zero gradient."""
    key = (T, device)
    if key not in _masks:
        _masks[key] = torch.full((T, T), float("-inf"), dtype=torch.bfloat16, device=device).triu(1)
    return _masks[key]


def explicit_causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """Causal attention of q [B, H, T, D] over k [B, Hkv, T, D], v [B, Hkv, T, Dv] (bf16) -> [B, H, T, Dv]
    (``Dv`` may differ from ``D``: latent attention's values are narrower than its keys).

    Grouped-query attention without copying k and v per query head: the ``H / Hkv`` query heads that
    share a key head are stacked as extra rows of one matmul against it. The scale is applied to q
    (``T x D`` values rather than ``T x T`` scores).
    """
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    g = H // Hkv
    qs = (q * (D ** -0.5 if scale is None else scale)).reshape(B, Hkv, g * T, D)
    scores = (qs @ k.transpose(-1, -2)).view(B, Hkv, g, T, T) + _causal_bias(T, q.device)
    probs = torch.softmax(scores, dim=-1).view(B, Hkv, g * T, T)
    return (probs @ v).view(B, H, T, v.shape[-1])


def _bf16(*xs: Tensor) -> bool:
    """The attention would run in bf16: bf16 inputs, or bf16 autocast (which casts SDPA's inputs)."""
    if any(isinstance(x, DTensor) for x in xs):  # tensor-parallel activations: left to SDPA's sharding rules
        return False
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu") == torch.bfloat16
    return all(x.dtype == torch.bfloat16 for x in xs)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool, scale: float | None = None,
                     sinks: Tensor | None = None) -> Tensor:
    """Causal self-attention of q [B, H, T, D] over k, v [B, Hkv, T, D] -> [B, H, T, D] (queries and keys
    at the same positions): the explicit bf16 path on a CPU for sequences up to :data:`EXPLICIT_MAX_LEN`,
    SDPA with ``is_causal=True`` otherwise. With ``sinks`` [H] (gpt-oss), always
    :func:`~lmforge.models.layers.sinks.sink_attention` (SDPA with the sink as an extra key)."""
    if sinks is not None:
        return sink_attention(q, k, v, sinks, None, True, enable_gqa, scale)
    T = q.shape[-2]
    if q.device.type == "cpu" and 1 < T <= EXPLICIT_MAX_LEN and k.shape[-2] == T and _bf16(q, k, v):
        # under autocast q and k arrive in fp32 (RoPE's fp32 tables promote them): SDPA would cast them too
        q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
        return explicit_causal_attention(q, k, v, scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa, scale=scale)
