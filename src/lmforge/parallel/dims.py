"""One description of how the ranks divide the work, and the device mesh it builds.

The ranks form a grid ``pp x dp_replicate x dp_shard x cp x tp`` (outermost first, torchtitan's
order: the inner dimensions, which talk most, sit on neighbouring ranks). Today the data dimensions
are applied: ``dp_replicate`` ranks hold whole copies (DDP), ``dp_shard`` ranks shard parameters,
gradients and optimizer state (FSDP2), both together are HSDP. ``tp``, ``cp``, ``ep`` and ``pp`` are
part of the description so that configs, meshes and plans have their place, and are refused with one
line until their plans exist. ``ep`` shards experts over the data-shard ranks, so it is not a factor
of the world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmforge.errors import UserError

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
NOT_YET = {"tp": "tensor", "cp": "context", "ep": "expert", "pp": "pipeline"}


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1
    pp: int = 1

    @classmethod
    def from_config(cls, p: Any, world_size: int) -> "ParallelDims":
        """From the ``[parallel]`` section. ``mode`` is shorthand for the data dimensions: ``ddp`` puts
        every rank in ``dp_replicate``, ``fsdp`` in ``dp_shard``; explicit degrees (> 0) win, and one
        left at 0 takes what the others leave of the world size."""
        for key, what in NOT_YET.items():
            if getattr(p, key) > 1:
                raise UserError(f"parallel.{key}={getattr(p, key)}: {what} parallelism is not available yet "
                                f"(data parallelism is: parallel.dp_replicate / parallel.dp_shard)")
        rest = world_size // (p.tp * p.cp * p.pp)
        replicate, shard = p.dp_replicate, p.dp_shard
        if not replicate and not shard:
            replicate, shard = (rest, 1) if p.mode == "ddp" else (1, rest)
        elif not replicate:
            replicate = max(rest // shard, 1)
        elif not shard:
            shard = max(rest // replicate, 1)
        dims = cls(world_size, replicate, shard, p.tp, p.cp, p.ep, p.pp)
        product = replicate * shard * p.tp * p.cp * p.pp
        if product != world_size:
            raise UserError(f"parallel: dp_replicate ({replicate}) x dp_shard ({shard}) x tp x cp x pp = {product}, "
                            f"but the world size is {world_size}")
        return dims

    @property
    def shards(self) -> bool:
        """Parameters are sharded (FSDP2, or HSDP with replicas)."""
        return self.dp_shard > 1

    @property
    def replicates_only(self) -> bool:
        """Whole copies on every data rank (DDP)."""
        return self.dp_replicate > 1 and self.dp_shard == 1

    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Sizes and names of the mesh dimensions used (degree > 1), outermost first."""
        used = [(getattr(self, n), n) for n in MESH_ORDER if getattr(self, n) > 1]
        return tuple(s for s, _ in used), tuple(n for _, n in used)

    def build_mesh(self, device_type: str) -> Any:
        """The ``DeviceMesh`` over this run's ranks, or None when the run is one process."""
        if self.world_size == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        shape, names = self.mesh_shape()
        return init_device_mesh(device_type, shape, mesh_dim_names=names)

    @property
    def kind(self) -> str:
        """``none`` (one process), ``ddp``, ``fsdp`` or ``hsdp``: the setup record's ``parallel``."""
        if self.world_size == 1:
            return "none"
        return "hsdp" if self.shards and self.dp_replicate > 1 else "fsdp" if self.shards else "ddp"

    def describe_mesh(self) -> str:
        """The mesh's dimensions, e.g. ``dp_replicate=2 x dp_shard=4`` (empty for one process)."""
        shape, names = self.mesh_shape()
        return " x ".join(f"{n}={s}" for s, n in zip(shape, names))
