"""One description of how the ranks divide the work, and the device mesh it builds.

The ranks form a grid ``pp x dp_replicate x dp_shard x cp x tp`` (outermost first, torchtitan's
order: the inner dimensions, which talk most, sit on neighbouring ranks):

* ``dp_replicate`` ranks hold whole copies (DDP); ``dp_shard`` ranks shard parameters, gradients and
  optimizer state (FSDP2); both together are HSDP. Each data rank reads its own share of the batch.
* ``cp`` ranks split every sequence of the same batch (context parallel); they hold different tokens,
  so gradients are averaged over ``dp_replicate x dp_shard x cp`` (the *gradient group*).
* ``tp`` ranks split every matrix (tensor parallel) and ``pp`` ranks split the layers (pipeline); both
  see the same tokens as their neighbours, so token counts and losses are summed over the *data
  group* only: the ranks of one ``(pp, tp)`` coordinate.
* ``ep`` shards the experts of MoE layers over ranks borrowed from inside ``dp_shard``
  (``dp_shard = dp_shard_mod_ep x ep``), so it is not a factor of the world size: each ep rank keeps
  its own tokens and sends them to the experts' owners.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from lmforge.distributed import ReduceGroup
from lmforge.errors import UserError

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
GRADIENT_DIMS = ("dp_replicate", "dp_shard", "cp")
"""The dimensions whose ranks hold different tokens: gradients and token counts are summed over them."""


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
        left at 0 (or -1) takes what the others leave of the world size."""
        model_split = p.tp * p.cp * p.pp
        if world_size % model_split:
            raise UserError(f"parallel: tp ({p.tp}) x cp ({p.cp}) x pp ({p.pp}) = {model_split} does not divide "
                            f"the world size {world_size}")
        rest = world_size // model_split
        replicate, shard = p.dp_replicate, max(p.dp_shard, 0)
        if not replicate and not shard:
            # one data dimension takes the rest; beside tp/cp/ep (DTensor parameters) that is FSDP2
            fsdp = p.mode == "fsdp" or p.tp > 1 or p.cp > 1 or p.ep > 1
            replicate, shard = (1, rest) if fsdp else (rest, 1)
        elif not replicate:
            replicate = max(rest // shard, 1)
        elif not shard:
            shard = max(rest // replicate, 1)
        dims = cls(world_size, replicate, shard, p.tp, p.cp, p.ep, p.pp)
        product = replicate * shard * model_split
        if product != world_size:
            raise UserError(f"parallel: dp_replicate ({replicate}) x dp_shard ({shard}) x tp ({p.tp}) x cp ({p.cp}) "
                            f"x pp ({p.pp}) = {product}, but the world size is {world_size}")
        if p.ep > 1 and shard % p.ep:
            raise UserError(f"parallel.ep={p.ep} must divide parallel.dp_shard={shard}: expert parallelism borrows "
                            f"its ranks from the data-shard ranks")
        if p.ep > 1 and (p.tp > 1 or p.cp > 1 or p.pp > 1):
            raise UserError(f"parallel.ep={p.ep} composes with the data dimensions (dp_shard, dp_replicate) only, "
                            f"not with parallel.tp, parallel.cp or parallel.pp")
        if p.tp > 1 and replicate > 1 and shard == 1:
            raise UserError(f"parallel.tp={p.tp} with parallel.dp_replicate={replicate}: tensor parallelism composes "
                            f"with FSDP2 (parallel.dp_shard) or HSDP (dp_replicate and dp_shard > 1), not with DDP")
        return dims

    @classmethod
    def of(cls, **degrees: int) -> "ParallelDims":
        """A layout given by its degrees alone (``lmforge plan``'s candidates): the world size is the
        product of the mesh's degrees (``ep`` borrows its ranks from ``dp_shard``)."""
        dims = cls(1, **degrees)
        return cls(dims.dp_replicate * dims.dp_shard * dims.tp * dims.cp * dims.pp, **degrees)

    @property
    def fsdp_shards(self) -> int:
        """Ranks over which FSDP shards parameters, gradients and optimizer state: the data-shard ranks
        and, as torchtitan does, the context-parallel ranks (which hold the same parameters; see
        :meth:`fsdp_mesh_names`)."""
        return self.dp_shard * self.cp

    def describe(self) -> str:
        """The degrees above 1, e.g. ``dp_shard=4 tp=2`` (``single`` for one rank)."""
        parts = [f"{n}={getattr(self, n)}" for n in ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep")
                 if getattr(self, n) > 1]
        return " ".join(parts) or "single"

    # --- where a rank sits --------------------------------------------------------------------------

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate along each mesh dimension (row-major over MESH_ORDER, as
        ``init_device_mesh`` lays ranks out)."""
        out = {}
        for name in reversed(MESH_ORDER):
            size = getattr(self, name)
            out[name] = rank % size
            rank //= size
        return out

    @property
    def batch_shares(self) -> int:
        """How many shares each global batch is cut into (the data-parallel ranks)."""
        return self.dp_replicate * self.dp_shard

    def batch_share(self, rank: int) -> int:
        """Which share of the global batch ``rank`` reads (tp, cp and pp neighbours read the same one)."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    @property
    def reduce_world(self) -> int:
        """Ranks whose gradients are averaged (the data ranks times the context shards)."""
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def splits_model(self) -> bool:
        """Anything beyond data parallelism is in use."""
        return self.tp > 1 or self.cp > 1 or self.pp > 1 or self.ep > 1

    @property
    def shards(self) -> bool:
        """Parameters are sharded (FSDP2, or HSDP with replicas)."""
        return self.dp_shard > 1 or self.cp > 1

    @property
    def replicates_only(self) -> bool:
        """Whole copies on every data rank (DDP)."""
        return self.dp_replicate > 1 and self.dp_shard == 1 and self.cp == 1

    # --- the mesh -----------------------------------------------------------------------------------

    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Sizes and names of the mesh dimensions used (degree > 1), outermost first; with ``ep``,
        ``dp_shard`` appears as ``dp_shard_mod_ep x ep`` (flattened back to ``dp_shard`` by build_mesh)."""
        used: list[tuple[int, str]] = []
        for n in MESH_ORDER:
            size = getattr(self, n)
            if n == "dp_shard" and self.ep > 1:  # dp_shard_mod_ep even at size 1: the experts' FSDP mesh
                used += [(size // self.ep, "dp_shard_mod_ep"), (self.ep, "ep")]
            elif size > 1:
                used.append((size, n))
        return tuple(s for s, _ in used), tuple(n for _, n in used)

    def build_mesh(self, device_type: str) -> Any:
        """The ``DeviceMesh`` over this run's ranks, or None when the run is one process. Besides its
        own dimensions it carries the flattened ones the plans use: ``dp_shard`` (when ep splits it),
        ``dp_shard_cp`` (FSDP2's shard group under cp) and ``data`` (the gradient group)."""
        if self.world_size == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        shape, names = self.mesh_shape()
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        flat: dict[str, Any] = {}
        mesh.lmforge_flattened = flat  # kept here: slicing a flattened dimension from the root is deprecated
        if self.ep > 1:
            flat["dp_shard"] = mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
        shard = [n for n in ("dp_shard", "cp") if getattr(self, n) > 1]
        if len(shard) == 2:
            flat["dp_shard_cp"] = _flatten(mesh, ("dp_shard", "cp"), "dp_shard_cp")
        grads = [n for n in GRADIENT_DIMS if getattr(self, n) > 1]
        if len(grads) > 1:
            flat["data"] = _flatten(mesh, tuple(grads), "data")
        return mesh

    def fsdp_mesh_names(self) -> tuple[str, ...]:
        """The mesh dimensions FSDP2 shards/replicates over: ``(dp_replicate, dp_shard[_cp])`` present."""
        names = []
        if self.dp_replicate > 1:
            names.append("dp_replicate")
        if self.dp_shard > 1 and self.cp > 1:
            names.append("dp_shard_cp")
        elif self.dp_shard > 1 or self.cp > 1:
            names.append("dp_shard" if self.dp_shard > 1 else "cp")
        return tuple(names)

    def reduce_group_name(self) -> str | None:
        """The mesh dimension (maybe flattened) spanning the gradient group; None when it is one rank."""
        grads = [n for n in GRADIENT_DIMS if getattr(self, n) > 1]
        if not grads:
            return None
        return grads[0] if len(grads) == 1 else "data"

    def reduce_group(self, mesh: Any) -> ReduceGroup:
        """The ranks of ``mesh`` (this layout's :meth:`build_mesh`) that sum token counts and losses and
        average gradients: the run's :class:`~lmforge.distributed.ReduceGroup`, held by its ``DistInfo``."""
        name = self.reduce_group_name()
        return ReduceGroup(sub_mesh(mesh, name).get_group() if name else None, self.reduce_world)

    @property
    def kind(self) -> str:
        """``none`` (one process), ``ddp``, ``fsdp`` or ``hsdp``, with ``+tp``/``+cp``/``+ep``/``+pp``:
        the setup record's ``parallel``."""
        if self.world_size == 1:
            return "none"
        base = "hsdp" if self.dp_shard > 1 and self.dp_replicate > 1 else "fsdp" if self.shards else \
            "ddp" if self.dp_replicate > 1 else ""
        extra = [n for n in ("tp", "cp", "ep", "pp") if getattr(self, n) > 1]
        return "+".join(([base] if base else []) + extra)

    def describe_mesh(self) -> str:
        """The mesh's dimensions, e.g. ``dp_replicate=2 x dp_shard=4`` (empty for one process)."""
        parts = [f"{n}={getattr(self, n)}" for n in MESH_ORDER if getattr(self, n) > 1]
        if self.ep > 1:
            parts.append(f"ep={self.ep} (in dp_shard)")
        return " x ".join(parts)



def sub_mesh(mesh: Any, *names: str) -> Any:
    """The sub-mesh over ``names``: own or flattened dimensions of :meth:`ParallelDims.build_mesh`.
    A flattened dimension alone comes from where build_mesh kept it; beside another one (HSDP's
    ``(dp_replicate, dp_shard_cp)``) it is sliced from the root mesh, which torch still allows."""
    flat = getattr(mesh, "lmforge_flattened", {})
    if len(names) == 1:
        return flat.get(names[0]) or mesh[names[0]]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh[names]


def _flatten(mesh: Any, names: tuple[str, ...], name: str) -> Any:
    """``names`` of ``mesh`` as one dimension called ``name`` (``dp_shard`` may itself be ``ep`` inside)."""
    flat = getattr(mesh, "lmforge_flattened", {})
    parts: list[str] = []
    for n in names:
        if n == "dp_shard" and "dp_shard" in flat:
            parts += ["dp_shard_mod_ep", "ep"]
        else:
            parts.append(n)
    return mesh[tuple(parts)]._flatten(name)
