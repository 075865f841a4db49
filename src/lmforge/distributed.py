"""What a process knows of the others under torchrun or alone (its rank, device, share of the batch and reduce
group) and the collectives lmforge takes over them. The process group itself is joined by the world phase
(:func:`lmforge.runtime.world.init_distributed`); the model's layout over the ranks is :mod:`lmforge.parallel`."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn



@dataclass(frozen=True)
class ReduceGroup:
    """The ranks whose tokens differ (data and context shards): where token counts and losses are summed
    and over which gradients are averaged.

    Tensor- and pipeline-parallel neighbours see the same tokens, so summing a token count over every
    rank would count it once per neighbour. The run's group is built with the mesh
    (:meth:`lmforge.parallel.dims.ParallelDims.reduce_group`), held by its :class:`DistInfo` and passed
    to every sum; the default, :data:`EVERY_RANK`, is torch's own default (the whole process group),
    right whenever no dimension splits the model.
    """

    group: object = None
    """The process group (None: every rank)."""
    ranks: int = 0
    """How many ranks it holds (0: every rank)."""

    @property
    def size(self) -> int:
        """Ranks whose gradients are averaged (and whose token counts are summed)."""
        return self.ranks or world_size()

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group (a no-op alone). Returns a new tensor; stays on device, no host sync."""
        if not dist.is_initialized() or self.size == 1:
            return t
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t


EVERY_RANK = ReduceGroup()
"""Every rank of the process group (one process alone: itself)."""


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    batch_share: int = -1
    """Which share of each global batch this rank reads (tensor-, context- and pipeline-parallel
    neighbours read the same share); set with the mesh, -1 until then (then ``rank``)."""
    batch_shares: int = 0
    """How many shares a global batch is cut into (0 until the mesh is known: then ``world_size``)."""
    reduce: ReduceGroup = EVERY_RANK
    """The ranks this rank sums token counts and losses with (set with the mesh; every rank until then)."""

    def __post_init__(self) -> None:
        if self.batch_share < 0:
            self.batch_share, self.batch_shares = self.rank, self.world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def shutdown() -> None:
    """Leave the process group. The group's destructor joins gloo's worker threads while holding the
    GIL; a worker still freeing a finished work item whose tensors Python saw waits for the GIL, so the
    pause first lets such a worker finish instead of both waiting forever."""
    if dist.is_initialized():
        time.sleep(0.05)
        dist.destroy_process_group()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_max(value: float) -> float:
    """Max of a host value over ranks (used for decisions every rank must share, e.g. stop)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def broadcast_object(obj: object) -> object:
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextmanager
def no_grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient all-reduce for accumulation microbatches (DDP ``no_sync``, FSDP2 flag)."""
    if not enabled:
        yield
        return
    if hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") and not hasattr(model, "layers") else model


@contextmanager
def full_parameters(model: nn.Module) -> Iterator[nn.Module]:
    """The model with its whole parameters present on every rank, for generation (a no-op unless FSDP2).

    Decoding runs one short forward per token: letting FSDP2 all-gather every block's parameters for
    each of them (and free them after) costs one all-gather per block per token. Instead every FSDP
    module is unsharded once here (outside inference mode: FSDP reuses the gathered buffers in
    training, and inference tensors could not be written there), blocks keep their parameters across
    forwards until the end, when all are resharded. Inside, ``hidden_states`` counts as a forward of
    the root (generation calls it rather than ``forward``; FSDP's first forward must enter through the
    root); the registration is undone on exit, since ``forward`` itself calls ``hidden_states``.
    Generation inside needs no collective; ranks that must agree on when to stop still do
    (``generate(..., lockstep=True)``).
    """
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    if not isinstance(model, FSDPModule):
        yield model
        return
    register_fsdp_forward_method(model, "hidden_states")  # an attribute of the instance, deleted below
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    blocks = [m for m in units if m is not model]
    with torch.no_grad():
        for m in units:
            m.unshard()
    for m in blocks:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield model
    finally:
        del model.hidden_states
        for m in blocks:
            m.set_reshard_after_forward(True, recurse=False)
        for m in units:
            m.reshard()
