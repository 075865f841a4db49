"""Measure each rank's peak of live tensor memory in a real train step laid out over a mesh (what the
planner's per-device estimate is checked against on layouts; one process: :mod:`.memory_probe`).

Run inside a process group (torchrun, gloo on the CPU) whose world size is the layout's device count.
The step is the one a training run takes: the mesh and gradient group from
:class:`~lmforge.parallel.dims.ParallelDims` as ``training/runtime.py`` builds them, the model laid out
by :func:`~lmforge.parallel.plans.parallelize_decoder`, each data rank its share of a global batch (cut
again by :func:`~lmforge.parallel.context_parallel.shard_batch` under cp), and the train-step pieces
``gradient_computation`` / ``run_optimizer_step``, which also drive a pipeline. Storages are counted
below DTensor and with in-place resizes followed (FSDP2's gathers), see
:class:`~lmforge.planning.memory_probe.LiveTensorMemory`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmforge.models.args import ModelArgs
from lmforge.parallel.dims import ParallelDims

__all__ = ["RankPeak", "measure_layout_step"]


@dataclass(frozen=True)
class RankPeak:
    """This rank's peak live tensor bytes in the last measured step, and its parameters' bytes."""

    rank: int
    peak: int
    params: int


def measure_layout_step(args: ModelArgs, layout: ParallelDims, *, seq_len: int, micro_batch: int,
                        microbatches: int = 1, dtype: str = "float32", checkpointing: bool = False,
                        steps: int = 2, chunk_tokens: int = 1024, seed: int = 0) -> RankPeak:
    """Peak live tensor memory (bytes) of train step ``steps`` on this rank, ``args`` laid out as
    ``layout`` over the current process group (AdamW, the chunked cross-entropy)."""
    import torch.distributed as dist

    from lmforge.config import ParallelSection
    from lmforge.data.packing import Batch
    from lmforge.models.spec import spec_for_args
    from lmforge.objectives.next_token import NextTokenObjective
    from lmforge.parallel.dims import ParallelDims
    from lmforge.planning.memory_probe import LiveTensorMemory
    from lmforge.parallel.plans import ParallelOptions, parallelize_decoder
    from lmforge.optim.adamw import build_optimizer
    from lmforge.training.train_step import gradient_computation, run_optimizer_step

    rank, world = dist.get_rank(), dist.get_world_size()
    section = ParallelSection(dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, tp=layout.tp,
                              cp=layout.cp, pp=layout.pp, ep=layout.ep)
    dims = ParallelDims.from_config(section, world)
    device = torch.device("cpu")
    mesh = dims.build_mesh(device.type)
    reduce = dims.reduce_group(mesh)
    torch.manual_seed(seed)
    model = spec_for_args(args).build(args)
    model.init_weights(seed=seed)
    wrapped = parallelize_decoder(model, dims, mesh, device,
                                  ParallelOptions(activation_checkpointing=checkpointing, bf16=dtype == "bfloat16"))
    optimizer = build_optimizer(wrapped, 1e-3, 0.1, (0.9, 0.95), 1e-8)
    objective = NextTokenObjective(chunk_tokens)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16" else None
    batch_share, cp_rank = dims.batch_share(rank), dims.coords(rank)["cp"]
    g = torch.Generator().manual_seed(seed)  # every rank draws the same global batch, then takes its share
    tracker = LiveTensorMemory(watch_resizes=True)
    with tracker:
        tracker.track([list(wrapped.parameters()), list(wrapped.buffers())])
        params = tracker.current
        for _ in range(steps):
            rows = dims.batch_shares * micro_batch * microbatches
            ids = torch.randint(0, args.vocab_size, (rows, seq_len + 1), generator=g)
            mine = ids[batch_share * micro_batch * microbatches:(batch_share + 1) * micro_batch * microbatches]
            mbs = [Batch(mb[:, :-1].contiguous(), mb[:, 1:].contiguous()) for mb in mine.split(micro_batch)]
            if dims.cp > 1:
                from lmforge.parallel.context_parallel import shard_batch

                mbs = [shard_batch(mb, cp_rank, dims.cp) for mb in mbs]
            del ids, mine
            tracker.track([(mb.input_ids, mb.labels, mb.position_ids, mb.document_ids) for mb in mbs])
            tracker.reset_peak()
            stats = gradient_computation(wrapped, mbs, objective.loss_fn, objective.normalizer(mbs, reduce), autocast,
                                         reduce)
            run_optimizer_step(wrapped, optimizer, 1e-3, 1.0)
            del stats, mbs
    return RankPeak(rank, tracker.peak, params)
