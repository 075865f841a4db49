"""Log-probabilities of target tokens without materializing the full [tokens, vocab] logits.

At a 152k vocabulary, 4096 tokens of fp32 logits take 2.5 GB, and the log-softmax and its gradient
as much again. Here the output projection, the fp32 log-softmax and its gradient run chunk by chunk
over the target positions only: at any time at most one chunk's logits (and their gradient) exist.
For a sum of log-probs (cross-entropy) both gradients are computed in the forward pass while each
chunk's softmax is at hand, so nothing is recomputed; per-token log-probs whose upstream gradients
differ (GRPO) recompute each chunk's logits in the backward instead of keeping them.

Used through :class:`TargetLogprobHead`, which ``Transformer.forward(..., head=...)`` calls with the
final hidden states and the output weight *inside* the model's forward, so that wrappers (DDP,
FSDP2) see an ordinary forward call: FSDP2 guarantees the root's parameters (the output projection
among them) are unsharded only during that call.

Selecting the target positions (``mask``) needs their count on the host: one device sync per call,
paid back many times over by projecting only those positions (SFT masks most prompt tokens).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from lmforge.losses.loss_grads import add_weight_grad, precomputed_grads, save_precomputed_grads
from lmforge.losses.vocab_parallel_loss import (
    gathered_hidden,
    is_vocab_sharded,
    vocab_parallel_logprob_sum,
    vocab_parallel_logprobs,
)

DEFAULT_CHUNK_TOKENS = 1024
"""Tokens per chunk: 1024 x 152k fp32 logits are 0.6 GB, and a 1024-row matmul still fills a GPU."""


class TargetLogprobs(NamedTuple):
    """Per target position (in row-major order of the selected positions of [B, T])."""

    logprobs: Tensor
    """[N] log p(target) under softmax(logits / temperature), fp32, differentiable."""
    hits: Tensor
    """[N] bool: the target is the argmax of the logits (no grad)."""
    entropy: Tensor | None
    """[N] entropy of softmax(logits / temperature) (no grad); None unless asked for."""
    positions: Tensor
    """[N] flat indices into [B * T] of the selected positions."""

    def dense(self, values: Tensor, shape: torch.Size) -> Tensor:
        """``values`` [N] placed at their positions in a zero tensor of ``shape`` (differentiable)."""
        flat = values.new_zeros(shape.numel()).index_copy(0, self.positions, values)
        return flat.view(shape)


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype the output matmul runs in: the autocast dtype when autocast is on, as ``nn.Linear``."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _chunk_logits(h: Tensor, w: Tensor, temperature: float) -> Tensor:
    """fp32 logits / temperature of one chunk; the matmul in the dtype of ``h`` and ``w``."""
    z = F.linear(h, w).float()
    return z / temperature if temperature != 1.0 else z


def _log_softmax_(z: Tensor) -> Tensor:
    """``log_softmax(z, -1)`` written over ``z`` (fp32, owned by the caller) on a CPU: the same kernel and
    bits as ``F.log_softmax``, without a second chunk-sized buffer (at a 49k vocabulary, 1024 rows are
    0.2 GB). Elsewhere out of place: the in-place use of the private kernel is checked on CPUs only."""
    if z.device.type != "cpu":
        return F.log_softmax(z, dim=-1)
    return torch._log_softmax(z, -1, False, out=z)


class _ChunkedTargetLogprobs(torch.autograd.Function):
    """log p(target) for rows of ``hidden`` projected by ``weight``, chunk by chunk.

    The math per chunk is exactly ``log_softmax(linear(h, w).float() / T).gather(target)``; the
    backward rebuilds the chunk's softmax p and uses d logp_y / dz = onehot(y) - p.
    """

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int, temperature: float,
                want_entropy: bool, cdtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        hits = torch.empty(n, dtype=torch.bool, device=hidden.device)
        entropy = torch.empty(n if want_entropy else 0, dtype=torch.float32, device=hidden.device)
        w = weight.to(cdtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, chunk):
                y = targets[s:s + chunk]
                z = _chunk_logits(hidden[s:s + chunk].to(cdtype), w, temperature)
                hits[s:s + chunk] = z.argmax(-1) == y
                logp_all = _log_softmax_(z)
                del z
                logp[s:s + chunk] = logp_all.gather(-1, y.unsqueeze(-1)).squeeze(-1)
                if want_entropy:
                    entropy[s:s + chunk] = -(logp_all.exp() * logp_all).sum(-1)
                del logp_all
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk, ctx.temperature, ctx.cdtype = chunk, temperature, cdtype
        ctx.mark_non_differentiable(hits, entropy)
        return logp, hits, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        hidden, weight, targets = ctx.saved_tensors
        chunk, temperature, cdtype = ctx.chunk, ctx.temperature, ctx.cdtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        w = weight.to(cdtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], chunk):
                h = hidden[s:s + chunk].to(cdtype)
                g = grad_logp[s:s + chunk].unsqueeze(-1)
                # d logp_y / dz = onehot(y) - softmax(z), times the incoming gradient, / temperature
                grad_z = torch.softmax(_chunk_logits(h, w, temperature), dim=-1).mul_(-g)
                grad_z.scatter_add_(-1, targets[s:s + chunk].unsqueeze(-1), g)
                if temperature != 1.0:
                    grad_z.div_(temperature)
                grad_z = grad_z.to(cdtype)
                if grad_h is not None:
                    grad_h[s:s + chunk] = grad_z @ w
                if grad_w is not None:
                    add_weight_grad(grad_w, grad_z, h, cdtype)
                del grad_z
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None, None)


class _ChunkedLogprobSum(torch.autograd.Function):
    """``sum_i log p(y_i)`` (the negative summed cross-entropy), chunk by chunk, with both input
    gradients computed in the forward pass.

    The gradient of a *sum* of log-probs w.r.t. each chunk's logits is ``onehot(y) - softmax(z)``
    whatever comes after, up to one scalar (the upstream gradient of the sum). So the forward
    accumulates ``d/dhidden`` and ``d/dweight`` while each chunk's softmax is at hand, and the backward
    only scales them: no second projection and softmax, unlike the per-token path above (whose
    upstream gradients differ per token, as in GRPO). Memory: one chunk of logits at a time plus the
    two gradients, which are the size of ``hidden`` and ``weight`` (the weight's gradient exists
    after the backward anyway).
    """

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int,
                cdtype: torch.dtype) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        hits = torch.empty(n, dtype=torch.bool, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        w = weight.to(cdtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, chunk):
                y = targets[s:s + chunk].unsqueeze(-1)
                h = hidden[s:s + chunk].to(cdtype)
                z = F.linear(h, w).float()
                hits[s:s + chunk] = z.argmax(-1) == y.squeeze(-1)
                logp_all = _log_softmax_(z)
                del z
                total += logp_all.gather(-1, y).sum()
                if need_h or need_w:
                    grad_z = logp_all.exp_().neg_().scatter_add_(-1, y, torch.ones_like(y, dtype=torch.float32))
                    grad_z = grad_z.to(cdtype)
                    if grad_h is not None:
                        grad_h[s:s + chunk] = grad_z @ w
                    if grad_w is not None:
                        add_weight_grad(grad_w, grad_z, h, cdtype)
                    del grad_z
                del logp_all
        save_precomputed_grads(ctx, grad_h, grad_w, weight.dtype)
        ctx.mark_non_differentiable(hits)
        return total, hits

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        return (*precomputed_grads(ctx, grad_total), None, None, None)


def chunked_target_logprob_sum(hidden: Tensor, weight: Tensor, targets: Tensor, *,
                               chunk_tokens: int) -> tuple[Tensor, Tensor]:
    """``sum log p(target)`` over rows ``hidden`` [N, dim] and the argmax hits [N]: the cross-entropy
    path. No more than ``chunk_tokens`` rows of logits exist at once, and nothing is recomputed."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return _ChunkedLogprobSum.apply(hidden, weight, targets, chunk_tokens, _compute_dtype(hidden, weight))


def chunked_target_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, *, chunk_tokens: int,
                            temperature: float = 1.0, entropy: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """log p(target), argmax hits and (optionally) entropy for rows ``hidden`` [N, dim], ``targets`` [N].

    ``weight`` [vocab, dim] is the output projection. No more than ``chunk_tokens`` rows of logits
    exist at once, in forward or backward.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    logp, hits, ent = _ChunkedTargetLogprobs.apply(hidden, weight, targets, chunk_tokens, float(temperature),
                                                   entropy, _compute_dtype(hidden, weight))
    return logp, hits, ent if entropy else None


class TargetLogprobSumHead:
    """Like :class:`TargetLogprobHead` for a loss that only needs the *sum* of the target log-probs
    (cross-entropy): returns ``(sum of log p(target), hits [N])`` over the ``mask`` positions, with the
    gradients computed in the forward pass (see :class:`_ChunkedLogprobSum`)."""

    def __init__(self, targets: Tensor, mask: Tensor, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        self.targets, self.mask, self.chunk_tokens = targets, mask.bool(), chunk_tokens

    def __call__(self, hidden: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        sharded = is_vocab_sharded(weight)  # tensor parallelism: see lmforge.losses.vocab_parallel_loss
        if sharded:
            hidden = gathered_hidden(hidden, weight)
        positions = self.mask.flatten().nonzero().squeeze(1)
        rows = hidden.flatten(0, -2).index_select(0, positions)
        targets = self.targets.flatten().index_select(0, positions)
        if sharded:
            return vocab_parallel_logprob_sum(rows, weight, targets, chunk_tokens=self.chunk_tokens,
                                              cdtype=_compute_dtype(rows, weight))
        return chunked_target_logprob_sum(rows, weight, targets, chunk_tokens=self.chunk_tokens)


class TargetLogprobHead:
    """What ``Transformer.forward(..., head=...)`` calls in place of the output projection.

    ``targets`` [B, T] are the tokens to score; ``mask`` [B, T] (bool or 0/1) selects the positions
    to compute at all (default: every position). Returns :class:`TargetLogprobs` for those positions.
    """

    def __init__(self, targets: Tensor, mask: Tensor | None = None, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 temperature: float = 1.0, entropy: bool = False) -> None:
        self.targets, self.chunk_tokens, self.temperature, self.entropy = targets, chunk_tokens, temperature, entropy
        self.mask = torch.ones_like(targets, dtype=torch.bool) if mask is None else mask.bool()

    def __call__(self, hidden: Tensor, weight: Tensor) -> TargetLogprobs:
        sharded = is_vocab_sharded(weight)  # tensor parallelism: see lmforge.losses.vocab_parallel_loss
        if sharded:
            hidden = gathered_hidden(hidden, weight)
        positions = self.mask.flatten().nonzero().squeeze(1)
        rows = hidden.flatten(0, -2).index_select(0, positions)
        targets = self.targets.flatten().index_select(0, positions)
        if sharded:
            logp, hits, ent = vocab_parallel_logprobs(rows, weight, targets, chunk_tokens=self.chunk_tokens,
                                                      temperature=self.temperature, entropy=self.entropy,
                                                      cdtype=_compute_dtype(rows, weight))
            return TargetLogprobs(logp, hits, ent, positions)
        logp, hits, ent = chunked_target_logprobs(rows, weight, targets, chunk_tokens=self.chunk_tokens,
                                                  temperature=self.temperature, entropy=self.entropy)
        return TargetLogprobs(logp, hits, ent, positions)
