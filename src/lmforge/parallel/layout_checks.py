"""Whether a model and a config can take a layout: one line naming the key when they cannot, checked
before anything is written (an impossible degree must never surface as a shape error in a collective)."""

from __future__ import annotations

from typing import Any

from lmforge.errors import UserError
from lmforge.models.args import ModelArgs
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
    check_layout_of_model(dims, args, cfg.data.seq_len, cfg.parallel.sequence_parallel)
    if dims.pp > 1:
        from lmforge.parallel.pipeline import check_pp

        t, p = cfg.training, cfg.parallel
        check_pp(args, dims.pp, p.pp_stages_per_rank, t.global_batch_size // (dims.batch_shares * t.micro_batch_size),
                 schedule=p.pp_schedule)


def check_layout_of_model(dims: ParallelDims, args: ModelArgs, seq_len: int, sequence_parallel: bool = True) -> None:
    """The checks that need only the model and the sequence length (``lmforge plan`` uses them too)."""
    if dims.tp > 1:
        from lmforge.parallel.tensor_parallel import check_tp

        check_tp(args, dims.tp)
        if sequence_parallel and (seq_len // dims.cp) % dims.tp:
            raise UserError(f"data.seq_len={seq_len} / parallel.cp={dims.cp} must be divisible by "
                            f"parallel.tp={dims.tp} with parallel.sequence_parallel (each tensor-parallel rank "
                            f"holds a slice of the sequence)")
    if dims.cp > 1:
        from lmforge.parallel.context_parallel import check_cp

        check_cp(seq_len, dims.cp)
    if dims.pp > 1:
        from lmforge.parallel.pipeline import check_pp

        check_pp(args, dims.pp)
    if dims.ep > 1:
        from lmforge.parallel.expert_parallel import check_ep

        check_ep(args, dims.ep, dims.dp_shard)
