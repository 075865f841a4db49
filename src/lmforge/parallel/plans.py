"""How a model is laid out over the mesh: separate functions, applied in the order a family's plan says.

Each function does one thing to the model in place and can be used alone (benchmarks and tests do):
activation checkpointing and ``torch.compile`` per block, FSDP2 ``fully_shard`` per block then the
root (HSDP on a 2-D mesh), or DDP over the data-replicate group. :func:`parallelize_decoder` is the
plan of the decoder families (Llama, Qwen, Mistral): checkpointing and compile go on first, so FSDP2
wraps the compiled, checkpointed blocks; the block is the unit of all three.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lmforge.parallel.dimensions import used
from lmforge.parallel.dims import ParallelDims, sub_mesh


@dataclass(frozen=True)
class ParallelOptions:
    """What the plan needs besides the mesh: per-block wrappers and the precision of FSDP2's gathers."""

    activation_checkpointing: bool = False
    compile: bool = False
    bf16: bool = False
    """Training autocasts to bf16: on GPU, FSDP2 gathers parameters in bf16 and reduces in fp32."""
    sequence_parallel: bool = True
    """Under tensor parallelism, norms and residuals run on sequence shards too."""
    pp_schedule: str = "1f1b"
    pp_stages_per_rank: int = 1
    activation_offload: bool = False
    """Keep each block's saved activations in pinned host memory until backward (a GPU's memory saver)."""


def owned_blocks(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(index, block) of the blocks this rank holds (a pipeline stage holds None for the others')."""
    return [(i, block) for i, block in enumerate(model.layers) if block is not None]


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute every block's activations in backward instead of keeping them."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        checkpoint_wrapper,
    )

    for i, block in owned_blocks(model):
        model.layers[i] = checkpoint_wrapper(block)


def _host_offload_wrapper() -> type:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper

    class HostOffload(ActivationWrapper):
        """A block whose saved activations wait for backward in host memory. The wrapper's state
        dict hooks keep the block's parameter names as they were (as activation checkpointing's do)."""

        def __init__(self, module: nn.Module, pin_memory: bool) -> None:
            super().__init__(module)
            self.pin_memory = pin_memory

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            with torch.autograd.graph.save_on_cpu(pin_memory=self.pin_memory):
                return self._checkpoint_wrapped_module(*args, **kwargs)

    return HostOffload


def apply_activation_offload(model: nn.Module, pin_memory: bool = True) -> None:
    """Move the tensors each block saves for backward to host memory as they are saved, and back
    when backward needs them (``torch.autograd.graph.save_on_cpu``; pinned on CUDA, so the copies
    can overlap compute). Gradients are unchanged: the same values come back. With activation
    checkpointing on too, only each block's checkpointed input is saved, and that is what moves."""
    wrapper = _host_offload_wrapper()
    for i, block in owned_blocks(model):
        model.layers[i] = wrapper(block, pin_memory)


def apply_compile(model: nn.Module) -> None:
    """Compile each block on its own: one graph reused by every layer, and short compiles."""
    for i, block in owned_blocks(model):
        model.layers[i] = torch.compile(block)


def apply_fsdp(model: nn.Module, mesh: Any, device: torch.device, *, bf16: bool = False,
               experts: tuple[Any, int] | None = None) -> nn.Module:
    """FSDP2 ``fully_shard`` per block, then the root (embedding, final norm, output layer). On a 2-D
    ``(dp_replicate, dp_shard)`` mesh this is HSDP: sharded within a group, replicated across groups.
    ``experts`` (mesh, gradient divide factor): under expert parallelism the experts are their own
    units over the ranks holding the same experts (see lmforge.parallel.expert_parallel)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {}
    if bf16 and device.type == "cuda":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if experts is not None:
        from lmforge.parallel.expert_parallel import shard_experts

        shard_experts(model, experts[0], experts[1], **kwargs)
    kwargs["mesh"] = mesh
    for _, block in owned_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def apply_ddp(model: nn.Module, mesh: Any, device: torch.device) -> nn.Module:
    """DDP over the mesh's data-replicate group (gradients all-reduced in buckets during backward)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    device_ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, process_group=mesh.get_group())


def data_mesh(mesh: Any, dims: ParallelDims) -> Any:
    """The part of the mesh the data-parallel wrapper spans (FSDP2's shard dimension covers the context
    shards too: they hold different tokens, so their gradients are averaged like data ranks')."""
    return sub_mesh(mesh, *(dims.fsdp_mesh_names() if dims.shards else ("dp_replicate",)))


def split_model(model: nn.Module, dims: ParallelDims, mesh: Any, options: ParallelOptions) -> None:
    """The model-splitting dimensions in use, innermost first (:data:`~.dimensions.DIMENSIONS`)."""
    for dimension in used(dims):
        dimension.split(model, mesh, options.sequence_parallel)


def parallelize_decoder(model: nn.Module, dims: ParallelDims, mesh: Any, device: torch.device,
                        options: ParallelOptions) -> nn.Module:
    """The decoder plan: the model-splitting dimensions, then per pipeline stage (the whole model
    without pipeline parallelism) checkpointing, compile and the data-parallel wrapper. Returns the
    module the train step calls: the model itself for one process, FSDP2 or a split without data
    parallelism; a DDP wrapper for DDP; a :class:`~lmforge.parallel.pipeline.Pipeline` of this rank's
    stages under ``pp``."""
    if mesh is not None:
        split_model(model, dims, mesh, options)
    if dims.pp == 1:
        return wrap_stage(model, dims, mesh, device, options)
    from lmforge.parallel.pipeline import Pipeline, split_model as split_stages

    pp_mesh = sub_mesh(mesh, "pp")
    parts = split_stages(model, pp_mesh.get_local_rank(), dims.pp, options.pp_stages_per_rank)
    parts = [wrap_stage(part, dims, mesh, device, options) for part in parts]
    return Pipeline(parts, pp_mesh.get_group(), device, options.pp_schedule)


def wrap_stage(model: nn.Module, dims: ParallelDims, mesh: Any, device: torch.device,
               options: ParallelOptions) -> nn.Module:
    """Checkpointing, offload, compile, then FSDP2 (HSDP) or DDP over the data dimensions."""
    if options.activation_checkpointing:
        apply_activation_checkpointing(model)
    if options.activation_offload:
        apply_activation_offload(model)
    if options.compile:
        apply_compile(model)
    if mesh is None:
        return model
    if dims.shards:
        experts = None
        if dims.ep > 1:  # experts: sharded over ep, FSDP over the ranks holding the same ones
            names = ("dp_replicate", "dp_shard_mod_ep") if dims.dp_replicate > 1 else ("dp_shard_mod_ep",)
            experts = (sub_mesh(mesh, *names), dims.reduce_world)
        return apply_fsdp(model, data_mesh(mesh, dims), device, bf16=options.bf16, experts=experts)
    if dims.dp_replicate > 1:
        return apply_ddp(model, data_mesh(mesh, dims), device)
    return model


def data_parallel(model: nn.Module, mode: str, device: torch.device) -> nn.Module:
    """``model`` laid out by the decoder plan with every rank in one data dimension (``mode`` ``ddp`` or
    ``fsdp``): what ``parallel.mode`` alone configures, for scripts that build their own model."""
    import torch.distributed as dist

    from lmforge.config import ParallelSection

    world = dist.get_world_size() if dist.is_initialized() else 1
    dims = ParallelDims.from_config(ParallelSection(mode=mode), world)
    return parallelize_decoder(model, dims, dims.build_mesh(device.type), device, ParallelOptions())
