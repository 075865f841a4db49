"""Mixture-of-experts feed-forward: a top-k router over gated-MLP experts, run as grouped matmuls.

Routing is dropless (every token reaches its ``k`` experts; no capacity limit, so no token is ever
skipped and the result does not depend on the batch): router logits in the activation dtype,
probabilities by a softmax in fp32, the top ``k`` kept and, where the family does (Mixtral,
Qwen3-MoE with ``norm_topk_prob``), renormalised to sum to one (OLMoE keeps them as they are).

Dispatch sorts the ``N * k`` (token, expert) slots by expert, so each expert's tokens form one
contiguous run; one grouped matmul per projection (``torch.nn.functional.grouped_mm``) multiplies
every run by its own expert's matrix, with no Python loop over experts and no host sync. The
outputs are weighted by their router probability and summed back per token. The sorted runs are
exactly what an expert-parallel all-to-all would exchange (each run goes to the rank that owns
its expert), so that layout can be added around :meth:`GroupedExperts.forward` without changing it.

Where the device has no grouped kernel (CUDA in fp32: torch's kernel wants bf16 on SM80+), the
experts run in a loop over the runs instead (``impl="loop"``; it reads the run lengths on the host).

With expert parallelism (:mod:`lmforge.parallel.expert_parallel`) the expert weights are DTensors
sharded over the ``ep`` ranks and :attr:`MoEFeedForward.expert_parallel` carries the sorted runs to
their owners and back; routing, its statistics and the weighted combine stay on the token's rank.

Every forward leaves its routing on the module, per token (:attr:`MoEFeedForward.last_routing`):
what the load-balancing loss and the router statistics on the metrics line are computed from,
across all MoE layers at once and over the real (non-padding) tokens only (:func:`router_losses`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lmforge.models.layers.mlp import activation, gated_activation

__all__ = ["GroupedExperts", "MoEFeedForward", "RouterLosses", "RoutingStats", "router_losses"]


@dataclass
class RoutingStats:
    """One MoE layer's routing in its last forward, kept per token: only the caller knows which tokens
    are padding (the layer sees a flat ``[N, dim]``), so :func:`router_losses` reduces them with its mask."""

    probs: Tensor
    """[N, E] fp32 router probabilities (differentiable: the aux loss's gradient path). Until backward the
    softmax keeps them for its own gradient anyway; after it they stay alive until the layer's next
    forward replaces them (N x E x 4 bytes per MoE layer, e.g. 4 MiB for 8k tokens and 128 experts)."""
    chosen: Tensor
    """[N, k] the experts each token was sent to."""
    z: Tensor
    """[N] fp32 ``logsumexp(logits)^2`` per token (the router z-loss, differentiable)."""
    slots: Tensor
    """[E] fp32: how many of the top-k slots each expert received (all tokens, padding included: the
    dispatch's own counts)."""

    @property
    def tokens(self) -> int:
        return self.probs.shape[0]

    def sums(self, mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(probability sum [E], slot counts [E], z sum, token count) over the tokens where ``mask``
        ([N], 1 = real token) is set; over all tokens without a mask. The counts weight each slot by
        its token's mask, as transformers' ``load_balancing_loss_func`` does with the attention mask."""
        if mask is None:
            return self.probs.sum(0), self.slots, self.z.sum(), torch.tensor(float(self.tokens), device=self.probs.device)
        w = mask.reshape(-1).to(self.probs.dtype)
        if w.numel() != self.tokens:
            raise ValueError(f"router mask of {w.numel()} tokens for a forward of {self.tokens}")
        counts = torch.zeros_like(self.slots).scatter_add_(0, self.chosen.reshape(-1),
                                                          w.repeat_interleave(self.chosen.shape[1]))
        return (self.probs * w.unsqueeze(-1)).sum(0), counts, (self.z * w).sum(), w.sum()

    @property
    def prob_sum(self) -> Tensor:
        return self.probs.sum(0)

    @property
    def counts(self) -> Tensor:
        return self.slots

    @property
    def z_sum(self) -> Tensor:
        return self.z.sum()


def _contiguous_grad(t: Tensor) -> Tensor:
    """Make the gradient flowing into ``t`` contiguous: the CPU grouped-matmul backward refuses the
    stride-0 gradients that e.g. ``out.sum().backward()`` produces."""
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())
    return t


class GroupedExperts(nn.Module):
    """``E`` gated MLPs stored as 3-D weights: ``w1``/``w3`` [E, hidden, dim] (gate/up), ``w2`` [E, dim, hidden].
    The gated product goes through :func:`~lmforge.models.layers.mlp.gated_activation` as in the dense MLP
    (three hidden-size tensors saved per routed row, not four)."""

    def __init__(self, n_experts: int, dim: int, hidden_dim: int, hidden_act: str = "silu") -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        activation(hidden_act)  # an unknown name fails here, at build time
        self.hidden_act = hidden_act
        self.reset_parameters()
        self.impl = "auto"
        """``grouped`` (one grouped matmul per projection), ``loop`` (one matmul per expert) or ``auto``."""

    def reset_parameters(self) -> None:
        """Each expert's matrices initialised as ``nn.Linear`` initialises its weight."""
        for w in (self.w1, self.w2, self.w3):
            for e in range(w.shape[0]):
                nn.init.kaiming_uniform_(w[e], a=5 ** 0.5)

    def uses_grouped_kernel(self, x: Tensor) -> bool:
        if self.impl != "auto":
            return self.impl == "grouped"
        return x.device.type == "cpu" or x.dtype == torch.bfloat16

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """Rows of ``x`` [S, dim] sorted by expert, ``counts`` [E] rows per expert -> [S, dim].
        Weights sharded over expert-parallel ranks compute with this rank's experts (``counts`` then
        has one entry per local expert)."""
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        if self.uses_grouped_kernel(x):
            offs = torch.cumsum(counts, 0).to(torch.int32)

            def mm(a: Tensor, w: Tensor) -> Tensor:
                return _contiguous_grad(F.grouped_mm(a, w.transpose(-2, -1), offs=offs))

            return mm(gated_activation(mm(x, w1), mm(x, w3), self.hidden_act), w2)
        # unbind (not w[e]): autograd then stacks the experts' gradients once, instead of adding one
        # full-size zero gradient of the 3-D weight per expert; every expert, even one that got no
        # token, stays in the graph, so DDP sees a gradient for each.
        outs = [F.linear(gated_activation(F.linear(rows, w1), F.linear(rows, w3), self.hidden_act), w2)
                for rows, w1, w2, w3 in zip(x.split(counts.tolist()), w1.unbind(0), w2.unbind(0),
                                            w3.unbind(0)) if rows.shape[0]]
        return torch.cat(outs)


class MoEFeedForward(nn.Module):
    """Router (``router.weight`` [E, dim]) plus :class:`GroupedExperts`; a drop-in for the dense MLP."""

    def __init__(self, dim: int, hidden_dim: int, n_experts: int, top_k: int, norm_topk: bool,
                 hidden_act: str = "silu") -> None:
        super().__init__()
        self.n_experts, self.top_k, self.norm_topk = n_experts, top_k, norm_topk
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = GroupedExperts(n_experts, dim, hidden_dim, hidden_act)
        self.last_routing: RoutingStats | None = None
        self.expert_parallel: Callable[[GroupedExperts, Tensor, Tensor], Tensor] | None = None
        """Set by :func:`lmforge.parallel.expert_parallel.apply_ep`: runs the experts on sorted slots
        (same signature and result as ``experts(x, counts)``) with each run on the rank owning its expert."""

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.router(flat)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        slots = chosen.reshape(-1)
        order = torch.argsort(slots, stable=True)
        counts = torch.bincount(slots, minlength=self.n_experts)
        token_of = order // self.top_k
        rows = flat.index_select(0, token_of)
        if self.expert_parallel is None:
            out = self.experts(rows, counts)
        else:
            out = self.expert_parallel(self.experts, rows, counts)
        out = out * weights.reshape(-1, 1).index_select(0, order).to(out.dtype)
        combined = torch.zeros_like(flat).index_add_(0, token_of, out.to(flat.dtype))
        self.last_routing = RoutingStats(probs, chosen, torch.logsumexp(logits.float(), -1).pow(2), counts.float())
        return combined.view(shape)


@dataclass
class RouterLosses:
    """The load-balancing terms of a model's last forward, over all its MoE layers together."""

    aux_loss: Tensor
    """Switch-Transformer load balancing, as transformers computes it over the concatenated layers:
    ``E * sum_e f_e * P_e`` with ``f_e`` the share of top-k slots and ``P_e`` the mean router probability
    of expert ``e``. ``k`` (experts per token) under perfectly uniform routing; grows as routing collapses."""
    z_loss: Tensor
    """Router z-loss (ST-MoE): the mean over tokens and layers of ``logsumexp(logits)^2``."""
    counts: Tensor
    """[n_moe_layers, E] top-k slots each expert received, for the router statistics."""


def router_losses(model: nn.Module, mask: Tensor | None = None) -> RouterLosses | None:
    """The routing terms of ``model``'s last forward (None for a model without MoE layers).

    ``mask`` ([B, T] of the forward's tokens, nonzero = real token) leaves padding out of every term
    and count, as transformers' ``load_balancing_loss_func`` does with its ``attention_mask``; None
    counts every token. The terms are those of this one forward: a step of several microbatches
    (or ranks) combines per-microbatch values (see :mod:`lmforge.objectives.router`).
    """
    stats = [m.last_routing for m in model.modules() if isinstance(m, MoEFeedForward) and m.last_routing is not None]
    if not stats:
        return None
    n_experts = stats[0].probs.shape[1]
    prob_sums, counts, z_sums, tokens = zip(*(s.sums(mask) for s in stats))
    counts = torch.stack(counts)
    total = torch.stack(tokens).sum().clamp(min=1)  # all padding: zero terms, not 0/0
    aux = n_experts * torch.sum((counts.sum(0) / total) * (torch.stack(prob_sums).sum(0) / total))
    z = torch.stack(z_sums).sum() / total
    return RouterLosses(aux, z, counts)
