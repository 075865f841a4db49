"""Mixture-of-experts feed-forward: a top-k router over gated-MLP experts, run as grouped matmuls.

Routing is dropless (every token reaches its ``k`` experts; no capacity limit, so no token is ever
skipped and the result does not depend on the batch). The rule is the :class:`Router`'s config:
a softmax over the logits, top ``k`` kept and, where the family does (Mixtral, Qwen3-MoE with
``norm_topk_prob``), renormalised (OLMoE keeps them as they are); DeepSeek-V3's sigmoid affinities
with group-limited choice, a correction bias that steers the choice only, and a routed scaling
factor; or gpt-oss's softmax over the top-k logits. Logits come in the activation dtype, the rest
is computed in fp32.

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

from lmforge.models.configs import MLPConfig, MoEConfig, RouterConfig
from lmforge.models.layers.mlp import FeedForward, check_activation, gated_unit

__all__ = ["GroupedExperts", "MoEFeedForward", "Router", "RouterLosses", "RoutingStats", "balance_correction_bias",
           "router_losses"]


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
    rows: int = 1
    """Rows of the forward's ``[B, T, dim]`` input (B): the sequences of the sequence-wise loss."""
    scope: str = "batch"
    """The layer's ``RouterConfig.aux_scope``."""

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
    """``E`` gated MLPs stored as 3-D weights: ``w1``/``w3`` [E, hidden, dim] (gate/up), ``w2`` [E, dim, hidden],
    and with ``MLPConfig.bias`` (gpt-oss) biases ``b1``/``b3`` [E, hidden] and ``b2`` [E, dim]. The gated
    product goes through :func:`~lmforge.models.layers.mlp.gated_unit` as in the dense MLP."""

    def __init__(self, n_experts: int, cfg: MLPConfig) -> None:
        super().__init__()
        dim, hidden_dim = cfg.dim, cfg.hidden_dim
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden_dim, dim))
        self.b1 = self.b2 = self.b3 = None
        if cfg.bias:
            self.b1 = nn.Parameter(torch.zeros(n_experts, hidden_dim))
            self.b2 = nn.Parameter(torch.zeros(n_experts, dim))
            self.b3 = nn.Parameter(torch.zeros(n_experts, hidden_dim))
        check_activation(cfg)  # an unknown name fails here, at build time
        self.cfg = cfg
        self.reset_parameters()
        self.impl = "auto"
        """``grouped`` (one grouped matmul per projection), ``loop`` (one matmul per expert) or ``auto``."""

    def reset_parameters(self) -> None:
        """Each expert's matrices initialised as ``nn.Linear`` initialises its weight; biases zero."""
        for w in (self.w1, self.w2, self.w3):
            for e in range(w.shape[0]):
                nn.init.kaiming_uniform_(w[e], a=5 ** 0.5)
        for b in (self.b1, self.b2, self.b3):
            if b is not None:
                nn.init.zeros_(b)

    def uses_grouped_kernel(self, x: Tensor) -> bool:
        if self.impl != "auto":
            return self.impl == "grouped"
        return x.device.type == "cpu" or x.dtype == torch.bfloat16

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """Rows of ``x`` [S, dim] sorted by expert, ``counts`` [E] rows per expert -> [S, dim].
        Weights sharded over expert-parallel ranks compute with this rank's experts (``counts`` then
        has one entry per local expert)."""
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        b1, b2, b3 = (None if b is None else _local(b) for b in (self.b1, self.b2, self.b3))
        if self.uses_grouped_kernel(x):
            offs = torch.cumsum(counts, 0).to(torch.int32)
            # each row's expert, for the biases: no host sync with output_size given
            expert_of = None if b1 is None else torch.repeat_interleave(
                torch.arange(counts.shape[0], device=x.device), counts, output_size=x.shape[0])

            def mm(a: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
                out = _contiguous_grad(F.grouped_mm(a, w.transpose(-2, -1), offs=offs))
                return out if b is None else out + b.index_select(0, expert_of).to(out.dtype)

            return mm(gated_unit(mm(x, w1, b1), mm(x, w3, b3), self.cfg), w2, b2)
        # unbind (not w[e]): autograd then stacks the experts' gradients once, instead of adding one
        # full-size zero gradient of the 3-D weight per expert; every expert, even one that got no
        # token, stays in the graph, so DDP sees a gradient for each.
        n = w1.shape[0]
        biases = [(None, None, None)] * n if b1 is None else list(zip(b1.unbind(0), b2.unbind(0), b3.unbind(0)))
        outs = [F.linear(gated_unit(F.linear(rows, e1, c1), F.linear(rows, e3, c3), self.cfg), e2, c2)
                for rows, e1, e2, e3, (c1, c2, c3) in zip(x.split(counts.tolist()), w1.unbind(0), w2.unbind(0),
                                                          w3.unbind(0), biases) if rows.shape[0]]
        return torch.cat(outs)


def _in_backward() -> bool:
    """Inside autograd's backward pass (where activation checkpointing recomputes a forward): torch's
    graph-task id is -1 outside one (``torch.utils.checkpoint`` asks the same to tell a recomputation)."""
    return torch._C._current_graph_task_id() != -1


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Router(nn.Linear):
    """The router's linear layer (``weight`` [E, dim], ``bias`` [E] where the family has one) and the
    routing rule of its :class:`RouterConfig`: which ``top_k`` experts a token goes to, with what weights.

    ``correction_bias`` (DeepSeek-V3's ``e_score_correction_bias``, a persistent buffer: checkpointed, never
    trained by gradient) shifts the scores used to *choose* experts, not the weights; it is balanced after
    each optimizer step (:func:`balance_correction_bias`)."""

    def __init__(self, dim: int, cfg: RouterConfig) -> None:
        super().__init__(dim, cfg.n_experts, bias=cfg.bias)
        if cfg.n_experts % cfg.n_groups or not 1 <= cfg.topk_groups <= cfg.n_groups:
            raise ValueError(f"RouterConfig: {cfg.n_experts} experts do not split into {cfg.n_groups} groups "
                             f"with topk_groups={cfg.topk_groups}")
        self.cfg = cfg
        self.disagreement: Tensor | None = None
        """[N] bool, after a forward that replayed experts: the tokens this router would have sent elsewhere."""
        if cfg.correction_bias:
            self.register_buffer("correction_bias", torch.zeros(cfg.n_experts, dtype=torch.float32))
        else:
            self.correction_bias = None

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def,override]
        """``model.to(bf16)`` must not round the correction bias: its updates (``bias_update_speed``, 1e-3)
        are below bf16's resolution near the scores it shifts. It follows the device, never the dtype."""
        bias = self._buffers.pop("correction_bias", None)
        super()._apply(fn, recurse)
        if bias is not None:
            device = fn(torch.empty(0, device=bias.device)).device
            self._buffers["correction_bias"] = (torch.empty_like(bias, device=device) if bias.is_meta
                                                else bias.to(device))
        return self

    def route(self, flat: Tensor, replay: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(weights [N, k] fp32, chosen experts [N, k], probabilities [N, E] fp32 for the balancing terms,
        logits [N, E] fp32) for tokens ``flat`` [N, dim]. Sigmoid routing (DeepSeek-V3) computes its logits
        in fp32 from fp32 weights, as the reference does: its choice compares scores shifted by small biases.

        ``replay`` [N, k]: the experts to use instead of choosing (routing replay,
        :mod:`lmforge.models.layers.routing_replay`); their weights still come from these logits by the
        family's rule, so the router keeps its gradient. Where the replayed experts are the ones this
        router would choose, the result is bit-identical to choosing them."""
        cfg = self.cfg
        if cfg.scoring == "sigmoid":
            weight = self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight
            logits = F.linear(flat.float(), weight.float(), None if self.bias is None else self.bias.float())
        else:
            logits = self(flat).float()
        self.disagreement = None
        if cfg.scoring == "topk_softmax":  # gpt-oss: the k best logits, then a softmax over those k
            if replay is not None:
                chosen = replay
                top = logits.gather(1, chosen)
                self._disagree(torch.topk(logits.detach(), cfg.top_k, dim=-1)[1], replay)
            else:
                top, chosen = torch.topk(logits, cfg.top_k, dim=-1)
            return torch.softmax(top, dim=-1), chosen, torch.softmax(logits, dim=-1), logits
        if cfg.scoring == "softmax":
            probs = scores = torch.softmax(logits, dim=-1)
        else:  # sigmoid (DeepSeek-V3): independent affinities; their normalised form feeds the balancing terms
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(-1, keepdim=True)
        if replay is not None:
            chosen, weights = replay, scores.gather(1, replay)
            self._disagree(self._choose(scores.detach())[0], replay)
        else:
            chosen, weights = self._choose(scores)
        if cfg.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if cfg.scoring == "sigmoid" else 0.0))
        if cfg.scaling != 1.0:
            weights = weights * cfg.scaling
        return weights, chosen, probs, logits

    def _disagree(self, own: Tensor, replay: Tensor) -> None:
        """Keep, per token, whether this router would have chosen other experts than the replayed ones."""
        self.disagreement = (own.sort(-1).values != replay.sort(-1).values).any(-1)

    def _choose(self, scores: Tensor) -> tuple[Tensor, Tensor]:
        """(the top-k experts [N, k], their scores [N, k]): the best scores, shifted by the correction
        bias where there is one, within the ``topk_groups`` groups whose two best scores sum highest."""
        cfg = self.cfg
        choice = scores if self.correction_bias is None else scores + self.correction_bias
        if cfg.n_groups > 1:
            grouped = choice.view(-1, cfg.n_groups, cfg.n_experts // cfg.n_groups)
            best = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(-1)
            keep = torch.zeros_like(best).scatter_(1, best.topk(cfg.topk_groups, dim=-1)[1], 1.0).bool()
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(-1, cfg.n_experts)
        if choice is scores:
            weights, chosen = torch.topk(scores, cfg.top_k, dim=-1)
            return chosen, weights
        chosen = torch.topk(choice, cfg.top_k, dim=-1)[1]
        return chosen, scores.gather(1, chosen)


class MoEFeedForward(nn.Module):
    """A :class:`Router` plus :class:`GroupedExperts` (and DeepSeek's always-on ``shared_experts`` MLP where
    the config has one); a drop-in for the dense MLP."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.n_experts, self.top_k = cfg.router.n_experts, cfg.router.top_k
        self.router = Router(cfg.dim, cfg.router)
        self.experts = GroupedExperts(cfg.router.n_experts, cfg.expert)
        self.shared_experts = FeedForward(cfg.shared) if cfg.shared is not None else None
        self.last_routing: RoutingStats | None = None
        self.expert_parallel: Callable[[GroupedExperts, Tensor, Tensor], Tensor] | None = None
        """Set by :func:`lmforge.parallel.expert_parallel.apply_ep`: runs the experts on sorted slots
        (same signature and result as ``experts(x, counts)``) with each run on the rank owning its expert."""
        self.replay: Tensor | None = None
        """[N, k] experts to send the next forward's tokens to instead of routing them (set and cleared by
        :func:`lmforge.models.layers.routing_replay.replay_routes`)."""
        self._replayed: Tensor | None = None
        """The experts the last forward replayed: what its recomputation under activation checkpointing
        (which runs inside backward, after the replay was cleared) must replay again."""

    def weight_groups(self) -> tuple[list[Tensor], list[Tensor]]:
        """(matrices reading the block's input, matrices writing the residual stream), for the init."""
        ins, outs = [self.router.weight, self.experts.w1, self.experts.w3], [self.experts.w2]
        if self.shared_experts is not None:
            s_in, s_out = self.shared_experts.weight_groups()
            ins, outs = ins + s_in, outs + s_out
        return ins, outs

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        replay = self.replay if self.replay is not None else (self._replayed if _in_backward() else None)
        if replay is not None and replay.shape != (flat.shape[0], self.top_k):
            raise ValueError(f"routing replay of {tuple(replay.shape)} experts for {flat.shape[0]} tokens "
                             f"of top-{self.top_k} routing")
        self._replayed = replay
        weights, chosen, probs, logits = self.router.route(flat, None if replay is None else replay.to(flat.device, torch.long))
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
        if self.shared_experts is not None:
            combined = combined + self.shared_experts(flat)
        self.last_routing = RoutingStats(probs, chosen, torch.logsumexp(logits, -1).pow(2), counts.float(),
                                         rows=shape[0] if len(shape) == 3 else 1, scope=self.cfg.router.aux_scope)
        return combined.view(shape)


@torch.no_grad()
def balance_correction_bias(model: nn.Module, expert_load: Tensor, rate: float) -> None:
    """Auxiliary-loss-free load balancing (DeepSeek-V3, arXiv 2412.19437 section 2.1.2): after an optimizer
    step, each router's ``correction_bias`` moves by ``rate`` towards balance, up for experts that got fewer
    than the mean number of slots, down for those that got more. ``expert_load`` [n_moe_layers, E] is the
    step's slot count per expert summed over microbatches and ranks (identical on every rank, so every
    rank's biases stay identical)."""
    routers = [m.router for m in model.modules() if isinstance(m, MoEFeedForward)]
    with_bias = [(r, load) for r, load in zip(routers, expert_load) if r.correction_bias is not None]
    for router, load in with_bias:
        load = load.to(router.correction_bias.device, torch.float32)
        router.correction_bias.add_(rate * torch.sign(load.mean() - load))


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
    if stats[0].scope == "sequence":
        aux = torch.stack([_sequence_aux(s, mask) for s in stats]).mean()
    else:
        aux = n_experts * torch.sum((counts.sum(0) / total) * (torch.stack(prob_sums).sum(0) / total))
    z = torch.stack(z_sums).sum() / total
    return RouterLosses(aux, z, counts)


def _sequence_aux(s: RoutingStats, mask: Tensor | None) -> Tensor:
    """DeepSeek-V3's sequence-wise balance loss of one layer (arXiv 2412.19437, eq. 17-20): per row,
    ``sum_i f_i P_i`` with ``f_i = E / (k T) * (slots of expert i)`` and ``P_i`` the mean normalised
    affinity, over the row's real tokens; averaged over the rows that have any. 1 when balanced."""
    N, E = s.probs.shape
    B, k = s.rows, s.chosen.shape[1]
    w = (torch.ones(N, device=s.probs.device) if mask is None else mask.reshape(-1).to(s.probs.dtype)).view(B, -1)
    slots = torch.zeros(B, N // B, E, device=s.probs.device).scatter_add_(
        2, s.chosen.view(B, -1, k), w.unsqueeze(-1).expand(-1, -1, k).contiguous()).sum(1)
    T = w.sum(1)
    real = T > 0
    f = E / (k * T.clamp(min=1)).unsqueeze(1) * slots
    P = (s.probs.view(B, -1, E) * w.unsqueeze(-1)).sum(1) / T.clamp(min=1).unsqueeze(1)
    per_row = (f * P).sum(1)
    return (per_row * real).sum() / real.sum().clamp(min=1)  # no host sync: rows without real tokens weigh 0
