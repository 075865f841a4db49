"""Whether a model and a config can take a layout: one line naming the key when they cannot, checked
before anything is written (an impossible degree must never surface as a shape error in a collective)."""

from __future__ import annotations

from typing import Any

from lmforge.errors import UserError
from lmforge.models.args import ModelArgs
from lmforge.parallel.dimensions import RunShape, used
from lmforge.parallel.dims import ParallelDims


def check_same_layout_on_every_rank(section: Any) -> None:
    """Every rank must have read the same ``[parallel]`` section: ranks that build different meshes wait
    in different collectives forever. One all-gather at start-up; every rank raises the same line."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = {k: v for k, v in section.model_dump().items()}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for rank, theirs in enumerate(every):
        if theirs != every[0]:
            diff = ", ".join(f"parallel.{k}={every[0][k]} on rank 0 but {theirs[k]} on rank {rank}"
                             for k in every[0] if theirs.get(k) != every[0][k])
            raise UserError(f"the ranks were started with different layouts: {diff}; give every rank the same "
                            f"config and flags")


def check_layout(dims: ParallelDims, args: ModelArgs, cfg: Any) -> None:
    """Every model-splitting degree against the model's shape, the data's sequence length and the batch."""
    run = RunShape.of_run(cfg, dims)
    for dimension in used(dims):
        dimension.check(args, dims, run)


def check_layout_of_model(dims: ParallelDims, args: ModelArgs, seq_len: int, sequence_parallel: bool = True) -> None:
    """The checks that need only the model and the sequence length (``lmforge plan`` uses them too)."""
    run = RunShape(seq_len, sequence_parallel)
    for dimension in used(dims):
        dimension.check(args, dims, run)
