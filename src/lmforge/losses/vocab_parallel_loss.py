"""The chunked target log-probabilities of :mod:`.chunked_loss` with a vocab-sharded output weight.

Under tensor parallelism the output weight [vocab, dim] is a DTensor sharded on the vocabulary
(``Shard(0)`` on the tensor-parallel mesh): rank ``r`` holds rows ``[r * V/tp, (r + 1) * V/tp)``. No rank
ever holds a full row of logits. Per chunk each rank projects its slice, and the softmax is completed
by two collectives over the tensor-parallel group: an all-gather of every rank's (max, argmax) pair
(the global max and the first global argmax, as ``argmax`` picks it on one process), then one
all-reduce of the sums (``sum exp(z - max)``, the target's logit from the rank that owns it, and for
the entropy ``sum exp(z - max) (z - max)``). The log-sum-exp then gives ``log p(target)``,
``entropy = log s - sum e (z - max) / s`` and the softmax of each local slice for the gradient.

Gradients are exact: the weight's gradient is local to each rank's rows (``(onehot - p)^T h`` on the
slice); the hidden states' gradient ``(onehot - p) W`` is a partial sum over the slices, which
:func:`gathered_hidden` declares (``Partial``), so autograd sums it over the group on its way back
(a reduce-scatter to the sequence shards under sequence parallelism, an all-reduce otherwise).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lmforge.losses.loss_grads import add_weight_grad, precomputed_grads, save_precomputed_grads

__all__ = ["gathered_hidden", "is_vocab_sharded", "vocab_parallel_logprob_sum", "vocab_parallel_logprobs"]


def is_vocab_sharded(weight: Tensor) -> bool:
    """The output weight is a DTensor (tensor parallelism): the heads take the vocab-parallel path."""
    from torch.distributed.tensor import DTensor

    return isinstance(weight, DTensor)


def _local_weight(weight: Any) -> tuple[Tensor, Any, int]:
    """(local rows, process group, first vocab id held here) of a ``Shard(0)`` DTensor on a 1-D mesh."""
    from torch.distributed.tensor import Shard

    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(f"a vocab-sharded output weight is Shard(0) on a 1-D mesh, got {weight.placements} "
                         f"on {mesh}")
    local = weight.to_local()
    if local.shape[0] * mesh.size() != weight.shape[0]:
        raise ValueError(f"vocab {weight.shape[0]} is not split evenly over {mesh.size()} ranks")
    return local, mesh.get_group(), mesh.get_local_rank() * local.shape[0]


def gathered_hidden(hidden: Tensor, weight: Any) -> Tensor:
    """``hidden`` [B, T, dim] in full on every rank of the weight's mesh, as a plain tensor whose gradient
    is declared a partial sum (each rank contributes its vocabulary slice's share).

    ``hidden`` is a DTensor (sequence-sharded under sequence parallelism) or a plain tensor already
    equal on every rank (then it is taken as replicated)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    mesh = weight.device_mesh
    if not isinstance(hidden, DTensor):
        hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
    return hidden.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])


def _softmax_stats(z: Tensor, y: Tensor, offset: int, group: Any,
                   want_entropy: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Of one chunk's local logits ``z`` [n, V/tp] (fp32) and global targets ``y`` [n]: the log-sum-exp
    over the whole vocabulary [n], ``log p(y)`` [n], the argmax hits [n] and (optionally) the entropy."""
    n, v_local = z.shape
    world = dist.get_world_size(group)
    local_arg = z.argmax(-1)
    pairs = torch.stack([z.gather(-1, local_arg.unsqueeze(-1)).squeeze(-1).double(),
                         (local_arg + offset).double()], -1)
    gathered = torch.empty(world * n, 2, dtype=pairs.dtype, device=z.device)  # gloo wants it flat
    dist.all_gather_single(gathered, pairs, group=group)
    gathered = gathered.view(world, n, 2)
    maxes = gathered[..., 0]
    m = maxes.max(0).values
    # the first rank holding the max holds the first global argmax (ranks hold the vocabulary in order)
    first = (maxes == m).to(torch.int8).argmax(0)
    argmax = gathered[..., 1].gather(0, first.unsqueeze(0)).squeeze(0).long()
    m = m.float()
    shifted = z - m.unsqueeze(-1)
    e = shifted.exp()
    owned = (y >= offset) & (y < offset + v_local)
    target_shifted = torch.where(owned, shifted.gather(-1, (y - offset).clamp(0, v_local - 1).unsqueeze(-1))
                                 .squeeze(-1), torch.zeros((), device=z.device))
    sums = [e.sum(-1), target_shifted] + ([(e * shifted).sum(-1)] if want_entropy else [])
    sums_t = torch.stack(sums)
    dist.all_reduce(sums_t, group=group)
    log_s = sums_t[0].log()
    entropy = log_s - sums_t[2] / sums_t[0] if want_entropy else None
    return m + log_s, sums_t[1] - log_s, argmax == y, entropy


def _local_grad_z(z: Tensor, lse: Tensor, y: Tensor, offset: int, g: Tensor) -> Tensor:
    """``g * (onehot(y) - softmax(z))`` on the local vocabulary slice (the target's 1 only where held)."""
    v_local = z.shape[-1]
    grad_z = (z - lse.unsqueeze(-1)).exp_().mul_(-g.unsqueeze(-1))
    owned = (y >= offset) & (y < offset + v_local)
    idx = (y - offset).clamp(0, v_local - 1).unsqueeze(-1)
    return grad_z.scatter_add_(-1, idx, torch.where(owned, g, torch.zeros_like(g)).unsqueeze(-1))


class _VocabParallelLogprobSum(torch.autograd.Function):
    """``sum_i log p(y_i)`` with the gradients computed in the forward (as ``_ChunkedLogprobSum``)."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, w_local: Tensor, targets: Tensor, chunk: int, cdtype: torch.dtype,
                group: Any, offset: int) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        hits = torch.empty(n, dtype=torch.bool, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(w_local.shape, dtype=torch.float32, device=w_local.device) if need_w else None
        w = w_local.to(cdtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, chunk):
                y, h = targets[s:s + chunk], hidden[s:s + chunk].to(cdtype)
                z = F.linear(h, w).float()
                lse, logp, hits[s:s + chunk], _ = _softmax_stats(z, y, offset, group, False)
                total += logp.sum()
                if need_h or need_w:
                    grad_z = _local_grad_z(z, lse, y, offset, torch.ones_like(lse)).to(cdtype)
                    if grad_h is not None:
                        grad_h[s:s + chunk] = grad_z @ w
                    if grad_w is not None:
                        add_weight_grad(grad_w, grad_z, h, cdtype)
                    del grad_z
                del z
        save_precomputed_grads(ctx, grad_h, grad_w, w_local.dtype)
        ctx.mark_non_differentiable(hits)
        return total, hits

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        return (*precomputed_grads(ctx, grad_total), None, None, None, None, None)


class _VocabParallelLogprobs(torch.autograd.Function):
    """Per-row ``log p(y)`` (as ``_ChunkedTargetLogprobs``); the backward recomputes each chunk's local
    logits and uses the log-sum-exp kept from the forward, so it needs no collective of its own."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, w_local: Tensor, targets: Tensor, chunk: int, temperature: float,
                want_entropy: bool, cdtype: torch.dtype, group: Any, offset: int) -> tuple[Tensor, Tensor, Tensor]:
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        hits = torch.empty(n, dtype=torch.bool, device=hidden.device)
        entropy = torch.empty(n if want_entropy else 0, dtype=torch.float32, device=hidden.device)
        w = w_local.to(cdtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, chunk):
                z = _scaled_logits(hidden[s:s + chunk].to(cdtype), w, temperature)
                lse[s:s + chunk], logp[s:s + chunk], hits[s:s + chunk], ent = _softmax_stats(
                    z, targets[s:s + chunk], offset, group, want_entropy)
                if ent is not None:
                    entropy[s:s + chunk] = ent
                del z
        ctx.save_for_backward(hidden, w_local, targets, lse)
        ctx.chunk, ctx.temperature, ctx.cdtype, ctx.offset = chunk, temperature, cdtype, offset
        ctx.mark_non_differentiable(hits, entropy)
        return logp, hits, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        hidden, w_local, targets, lse = ctx.saved_tensors
        chunk, temperature, cdtype, offset = ctx.chunk, ctx.temperature, ctx.cdtype, ctx.offset
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(w_local.shape, dtype=torch.float32, device=w_local.device) \
            if ctx.needs_input_grad[1] else None
        w = w_local.to(cdtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], chunk):
                h = hidden[s:s + chunk].to(cdtype)
                z = _scaled_logits(h, w, temperature)
                grad_z = _local_grad_z(z, lse[s:s + chunk], targets[s:s + chunk], offset, grad_logp[s:s + chunk])
                if temperature != 1.0:
                    grad_z.div_(temperature)
                grad_z = grad_z.to(cdtype)
                if grad_h is not None:
                    grad_h[s:s + chunk] = grad_z @ w
                if grad_w is not None:
                    add_weight_grad(grad_w, grad_z, h, cdtype)
                del grad_z, z
        return (grad_h, None if grad_w is None else grad_w.to(w_local.dtype),) + (None,) * 7


def _scaled_logits(h: Tensor, w: Tensor, temperature: float) -> Tensor:
    z = F.linear(h, w).float()
    return z / temperature if temperature != 1.0 else z


def vocab_parallel_logprob_sum(rows: Tensor, weight: Any, targets: Tensor, *, chunk_tokens: int,
                               cdtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``sum log p(target)`` and the hits over ``rows`` [N, dim] (the same rows on every rank of the
    group, e.g. from :func:`gathered_hidden`) with ``weight`` the vocab-sharded DTensor."""
    w_local, group, offset = _local_weight(weight)
    return _VocabParallelLogprobSum.apply(rows, w_local, targets, chunk_tokens, cdtype, group, offset)


def vocab_parallel_logprobs(rows: Tensor, weight: Any, targets: Tensor, *, chunk_tokens: int, temperature: float,
                            entropy: bool, cdtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None]:
    """Per-row ``log p(target)``, hits and (optionally) entropy, as :func:`vocab_parallel_logprob_sum`."""
    w_local, group, offset = _local_weight(weight)
    logp, hits, ent = _VocabParallelLogprobs.apply(rows, w_local, targets, chunk_tokens, float(temperature), entropy,
                                                   cdtype, group, offset)
    return logp, hits, ent if entropy else None
