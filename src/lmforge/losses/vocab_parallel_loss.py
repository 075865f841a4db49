"""The vocabulary-parallel path of the chunked loss kernel (:mod:`.chunked_loss`): how one chunk's softmax
is completed when the output weight is split over the vocabulary, and how the hidden states reach it.

Under tensor parallelism the output weight [vocab, dim] is a DTensor sharded on the vocabulary
(``Shard(0)`` on the tensor-parallel mesh): rank ``r`` holds rows ``[r * V/tp, (r + 1) * V/tp)``. No rank
ever holds a full row of logits. The kernel's chunk loop is the same as on one process; per chunk each
rank projects its slice, and :class:`ShardedVocab` completes the softmax by two collectives over the
tensor-parallel group: an all-gather of every rank's (max, argmax) pair (the global max and the first
global argmax, as ``argmax`` picks it on one process), then one all-reduce of the sums (``sum exp(z -
max)``, the target's logit from the rank that owns it, and for the entropy ``sum exp(z - max) (z -
max)``). The log-sum-exp then gives ``log p(target)``, ``entropy = log s - sum e (z - max) / s`` and the
softmax of each local slice for the gradient.

Gradients are exact: the weight's gradient is local to each rank's rows (``(onehot - p)^T h`` on the
slice); the hidden states' gradient ``(onehot - p) W`` is a partial sum over the slices, which
:func:`gathered_hidden` declares (``Partial``), so autograd sums it over the group on its way back
(a reduce-scatter to the sequence shards under sequence parallelism, an all-reduce otherwise).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["ShardedVocab", "gathered_hidden", "is_vocab_sharded", "sharded_vocab"]


def is_vocab_sharded(weight: Tensor) -> bool:
    """The output weight is a DTensor (tensor parallelism): the kernel takes the vocab-parallel path."""
    from torch.distributed.tensor import DTensor

    return isinstance(weight, DTensor)


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


class ShardedVocab:
    """The softmax of a chunk whose vocabulary is split over a process group, each rank holding the
    contiguous slice ``[offset, offset + v_local)``: completed by two collectives per chunk."""

    keeps_lse = True
    """The backward rebuilds the local softmax from the log-sum-exp kept in the forward (no collective)."""

    def __init__(self, group: Any, offset: int, v_local: int) -> None:
        self.group, self.offset, self.v_local = group, offset, v_local

    def _owned(self, y: Tensor) -> tuple[Tensor, Tensor]:
        """Which targets this rank holds [n] and their local ids [n, 1] (clamped where not held)."""
        owned = (y >= self.offset) & (y < self.offset + self.v_local)
        return owned, (y - self.offset).clamp(0, self.v_local - 1).unsqueeze(-1)

    def complete(self, z: Tensor, y: Tensor, want_entropy: bool) -> tuple[Tensor, Tensor, Tensor | None, Tensor,
                                                                          Tensor]:
        """Of one chunk's local logits ``z`` [n, V/tp] (fp32) and global targets ``y`` [n]: ``log p(y)``
        [n], the argmax hits [n], the entropy [n] (or None), the log-sum-exp over the whole vocabulary
        [n], and ``z`` itself, from which :meth:`probs` makes the local softmax."""
        n = z.shape[0]
        world = dist.get_world_size(self.group)
        local_arg = z.argmax(-1)
        pairs = torch.stack([z.gather(-1, local_arg.unsqueeze(-1)).squeeze(-1).double(),
                             (local_arg + self.offset).double()], -1)
        gathered = torch.empty(world * n, 2, dtype=pairs.dtype, device=z.device)  # gloo wants it flat
        dist.all_gather_single(gathered, pairs, group=self.group)
        gathered = gathered.view(world, n, 2)
        maxes = gathered[..., 0]
        m = maxes.max(0).values
        # the first rank holding the max holds the first global argmax (ranks hold the vocabulary in order)
        first = (maxes == m).to(torch.int8).argmax(0)
        argmax = gathered[..., 1].gather(0, first.unsqueeze(0)).squeeze(0).long()
        m = m.float()
        shifted = z - m.unsqueeze(-1)
        e = shifted.exp()
        owned, idx = self._owned(y)
        target_shifted = torch.where(owned, shifted.gather(-1, idx).squeeze(-1), torch.zeros((), device=z.device))
        sums = [e.sum(-1), target_shifted] + ([(e * shifted).sum(-1)] if want_entropy else [])
        del shifted, e
        sums_t = torch.stack(sums)
        dist.all_reduce(sums_t, group=self.group)
        log_s = sums_t[0].log()
        entropy = log_s - sums_t[2] / sums_t[0] if want_entropy else None
        return sums_t[1] - log_s, argmax == y, entropy, m + log_s, z

    @staticmethod
    def probs(work: Tensor, lse: Tensor) -> Tensor:
        """The local slice of the softmax, over ``work`` (the chunk's logits from :meth:`complete`)."""
        return work.sub_(lse.unsqueeze(-1)).exp_()

    @staticmethod
    def softmax(z: Tensor, lse: Tensor) -> Tensor:
        """The local slice of the softmax of recomputed logits ``z``, from the kept log-sum-exp."""
        return z.sub_(lse.unsqueeze(-1)).exp_()

    def add_target(self, grad_z: Tensor, y: Tensor, g: Tensor) -> Tensor:
        """``grad_z[i, y_i] += g_i`` (``g`` [n, 1]) on the rank that holds ``y_i``."""
        owned, idx = self._owned(y)
        return grad_z.scatter_add_(-1, idx, torch.where(owned.unsqueeze(-1), g, torch.zeros_like(g)))


def sharded_vocab(weight: Any) -> tuple[Tensor, ShardedVocab]:
    """(local rows, their :class:`ShardedVocab`) of a ``Shard(0)`` DTensor output weight on a 1-D mesh."""
    from torch.distributed.tensor import Shard

    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(f"a vocab-sharded output weight is Shard(0) on a 1-D mesh, got {weight.placements} "
                         f"on {mesh}")
    local = weight.to_local()
    if local.shape[0] * mesh.size() != weight.shape[0]:
        raise ValueError(f"vocab {weight.shape[0]} is not split evenly over {mesh.size()} ranks")
    return local, ShardedVocab(mesh.get_group(), mesh.get_local_rank() * local.shape[0], local.shape[0])
