"""Parallelism as plans over a device mesh.

:mod:`.dims` turns ``[parallel]`` into one :class:`ParallelDims` (data-replicate and data-shard degrees,
with tensor, context, expert and pipeline degrees described but not yet applied) and builds its
``DeviceMesh``. :mod:`.plans` holds the separate functions that apply activation checkpointing,
``torch.compile``, FSDP2 and DDP, and :func:`~.plans.parallelize_decoder`, the order a decoder family
applies them in (a family's :class:`~lmforge.models.spec.ModelSpec` may bring its own plan).
"""

from lmforge.parallel.dims import ParallelDims
from lmforge.parallel.plans import ParallelOptions, parallelize_decoder

__all__ = ["ParallelDims", "ParallelOptions", "parallelize_decoder"]
