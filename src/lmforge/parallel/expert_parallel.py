"""Expert parallelism: each MoE layer's experts split over the ``ep`` ranks, and tokens sent to them.

EP borrows its ranks from the data-shard dimension (``dp_shard = dp_shard_mod_ep x ep``): every ep
rank has its own tokens, routes them itself (router replicated, routing statistics of its own
tokens, exactly as one process would compute them), and owns experts
``[r * E / ep, (r + 1) * E / ep)``. The expert weights become DTensors ``Shard(0)`` on the ep mesh,
so state dicts keep the full ``[E, ...]`` shape and distributed checkpoints reshard them.

Dispatch (:class:`ExpertDispatch`): the MoE layer has already sorted its ``(token, expert)`` slots
by expert, so the slots bound for one rank are one contiguous run. The per-expert counts go first
(an all-to-all of ``E`` integers, read on the host: they size the exchange), then the rows (an
all-to-all with autograd, uneven splits). The owner receives, from each source rank, rows sorted by
its local experts; it re-sorts them by local expert, runs the grouped matmul on its shard, restores
the arrival order, and a second all-to-all brings the outputs back in the sender's order, where the
layer applies the router weights and sums per token as before.

Gradient scale (:func:`shard_experts`): the train step multiplies each rank's objective by the
data-parallel world size ``W`` and divides by the global target count, and the data-parallel
reduction averages over ``W`` ranks. An expert's gradient on its owner already sums the
contributions of the tokens of all ``ep`` ranks (the all-to-all's backward brings them), so it must
be *summed* over the ``W / ep`` ranks that hold the same experts and divided by ``W``, not averaged
over ``W / ep`` (which would leave it ``ep`` times too large).

Plan order: :func:`apply_ep` on the ep sub-mesh, then activation checkpointing and compile per
block, then :func:`shard_experts` on the ``dp_shard_mod_ep`` sub-mesh, then FSDP2 of each block
and the root on the flattened ``dp_shard`` mesh. Gradient clipping across the two meshes:
:func:`clip_grad_norm`.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import Tensor, nn
# torch's functional collectives: what torch.distributed.nn.functional.all_to_all_single (deprecated)
# points to; traced by torch.compile, and on gloo they take uneven splits, autograd included.
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Shard

from lmforge.errors import UserError
from lmforge.models.layers.moe import GroupedExperts, MoEFeedForward

__all__ = ["ExpertDispatch", "apply_ep", "check_ep", "clip_grad_norm", "moe_layers", "shard_experts"]


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


class ExpertDispatch:
    """``MoEFeedForward.expert_parallel`` over one ep group: ``(experts, rows, counts) -> outputs``
    with ``rows`` [S, dim] sorted by global expert and ``counts`` [E]; the result is in ``rows``' order."""

    def __init__(self, ep_mesh: Any) -> None:
        self.group = ep_mesh.get_group()
        self.size = ep_mesh.size()

    def __call__(self, experts: GroupedExperts, rows: Tensor, counts: Tensor) -> Tensor:
        local = counts.numel() // self.size
        # received[s, e]: rows source rank s sends to this rank's local expert e
        received = all_to_all_single(counts, [local] * self.size, [local] * self.size, self.group)
        received = received.view(self.size, local)
        send_splits = counts.view(self.size, local).sum(1).tolist()
        recv_splits = received.sum(1).tolist()  # the one host sync: the exchange's sizes
        arrived = all_to_all_single_autograd(rows, recv_splits, send_splits, self.group)
        # Arrivals are grouped by source rank, each group sorted by local expert: sort by expert.
        expert_of = torch.repeat_interleave(torch.arange(local, device=counts.device).repeat(self.size),
                                            received.reshape(-1))
        order = torch.argsort(expert_of, stable=True)
        if sum(recv_splits):
            out = experts(arrived.index_select(0, order), received.sum(0))
            out = out.index_select(0, torch.argsort(order))  # back to arrival order
        else:
            out = _run_idle(experts, arrived, local)
        return all_to_all_single_autograd(out, send_splits, recv_splits, self.group)


def _run_idle(experts: GroupedExperts, arrived: Tensor, local: int) -> Tensor:
    """The experts of a rank that received no slot, run on one zero row (the per-expert loop cannot
    run on none): their gradients are zeros, not missing (the data-parallel reduction over ranks
    holding the same experts expects one from every rank), and ``arrived`` stays in the graph, so
    this rank joins the backward exchange its peers start. The result has no rows."""
    pad = torch.cat([arrived, arrived.new_zeros(1, arrived.shape[1])])
    counts = torch.zeros(local, dtype=torch.long, device=arrived.device)
    counts[0] = 1
    return experts(pad, counts)[:0]


def apply_ep(model: nn.Module, ep_mesh: Any) -> None:
    """Shard every MoE layer's experts over ``ep_mesh`` (1-D, the ``ep`` ranks) and route their
    tokens through :class:`ExpertDispatch`. Each rank keeps its slice of the weights it already
    holds (every rank built the same model), so nothing is communicated here. Apply before
    activation checkpointing, compile and FSDP2 (see :func:`shard_experts`)."""
    size, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    dispatch = ExpertDispatch(ep_mesh)
    for moe in moe_layers(model):
        experts = moe.experts
        for name, w in list(experts.named_parameters(recurse=False)):  # every [E, ...] weight and bias
            n = w.shape[0] // size
            local = w.detach()[rank * n:(rank + 1) * n].clone()
            sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=w.shape,
                                         stride=w.stride())
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=w.requires_grad))
        moe.expert_parallel = dispatch


def shard_experts(model: nn.Module, expert_dp_mesh: Any, grad_divide_factor: int, **fsdp_kwargs: Any) -> None:
    """FSDP2 over the ranks holding the same experts (``expert_dp_mesh``: ``dp_shard_mod_ep``, or
    ``(dp_replicate, dp_shard_mod_ep)`` for HSDP; size 1 allowed) for every MoE layer's experts,
    with their gradients summed over that mesh and divided by ``grad_divide_factor`` (the factor the
    train step multiplied the objective by: the data-parallel world size ``W``).

    Call after :func:`apply_ep` (and after activation checkpointing / compile), before the plan's
    ``fully_shard`` of each block and the root: those then skip the expert parameters, which this
    FSDP unit already manages. ``fsdp_kwargs`` (e.g. ``mp_policy``) as the rest of the model gets.
    """
    from torch.distributed.fsdp import fully_shard

    for moe in moe_layers(model):
        unit = fully_shard(moe.experts, mesh=expert_dp_mesh, **fsdp_kwargs)
        unit.set_gradient_divide_factor(float(grad_divide_factor))
        if expert_dp_mesh.size() > 1:
            # Sum, then divide: the pre-multiplied sum a custom factor would otherwise use is NCCL's
            # alone (gloo has no PREMUL_SUM). Over one rank FSDP divides by the factor itself.
            unit.set_force_sum_reduction_for_comms(True)


@torch.no_grad()
def clip_grad_norm(params: Iterable[Tensor], max_norm: float) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (2-norm) for gradients on several meshes, which torch's
    refuses to stack: with EP the experts' gradients live on ``(dp_shard_mod_ep, ep)``, the rest
    on ``dp_shard``. Each mesh's norm is reduced over its ranks, the norms are combined, and every
    gradient is scaled by the one factor ``min(1, max_norm / (norm + 1e-6))``. Returns the global
    norm before clipping (a plain tensor; ``max_norm`` inf: measure only)."""
    by_mesh: dict[Any, list[Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    norms = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grads in by_mesh.values():
        torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in grads], coef)
    return total


def check_ep(args: Any, ep: int, dp_shard: int) -> None:
    """One line for an ``ep`` this model and mesh cannot take (``args``: the model's ``ModelArgs``)."""
    if ep <= 1:
        return
    if not getattr(args, "n_experts", 0):
        raise UserError(f"parallel.ep={ep}: the model has no mixture-of-experts layers (n_experts=0); "
                        f"expert parallelism needs a MoE model")
    if args.n_experts % ep:
        raise UserError(f"parallel.ep={ep}: the model's n_experts={args.n_experts} is not divisible by ep")
    if dp_shard % ep:
        raise UserError(f"parallel.ep={ep} must divide parallel.dp_shard={dp_shard} "
                        f"(expert parallelism borrows its ranks from the data-shard ranks)")

