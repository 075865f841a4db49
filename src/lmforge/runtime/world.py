"""Phase 2 of a run: the world. The processes, their layout over a device mesh, the ranks that reduce
gradients together, and the run directory they share, held by one :class:`World`."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lmforge import distributed as dist_utils
from lmforge.checkpoint.runlock import claim_run_dir
from lmforge.errors import UserError
from lmforge.parallel.dimensions import used
from lmforge.parallel.dims import ParallelDims
from lmforge.parallel.layout_checks import check_same_layout_on_every_rank


@dataclass(frozen=True)
class World:
    """Who runs this training and how the work is divided among them."""

    dist: dist_utils.DistInfo
    """This process: rank, world size, device, and the share of each global batch it reads."""
    layout: ParallelDims
    mesh: Any
    """The ``DeviceMesh`` of ``layout`` (None for one process)."""
    run_dir: Path

    def shard_batch(self, batch: Any) -> Any:
        """This rank's share of ``batch`` after the data dimensions picked its rows: each model-splitting
        dimension in use cuts it further (context parallelism: load-balanced chunks of every sequence)."""
        for dimension in used(self.layout):
            batch = dimension.shard_batch(batch, self.layout, self.dist.rank)
        return batch


def start_world(device: str, threads: int, layout: ParallelDims, parallel: Any, run_dir: Path) -> World:
    """Join the process group, agree on the layout, build the mesh and claim the run directory.

    The ranks that sum token counts and average gradients (data and context shards: tensor- and
    pipeline-parallel neighbours see the same tokens) are this rank's ``dist.reduce``: every sum of the
    run is taken over it.
    """
    if threads:
        torch.set_num_threads(threads)
    info = init_distributed(device)
    check_same_layout_on_every_rank(parallel)
    mesh = layout.build_mesh(info.device.type)
    info = replace(info, batch_share=layout.batch_share(info.rank), batch_shares=layout.batch_shares,
                   reduce=layout.reduce_group(mesh))
    claim_run_dir(run_dir, info.is_main)
    return World(info, layout, mesh, run_dir)


def init_distributed(device: str = "auto", timeout_s: float = 300.0) -> dist_utils.DistInfo:
    """Join the torchrun process group if launched by torchrun; pick the device.

    gloo on CPU, NCCL on CUDA (bound to this rank's GPU). Under torchrun's elastic agent the
    process group is built on a store that is safe to reuse after a restart (see
    :func:`_restart_safe_store`).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise UserError(f"training.device=cuda but CUDA is not available ({why}); use training.device=auto or cpu")
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        kwargs: dict = {"timeout": timedelta(seconds=timeout_s)}
        if use_cuda:
            kwargs["device_id"] = dev  # NCCL communicators bound to this GPU (no guessing in barrier)
        store = _restart_safe_store(world, timeout_s)
        if store is not None:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kwargs)
        else:
            dist.init_process_group(backend, **kwargs)
    return dist_utils.DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=dev)


def _restart_safe_store(world: int, timeout_s: float) -> dist.Store | None:
    """A store for ``init_process_group`` that a restarted worker group can use, or None (use env://).

    By default torchrun's agent shares its rendezvous TCPStore with the workers, and that store keeps
    the keys the failed attempt wrote: a restarted group then reads the dead workers' addresses and
    fails in gloo's connectFullMesh ("Connection refused") or hangs. Each attempt therefore works
    under its own key prefix, ``lmforge_attempt_<TORCHELASTIC_RESTART_COUNT>``. The restart count is
    counted by each node's agent; on one machine (one agent) it always agrees across ranks. Across
    machines, agents that restarted a different number of times (a node that joined later) would
    disagree, so multi-machine elastic jobs should launch with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``:
    the agent then hands out a fresh store per rendezvous round and this function steps aside.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in os.environ:
        return None
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                         is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True)
    return dist.PrefixStore(f"lmforge_attempt_{restart}", base)
