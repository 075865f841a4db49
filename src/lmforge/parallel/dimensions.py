"""Each way of splitting a model over ranks is a plugin of one shape, :class:`Dimension`: it checks a
layout against the model and the run, splits the model over its sub-mesh, and cuts a batch to this
rank's share. The runtime, the planner and the decoder plan loop over :data:`DIMENSIONS` instead of
naming them; adding a dimension is writing one such object and listing it here.

The data dimensions (``dp_replicate``, ``dp_shard``) are not plugins: they wrap the whole model (DDP,
FSDP2, :mod:`.plans`) after the split, and every layout has them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn

from lmforge.errors import UserError
from lmforge.models.args import ModelArgs
from lmforge.parallel.dims import ParallelDims, sub_mesh


@dataclass(frozen=True)
class RunShape:
    """What a layout is checked against besides the model: the run's sequences and batches."""

    seq_len: int
    sequence_parallel: bool = True
    microbatches: int | None = None
    """Microbatches of one step on one data rank; None where not known yet (``lmforge plan``)."""
    pp_stages_per_rank: int = 1
    pp_schedule: str = "1f1b"

    @classmethod
    def of_run(cls, cfg: Any, layout: ParallelDims) -> "RunShape":
        t, p = cfg.training, cfg.parallel
        return cls(cfg.data.seq_len, p.sequence_parallel, t.global_batch_size // (layout.batch_shares * t.micro_batch_size),
                   p.pp_stages_per_rank, p.pp_schedule)


class Dimension(Protocol):
    name: str
    """The ``[parallel]`` key of its degree (and its mesh dimension)."""

    def check(self, args: ModelArgs, layout: ParallelDims, run: RunShape) -> None:
        """One-line ``UserError`` when the model or the run cannot take this degree (called at degree > 1)."""

    def split(self, model: nn.Module, mesh: Any, sequence_parallel: bool) -> None:
        """Split ``model`` over this dimension's part of ``mesh`` in place (called at degree > 1)."""

    def shard_batch(self, batch: Any, layout: ParallelDims, rank: int) -> Any:
        """This rank's share of ``batch`` (the batch itself where all ranks of the dimension read it)."""


class _Whole:
    """The defaults of a dimension whose ranks all read the whole batch."""

    def shard_batch(self, batch: Any, layout: ParallelDims, rank: int) -> Any:
        return batch


class TensorParallel(_Whole):
    name = "tp"

    def check(self, args: ModelArgs, layout: ParallelDims, run: RunShape) -> None:
        from lmforge.parallel.tensor_parallel import check_tp

        check_tp(args, layout.tp)
        if run.sequence_parallel and (run.seq_len // layout.cp) % layout.tp:
            raise UserError(f"data.seq_len={run.seq_len} / parallel.cp={layout.cp} must be divisible by "
                            f"parallel.tp={layout.tp} with parallel.sequence_parallel (each tensor-parallel rank "
                            f"holds a slice of the sequence)")

    def split(self, model: nn.Module, mesh: Any, sequence_parallel: bool) -> None:
        from lmforge.parallel.tensor_parallel import apply_tp

        apply_tp(model, sub_mesh(mesh, "tp"), sequence_parallel=sequence_parallel)


class ExpertParallel(_Whole):
    name = "ep"

    def check(self, args: ModelArgs, layout: ParallelDims, run: RunShape) -> None:
        from lmforge.parallel.expert_parallel import check_ep

        check_ep(args, layout.ep, layout.dp_shard)

    def split(self, model: nn.Module, mesh: Any, sequence_parallel: bool) -> None:
        from lmforge.parallel.expert_parallel import apply_ep

        apply_ep(model, sub_mesh(mesh, "ep"))


class ContextParallel:
    name = "cp"

    def check(self, args: ModelArgs, layout: ParallelDims, run: RunShape) -> None:
        from lmforge.parallel.context_parallel import check_cp

        check_cp(run.seq_len, layout.cp)

    def split(self, model: nn.Module, mesh: Any, sequence_parallel: bool) -> None:
        from lmforge.parallel.context_parallel import apply_cp

        apply_cp(model, sub_mesh(mesh, "cp"))

    def shard_batch(self, batch: Any, layout: ParallelDims, rank: int) -> Any:
        """Load-balanced chunks of every sequence (see :mod:`lmforge.parallel.context_parallel`)."""
        from lmforge.parallel.context_parallel import shard_batch

        return shard_batch(batch, layout.coords(rank)["cp"], layout.cp)


class PipelineParallel(_Whole):
    """The layers split into stages. The stages are cut per rank by the decoder plan (each wrapped by
    the data dimensions on its own), so :meth:`split` leaves the model whole."""

    name = "pp"

    def check(self, args: ModelArgs, layout: ParallelDims, run: RunShape) -> None:
        from lmforge.parallel.pipeline import check_pp

        check_pp(args, layout.pp, run.pp_stages_per_rank, run.microbatches, schedule=run.pp_schedule)

    def split(self, model: nn.Module, mesh: Any, sequence_parallel: bool) -> None:
        pass


DIMENSIONS: tuple[Dimension, ...] = (TensorParallel(), ExpertParallel(), ContextParallel(), PipelineParallel())
"""Every model-splitting dimension, in the order they split a model (innermost first)."""


def used(layout: ParallelDims) -> list[Dimension]:
    """The dimensions ``layout`` uses (degree above 1)."""
    return [d for d in DIMENSIONS if getattr(layout, d.name) > 1]
