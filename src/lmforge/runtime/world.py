"""Phase 2 of a run: the world. The processes, their layout over a device mesh, the ranks that reduce
gradients together, and the run directory they share, held by one :class:`World`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from lmforge import distributed as dist_utils
from lmforge.checkpoint.runlock import claim_run_dir
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
    info = dist_utils.init_distributed(device)
    check_same_layout_on_every_rank(parallel)
    mesh = layout.build_mesh(info.device.type)
    info = replace(info, batch_share=layout.batch_share(info.rank), batch_shares=layout.batch_shares,
                   reduce=layout.reduce_group(mesh))
    claim_run_dir(run_dir, info.is_main)
    return World(info, layout, mesh, run_dir)

