"""A divergence between a teacher's and a student's next-token distributions, chunked over target rows.

Per target position, with ``p = softmax(teacher_logits / T)`` and ``q = softmax(student_logits / T)``:

* ``forward_kl``: ``KL(p || q) = sum p (log p - log q)`` (mode covering);
* ``reverse_kl``: ``KL(q || p) = sum q (log q - log p)`` (mode seeking);
* ``jsd`` with ``beta`` in (0, 1): the generalized Jensen-Shannon divergence of the GKD paper,
  ``beta KL(p || m) + (1 - beta) KL(q || m)`` with ``m = beta p + (1 - beta) q``. Its value goes to 0 at
  both ends; ``JSD / beta -> KL(p || q)`` as ``beta -> 0`` and ``JSD / (1 - beta) -> KL(q || p)`` as
  ``beta -> 1``, so ``beta = 0`` and ``beta = 1`` *mean* forward and reverse KL here (those limits, as the
  paper's implementations take them), not the vanishing value.

Plus ``ce_weight`` times the student's ordinary cross-entropy (at temperature 1) on the labels of rows
that have one. The temperature divides both models' logits; the loss is not multiplied by ``T^2``.

Gradients w.r.t. the student's logits ``z`` (``u = z / T``), per row, derived from ``d/dq_j``:

* forward KL: ``q - p``;
* reverse KL: ``q (log q - log p - KL(q || p))``;
* JSD: ``d/dq_j = (1 - beta) log(q_j / m_j)``, so ``(1 - beta) q (log q - log m - KL(q || m))``;

each divided by ``T``; the cross-entropy adds ``ce_weight (softmax(z) - onehot(y))``. As in
:class:`lmforge.losses.chunked_loss._ChunkedLogprobSum` the loss is a *sum* over rows, so its
gradient w.r.t. each chunk's logits is known in the forward pass up to one scalar: both input
gradients are accumulated there while the chunk's distributions are at hand, and the backward only
scales them. At most ``chunk`` rows of full-vocabulary logits of each model exist at any time.
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from lmforge.losses.chunked_loss import compute_dtype
from lmforge.losses.loss_grads import precomputed_grads, save_precomputed_grads

Divergence = Literal["forward_kl", "reverse_kl", "jsd"]


class DivergenceSums(NamedTuple):
    objective: Tensor
    """``sum divergence + ce_weight * sum ce``: differentiable w.r.t. the student's hidden rows and weight."""
    divergence: Tensor
    """Sum of the per-row divergence (no grad)."""
    ce: Tensor
    """Sum of the student's cross-entropy over rows with a label (no grad; computed whatever ce_weight)."""
    agree: Tensor
    """Rows whose student and teacher argmax agree (no grad)."""


def resolve(kind: Divergence, beta: float) -> tuple[str, float]:
    """``jsd`` at ``beta`` 0 or 1 is forward or reverse KL (the limits of the module docstring)."""
    if kind == "jsd" and beta <= 0.0:
        return "forward_kl", beta
    if kind == "jsd" and beta >= 1.0:
        return "reverse_kl", beta
    return kind, beta


def _divergence_rows(logq: Tensor, logp: Tensor, kind: str, beta: float) -> tuple[Tensor, Tensor]:
    """Per-row divergence [c] and its gradient w.r.t. ``u`` (the student's logits / T) [c, V]; in place
    where it can be, since every temporary is a chunk of full-vocabulary rows."""
    if kind == "forward_kl":
        p = logp.exp()
        d = torch.sub(logp, logq).mul_(p).sum(-1)
        return d, logq.exp().sub_(p)
    if kind == "reverse_kl":
        q, diff = logq.exp(), torch.sub(logq, logp)
        d = (q * diff).sum(-1)
        return d, diff.sub_(d.unsqueeze(-1)).mul_(q)
    logm = torch.logaddexp(logp + math.log(beta), logq + math.log1p(-beta))
    kl_pm = torch.sub(logp, logm).mul_(logp.exp()).sum(-1)
    q, diff = logq.exp(), logq - logm
    del logm
    kl_qm = (q * diff).sum(-1)
    return beta * kl_pm + (1 - beta) * kl_qm, diff.sub_(kl_qm.unsqueeze(-1)).mul_(q).mul_(1 - beta)


class _ChunkedDivergence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, teacher_hidden: Tensor, teacher_weight: Tensor,
                labels: Tensor, chunk: int, temperature: float, kind: str, beta: float, ce_weight: float,
                cdtype: torch.dtype, teacher_cdtype: torch.dtype) -> tuple[Tensor, ...]:
        n = hidden.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        fdtype = torch.promote_types(cdtype, torch.float32)  # fp32 softmax, fp64 when the inputs are
        div_sum = torch.zeros((), dtype=fdtype, device=hidden.device)
        ce_sum = torch.zeros((), dtype=fdtype, device=hidden.device)
        agree = torch.zeros((), dtype=torch.long, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=fdtype, device=weight.device) if need_w else None
        w, tw = weight.to(cdtype), teacher_weight.to(teacher_cdtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, chunk):
                h = hidden[s:s + chunk].to(cdtype)
                z = F.linear(h, w).to(fdtype)
                zt = F.linear(teacher_hidden[s:s + chunk].to(teacher_cdtype), tw).to(fdtype)
                agree += (z.argmax(-1) == zt.argmax(-1)).sum()
                logq = F.log_softmax(z / temperature if temperature != 1.0 else z, dim=-1)
                logp = F.log_softmax(zt / temperature if temperature != 1.0 else zt, dim=-1)
                del zt
                if temperature == 1.0:
                    del z
                d, grad_z = _divergence_rows(logq, logp, kind, beta)
                del logp
                div_sum += d.sum()
                if temperature != 1.0:
                    grad_z.div_(temperature)
                    logq = F.log_softmax(z, dim=-1)  # the cross-entropy is at temperature 1
                    del z
                y = labels[s:s + chunk]
                has = y >= 0
                y_safe = torch.where(has, y, torch.zeros_like(y)).unsqueeze(-1)
                ce_rows = -logq.gather(-1, y_safe).squeeze(-1) * has
                ce_sum += ce_rows.sum()
                if ce_weight:  # + ce_weight (softmax(z) - onehot(y)) on rows with a label
                    scale = has.to(fdtype).unsqueeze(-1) * ce_weight
                    grad_z += logq.exp_().mul_(scale)
                    grad_z.scatter_add_(-1, y_safe, -scale)
                del logq
                grad_z = grad_z.to(cdtype)
                if grad_h is not None:
                    grad_h[s:s + chunk] = grad_z @ w
                if grad_w is not None:
                    grad_w.add_(grad_z.t() @ h)
                del grad_z
        save_precomputed_grads(ctx, grad_h, grad_w, weight.dtype)
        objective = div_sum + ce_weight * ce_sum
        ctx.mark_non_differentiable(div_sum, ce_sum, agree)
        return objective, div_sum, ce_sum, agree

    @staticmethod
    def backward(ctx: Any, grad_objective: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        return (*precomputed_grads(ctx, grad_objective), *(None,) * 10)


def chunked_divergence(hidden: Tensor, weight: Tensor, teacher_hidden: Tensor, teacher_weight: Tensor,
                       labels: Tensor, *, kind: Divergence, beta: float = 0.5, temperature: float = 1.0,
                       ce_weight: float = 0.0, chunk_tokens: int) -> DivergenceSums:
    """The summed divergence (and weighted cross-entropy) over rows: student rows ``hidden`` [N, d]
    projected by ``weight`` [V, d], teacher rows ``teacher_hidden`` [N, d_t] by ``teacher_weight``
    [V, d_t] (no grad), ``labels`` [N] the target ids (negative: no cross-entropy on that row)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"vocabularies differ: student {weight.shape[0]}, teacher {teacher_weight.shape[0]}")
    kind_, beta = resolve(kind, beta)
    out = _ChunkedDivergence.apply(hidden, weight, teacher_hidden.detach(), teacher_weight.detach(), labels,
                                   chunk_tokens, float(temperature), kind_, float(beta), float(ce_weight),
                                   compute_dtype(hidden, weight), compute_dtype(teacher_hidden, teacher_weight))
    return DivergenceSums(*out)
