"""The chunked loss kernel: log-probabilities of target tokens without materializing the full
[tokens, vocab] logits, on one process or with the vocabulary split by tensor parallelism.

At a 152k vocabulary, 4096 tokens of fp32 logits take 2.5 GB, and the log-softmax and its gradient
as much again. Here the output projection, the fp32 softmax statistics and the gradient run chunk by
chunk over the target positions only: at any time at most one chunk's logits (and their gradient) exist.
For a sum of log-probs (cross-entropy) both gradients are computed in the forward pass while each
chunk's softmax is at hand, so nothing is recomputed; per-token log-probs whose upstream gradients
differ (GRPO) recompute each chunk's logits in the backward instead of keeping them.

There is one chunk loop (:func:`_forward_chunks`, and its backward in :class:`_ChunkedTargetLogprobs`).
Per chunk it projects the rows, has the softmax *completed* (``log p(target)``, argmax hits, entropy
where asked, the softmax for the gradient) and turns ``onehot(y) - softmax`` into the two input
gradients. What completes the softmax is the only difference between the paths: :class:`WholeVocab`
when this process holds the whole output weight (torch's own log-softmax, so the bits are those of
``F.log_softmax``), :class:`~.vocab_parallel_loss.ShardedVocab` when the weight is a vocab-sharded
DTensor (two collectives per chunk over the tensor-parallel group); on that path the heads also declare
the hidden states' gradient a partial sum (:func:`~.vocab_parallel_loss.gathered_hidden`).

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
from lmforge.losses.vocab_parallel_loss import ShardedVocab, gathered_hidden, is_vocab_sharded, sharded_vocab

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


def compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
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


class WholeVocab:
    """The softmax of a chunk whose whole vocabulary is on this process: torch's log-softmax and softmax,
    so losses and gradients have their bits. The same interface as :class:`ShardedVocab`."""

    keeps_lse = False
    """The backward recomputes the softmax from the logits alone."""

    @staticmethod
    def complete(z: Tensor, y: Tensor, want_entropy: bool) -> tuple[Tensor, Tensor, Tensor | None, None, Tensor]:
        """Of one chunk's logits ``z`` [n, V] (fp32, consumed) and targets ``y`` [n]: ``log p(y)`` [n], the
        argmax hits [n], the entropy [n] (or None), no log-sum-exp, and the log-softmax [n, V], from
        which :meth:`probs` makes the softmax."""
        hits = z.argmax(-1) == y
        logp_all = _log_softmax_(z)
        del z
        logp = logp_all.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1) if want_entropy else None
        return logp, hits, entropy, None, logp_all

    @staticmethod
    def probs(work: Tensor, lse: None) -> Tensor:
        """The softmax, over ``work`` (the log-softmax from :meth:`complete`)."""
        return work.exp_()

    @staticmethod
    def softmax(z: Tensor, lse: Tensor) -> Tensor:
        """The softmax of recomputed logits ``z``."""
        return torch.softmax(z, dim=-1)

    @staticmethod
    def add_target(grad_z: Tensor, y: Tensor, g: Tensor) -> Tensor:
        """``grad_z[i, y_i] += g_i`` (``g`` [n, 1])."""
        return grad_z.scatter_add_(-1, y.unsqueeze(-1), g)


Vocab = WholeVocab | ShardedVocab


def _add_input_grads(grad_z: Tensor, h: Tensor, w: Tensor, s: int, grad_h: Tensor | None, grad_w: Tensor | None,
                     cdtype: torch.dtype) -> None:
    """The chunk at rows ``s:`` of ``d/dz`` (``grad_z`` [n, V], in ``cdtype``) into the input gradients."""
    if grad_h is not None:
        grad_h[s:s + h.shape[0]] = grad_z @ w
    if grad_w is not None:
        add_weight_grad(grad_w, grad_z, h, cdtype)


class _Forward(NamedTuple):
    total: Tensor
    logp: Tensor
    hits: Tensor
    entropy: Tensor
    lse: Tensor
    grad_h: Tensor | None
    grad_w: Tensor | None


def _forward_chunks(hidden: Tensor, weight: Tensor, targets: Tensor, vocab: Vocab, *, chunk: int,
                    temperature: float, want_entropy: bool, cdtype: torch.dtype, need_h: bool,
                    need_w: bool) -> _Forward:
    """The chunk loop: per chunk of rows, the logits, their completed softmax statistics, and (``need_h``,
    ``need_w``) the input gradients of the *sum* of the log-probs, ``(onehot(y) - p) / T`` projected back."""
    n, dev = hidden.shape[0], hidden.device
    total = torch.zeros((), dtype=torch.float32, device=dev)
    logp = torch.empty(n, dtype=torch.float32, device=dev)
    hits = torch.empty(n, dtype=torch.bool, device=dev)
    entropy = torch.empty(n if want_entropy else 0, dtype=torch.float32, device=dev)
    lse = torch.empty(n if vocab.keeps_lse else 0, dtype=torch.float32, device=dev)
    grad_h = torch.empty_like(hidden) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
    w = weight.to(cdtype)
    with torch.autocast(dev.type, enabled=False):
        for s in range(0, n, chunk):
            h, y = hidden[s:s + chunk].to(cdtype), targets[s:s + chunk]
            lp, hits[s:s + chunk], ent, m, work = vocab.complete(_chunk_logits(h, w, temperature), y, want_entropy)
            logp[s:s + chunk] = lp
            total += lp.sum()
            if want_entropy:
                entropy[s:s + chunk] = ent
            if vocab.keeps_lse:
                lse[s:s + chunk] = m
            if need_h or need_w:
                ones = torch.ones_like(lp).unsqueeze(-1)
                grad_z = vocab.add_target(vocab.probs(work, m).neg_(), y, ones)  # over work, in place
                if temperature != 1.0:
                    grad_z.div_(temperature)
                _add_input_grads(grad_z.to(cdtype), h, w, s, grad_h, grad_w, cdtype)
                del grad_z
            del work
    return _Forward(total, logp, hits, entropy, lse, grad_h, grad_w)


class _ChunkedTargetLogprobs(torch.autograd.Function):
    """log p(target) for rows of ``hidden`` projected by ``weight``, chunk by chunk.

    The math per chunk is exactly ``log_softmax(linear(h, w).float() / T).gather(target)``; the
    backward recomputes the chunk's logits, rebuilds its softmax p and uses d logp_y / dz = onehot(y) - p.
    """

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int, temperature: float,
                want_entropy: bool, cdtype: torch.dtype, vocab: Vocab) -> tuple[Tensor, Tensor, Tensor]:
        out = _forward_chunks(hidden, weight, targets, vocab, chunk=chunk, temperature=temperature,
                              want_entropy=want_entropy, cdtype=cdtype, need_h=False, need_w=False)
        ctx.save_for_backward(hidden, weight, targets, out.lse)
        ctx.chunk, ctx.temperature, ctx.cdtype, ctx.vocab = chunk, temperature, cdtype, vocab
        ctx.mark_non_differentiable(out.hits, out.entropy)
        return out.logp, out.hits, out.entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        hidden, weight, targets, lse = ctx.saved_tensors
        chunk, temperature, cdtype, vocab = ctx.chunk, ctx.temperature, ctx.cdtype, ctx.vocab
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        w = weight.to(cdtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], chunk):
                h = hidden[s:s + chunk].to(cdtype)
                g = grad_logp[s:s + chunk].unsqueeze(-1)
                # d logp_y / dz = onehot(y) - softmax(z), times the incoming gradient, / temperature
                p = vocab.softmax(_chunk_logits(h, w, temperature), lse[s:s + chunk])
                grad_z = vocab.add_target(p.mul_(-g), targets[s:s + chunk], g)
                del p
                if temperature != 1.0:
                    grad_z.div_(temperature)
                _add_input_grads(grad_z.to(cdtype), h, w, s, grad_h, grad_w, cdtype)
                del grad_z
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype)) + (None,) * 6


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
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int, cdtype: torch.dtype,
                vocab: Vocab) -> tuple[Tensor, Tensor]:
        out = _forward_chunks(hidden, weight, targets, vocab, chunk=chunk, temperature=1.0, want_entropy=False,
                              cdtype=cdtype, need_h=ctx.needs_input_grad[0], need_w=ctx.needs_input_grad[1])
        save_precomputed_grads(ctx, out.grad_h, out.grad_w, weight.dtype)
        ctx.mark_non_differentiable(out.hits)
        return out.total, out.hits

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        return (*precomputed_grads(ctx, grad_total), None, None, None, None)


def _weight_and_vocab(weight: Tensor) -> tuple[Tensor, Vocab]:
    """The output weight this process projects with, and what completes each chunk's softmax."""
    if is_vocab_sharded(weight):
        return sharded_vocab(weight)
    return weight, WholeVocab()


def chunked_target_logprob_sum(hidden: Tensor, weight: Tensor, targets: Tensor, *,
                               chunk_tokens: int) -> tuple[Tensor, Tensor]:
    """``sum log p(target)`` over rows ``hidden`` [N, dim] and the argmax hits [N]: the cross-entropy
    path. No more than ``chunk_tokens`` rows of logits exist at once, and nothing is recomputed.

    ``weight`` [vocab, dim] is the output projection, or its vocab-sharded DTensor (then ``hidden`` are
    the same rows on every rank of its group, e.g. from :func:`gathered_hidden`)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    cdtype = compute_dtype(hidden, weight)
    w, vocab = _weight_and_vocab(weight)
    return _ChunkedLogprobSum.apply(hidden, w, targets, chunk_tokens, cdtype, vocab)


def chunked_target_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, *, chunk_tokens: int,
                            temperature: float = 1.0, entropy: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """log p(target), argmax hits and (optionally) entropy for rows ``hidden`` [N, dim], ``targets`` [N].

    ``weight`` as in :func:`chunked_target_logprob_sum`. No more than ``chunk_tokens`` rows of logits
    exist at once, in forward or backward.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    cdtype = compute_dtype(hidden, weight)
    w, vocab = _weight_and_vocab(weight)
    logp, hits, ent = _ChunkedTargetLogprobs.apply(hidden, w, targets, chunk_tokens, float(temperature), entropy,
                                                   cdtype, vocab)
    return logp, hits, ent if entropy else None


def _target_rows(hidden: Tensor, weight: Tensor, targets: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(hidden rows, targets, flat positions) of the ``mask`` positions; under tensor parallelism from the
    full sequence on every rank, with the hidden states' gradient declared a partial sum."""
    if is_vocab_sharded(weight):
        hidden = gathered_hidden(hidden, weight)
    positions = mask.flatten().nonzero().squeeze(1)
    return hidden.flatten(0, -2).index_select(0, positions), targets.flatten().index_select(0, positions), positions


class TargetLogprobSumHead:
    """Like :class:`TargetLogprobHead` for a loss that only needs the *sum* of the target log-probs
    (cross-entropy): returns ``(sum of log p(target), hits [N])`` over the ``mask`` positions, with the
    gradients computed in the forward pass (see :class:`_ChunkedLogprobSum`)."""

    def __init__(self, targets: Tensor, mask: Tensor, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        self.targets, self.mask, self.chunk_tokens = targets, mask.bool(), chunk_tokens

    def __call__(self, hidden: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        rows, targets, _ = _target_rows(hidden, weight, self.targets, self.mask)
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
        rows, targets, positions = _target_rows(hidden, weight, self.targets, self.mask)
        logp, hits, ent = chunked_target_logprobs(rows, weight, targets, chunk_tokens=self.chunk_tokens,
                                                  temperature=self.temperature, entropy=self.entropy)
        return TargetLogprobs(logp, hits, ent, positions)
