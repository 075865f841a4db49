"""Tensor parallelism (Megatron's layout) with optional sequence parallelism for the decoder, as DTensor plans.

Per block the q/k/v projections (and their biases) and the MLP's gate and up projections are split by
output columns, so each rank holds ``n_heads / tp`` query heads, ``n_kv_heads / tp`` key/value heads and
``ffn_dim / tp`` hidden units; the attention and MLP output projections are split by input rows and
their partial sums are reduced. The embedding and the output layer are split over the vocabulary
(``Shard(0)`` of the same [vocab, dim] layout, so tied weights stay one parameter); the loss heads of
:mod:`lmforge.losses.chunked_loss` complete each chunk's softmax across the ranks
(:mod:`lmforge.losses.vocab_parallel_loss`) and never gather logits.

With ``sequence_parallel`` the residual stream between the sublayers is sharded over the sequence
(``Shard(1)``): norms run on ``T / tp`` tokens per rank, an all-gather brings the full sequence to each
attention / MLP, and their outputs are reduce-scattered back instead of all-reduced. Without it every
rank holds the whole residual stream (an all-reduce after each sublayer).

Every parameter becomes a DTensor on the tensor-parallel mesh (replicated ones included), so FSDP2
composes on top (2-D: data-shard x tensor) and gradient clipping sees one kind of tensor. Replicated
parameters whose gradient is a partial sum over the ranks (norm weights on sequence shards, per-head
q/k norms on a rank's heads) get it summed by a gradient hook here, or by FSDP2's reduction when it
wraps the model (FSDP2 replaces the parameters, and with them the hooks).

Mixture-of-experts layers stay whole on every rank: router and experts replicated, fed the full sequence.
"""

from __future__ import annotations

import logging

from typing import Any

from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lmforge.errors import UserError
from lmforge.models.args import ModelArgs
from lmforge.models.model import Transformer, tp_problem, tp_sizes

__all__ = ["apply_tp", "check_tp"]


def check_tp(args: ModelArgs, tp: int) -> None:
    """Refuse, in one line, a model that ``tp`` ranks cannot split evenly (the sizes its blocks name)."""
    if tp <= 1:
        return
    blocks = args.decoder_config().blocks
    for block in blocks:
        problem = tp_problem(block)
        if problem:
            raise UserError(f"parallel.tp={tp}: {problem}")
    sizes = {k: v for block in blocks for k, v in tp_sizes(block).items()}
    sizes = {**{k: v for k, v in sizes.items() if k != "ffn_hidden_dim"}, "vocab_size": args.vocab_size,
             **{k: v for k, v in sizes.items() if k == "ffn_hidden_dim"}}
    for field, size in sizes.items():
        if size % tp:
            raise UserError(f"parallel.tp={tp}: model.{field}={size} is not divisible by the tensor-parallel degree")


def _local(x: Any, layout: Placement, mesh: Any) -> DTensor:
    return x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [layout], run_check=False)


class _FirstInput(ParallelStyle):
    """Redistribute a module's first positional input from ``layout`` to ``Replicate`` and hand it on as a
    DTensor: the column-parallel projections inside then share one input, so the gradients of all of
    them are reduced back to ``layout`` by one collective."""

    def __init__(self, layout: Placement) -> None:
        super().__init__()
        self.layout = layout

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        def pre(_: nn.Module, args: tuple) -> tuple:
            return (_local(args[0], self.layout, device_mesh).redistribute(device_mesh, [Replicate()]), *args[1:])

        module.register_forward_pre_hook(pre)
        return module


class _ReplicatedCompute(ParallelStyle):
    """The whole module on every rank: parameters become replicated DTensors, and the forward runs on
    plain tensors (their local copies) over the full sequence, gathered from ``layout`` and handed back
    in ``layout``. For modules that DTensor need not understand (the mixture of experts' routing and
    grouped matmuls), and for norms on a replicated residual stream. Every rank computes the same
    values, so the parameters' gradients are already the replicated ones."""

    def __init__(self, layout: Placement = Replicate()) -> None:
        super().__init__()
        self.layout = layout

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if p is not None and not isinstance(p, DTensor):
                    sub.register_parameter(name, nn.Parameter(
                        DTensor.from_local(p.data, device_mesh, [Replicate()], run_check=False), p.requires_grad))
        inner = module.forward

        def forward(x: Tensor, *args: Any) -> Tensor:
            # Whatever parameter is in place now (FSDP2 puts its unsharded one there first) is swapped
            # for its local tensor, differentiably, so the gradient reaches the parameter. Swapped back in
            # `finally`: activation checkpointing stops a recompute midway by raising.
            swapped = []
            try:
                for sub in module.modules():
                    for name, p in list(sub._parameters.items()):
                        if isinstance(p, DTensor):
                            swapped.append((sub, name, p))
                            sub._parameters[name] = p.to_local()
                full = _local(x, self.layout, device_mesh).redistribute(device_mesh, [Replicate()]).to_local()
                out = inner(full, *args)
            finally:
                for sub, name, p in swapped:
                    sub._parameters[name] = p
            out = DTensor.from_local(out, device_mesh, [Replicate()], run_check=False)
            return out.redistribute(device_mesh, [self.layout]).to_local()

        module.forward = forward  # type: ignore[method-assign]
        return module


def _style(role: str, sequence_parallel: bool) -> ParallelStyle:
    """The DTensor style of a role the model's own plan names (``TransformerBlock.tp_plan``)."""
    stream: Placement = Shard(1) if sequence_parallel else Replicate()
    if role == "colwise":
        return ColwiseParallel()
    if role == "rowwise":
        return RowwiseParallel(output_layouts=stream)
    if role == "norm":
        return SequenceParallel(use_local_output=True) if sequence_parallel else _ReplicatedCompute()
    if role == "head_norm":  # per head ([B, T, heads, head_dim]): each rank norms its own heads
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if role == "input":
        return _FirstInput(stream)
    if role == "replicated":
        return _ReplicatedCompute(stream)
    raise ValueError(f"unknown tensor-parallel role {role!r}")


def _sum_partial_grads(model: nn.Module) -> None:
    """Gradients arrive in their parameter's placement: a partial sum is reduced as it is accumulated."""
    for p in model.parameters():
        if isinstance(p, DTensor) and p.requires_grad:
            p.register_hook(lambda g, p=p: g.redistribute(placements=p.placements)
                            if isinstance(g, DTensor) and g.placements != p.placements else g)


def apply_tp(model: Transformer, tp_mesh: Any, *, sequence_parallel: bool = True) -> None:
    """Split ``model`` over the 1-D tensor-parallel ``tp_mesh`` in place (see the module docstring).

    Every rank of the mesh must hold the same weights and be fed the same batch; apply this first,
    before activation checkpointing, ``torch.compile`` and FSDP2 (which wraps the split blocks)."""
    tp = tp_mesh.size()
    check_tp(model.args, tp)
    # Norms over the 2-D (dp_shard, tp) mesh reduce once per dimension; torch warns on every step.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    stream: Placement = Shard(1) if sequence_parallel else Replicate()
    ends = {
        "embedding": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        # the loss head gathers the sequence itself (lmforge.losses.chunked_loss): keep the DTensor
        "final_norm": SequenceParallel(use_local_output=False) if sequence_parallel else _ReplicatedCompute(),
        "output": ColwiseParallel(input_layouts=stream, output_layouts=Replicate()),
    }
    parallelize_module(model, tp_mesh, {name: ends[role] for name, role in model.tp_plan().items()})
    model.tie_weights()  # tied: both are Shard(0) of [vocab, dim], one parameter again
    for block in model.layers:  # the model names its modules and their roles; this module owns the mechanics
        parallelize_module(block, tp_mesh, {name: _style(role, sequence_parallel)
                                            for name, role in block.tp_plan().items()})
    _sum_partial_grads(model)
    if sequence_parallel:
        def check_length(_: nn.Module, args: tuple) -> None:
            if args[0].shape[1] % tp:
                raise UserError(f"parallel.tp={tp} with sequence parallelism: sequence length {args[0].shape[1]} "
                                "is not divisible by the tensor-parallel degree")

        model.register_forward_pre_hook(check_length)
