"""Context parallelism: long rows split over the ``cp`` ranks of a mesh dimension, attention exact.

Each row of ``T`` tokens is cut into ``2 cp`` chunks and cp rank ``r`` keeps chunks ``r`` and
``2 cp - 1 - r`` (:func:`shard_batch`): under a causal mask the ranks then have equal attention work.
Embeddings, norms, MLPs and the loss head are per token and run on the local ``T / cp`` tokens as they
are; attention all-gathers keys and values over the cp group each layer
(:mod:`lmforge.models.layers.context_attention`). RoPE needs each token's place in the whole row, so
the shard carries global ``position_ids``.

Using it (``cp_mesh`` the 1-D ``cp`` sub-mesh of the run's mesh):

* ``apply_cp(model, cp_mesh)`` once, before or after the data-parallel wrapper;
* every microbatch through ``shard_batch(batch, cp_mesh.get_local_rank(), cp)`` before the objective
  sees it (its target count, the global normalizer, then counts each target once over all ranks);
* the gradient-averaging wrapper (FSDP2 / DDP) spans the data dimensions *and* ``cp``, since cp ranks
  hold different tokens of the same rows and each has only its tokens' share of the gradient; the
  objective is multiplied by that mesh's size, as for data parallelism.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lmforge.data.packing import Batch
from lmforge.errors import UserError
from lmforge.models.layers.context_attention import ContextParallelLayout, context_layout, shard_index

__all__ = ["ContextParallel", "apply_cp", "check_cp", "shard_batch", "unshard_tokens"]


def check_cp(seq_len: int, cp: int) -> None:
    """Refuse, with one line, a sequence length that the load-balanced split cannot cut evenly."""
    if cp < 1:
        raise UserError(f"parallel.cp={cp}: the context-parallel degree must be at least 1")
    if seq_len % (2 * cp):
        raise UserError(f"data.seq_len={seq_len} must be divisible by 2 x parallel.cp = {2 * cp}: each row is "
                        f"cut into 2 x cp equal chunks, two per context-parallel rank")


def _shard(t: Tensor, rank: int, cp: int) -> Tensor:
    """Chunks ``rank`` and ``2 cp - 1 - rank`` of ``t``'s last dimension, as two slices (no gather)."""
    chunk = t.shape[-1] // (2 * cp)
    mirror = 2 * cp - 1 - rank
    return torch.cat([t[..., rank * chunk:(rank + 1) * chunk], t[..., mirror * chunk:(mirror + 1) * chunk]], dim=-1)


def shard_batch(batch: Batch, cp_rank: int, cp: int) -> Batch:
    """This cp rank's ``[B, T / cp]`` share of ``batch``: ``input_ids``, ``labels`` (already aligned
    with their inputs, so no target crosses a shard), and ``position_ids`` / ``document_ids``, made
    explicit (``arange`` / zeros) when absent, so RoPE sees global positions and every rank knows the
    documents. ``document_lengths`` / ``document_values`` stay those of the whole rows (host data)."""
    B, T = batch.input_ids.shape
    check_cp(T, cp)
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank {cp_rank} out of range [0, {cp})")
    device = batch.input_ids.device
    positions = batch.position_ids
    if positions is None:
        positions = torch.arange(T, device=device)
    documents = batch.document_ids
    if documents is None:
        documents = torch.zeros(B, T, dtype=torch.long, device=device)
    return Batch(
        input_ids=_shard(batch.input_ids, cp_rank, cp),
        labels=_shard(batch.labels, cp_rank, cp),
        position_ids=_shard(positions.expand(B, T), cp_rank, cp),
        document_ids=_shard(documents, cp_rank, cp),
        document_lengths=batch.document_lengths,
        document_values=batch.document_values,
    )


def unshard_tokens(shards: list[Tensor], dim: int = 1) -> Tensor:
    """The inverse of the split: per-token tensors of cp ranks ``0..cp-1`` (``[B, T / cp, ...]`` along
    ``dim``) back in row order."""
    cp = len(shards)
    T = sum(s.shape[dim] for s in shards)
    order = torch.cat([shard_index(r, cp, T, shards[0].device) for r in range(cp)])
    out = torch.cat(shards, dim=dim)
    return out.index_select(dim, torch.argsort(order))


class ContextParallel:
    """What :class:`~lmforge.models.model.Transformer` holds as ``context_parallel``: the cp group, and
    the layout of each forward's shard."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def layout(self, document_ids: Tensor | None, batch: int, local_len: int,
               device: torch.device) -> ContextParallelLayout:
        return context_layout(self.group, document_ids, batch, local_len, device)

    def __deepcopy__(self, memo: dict) -> "ContextParallel":
        """A copied model (e.g. a frozen reference) shares the process group: groups cannot be copied."""
        return self


def apply_cp(model: nn.Module, cp_mesh: Any) -> nn.Module:
    """Make ``model`` (a Transformer, or a wrapper around one) treat its tokens as this rank's share of
    rows split over ``cp_mesh`` (a 1-D DeviceMesh, or a process group). Returns ``model``."""
    from lmforge.distributed import unwrap

    group = cp_mesh.get_group() if hasattr(cp_mesh, "get_group") else cp_mesh
    unwrap(model).context_parallel = ContextParallel(group)
    return model
