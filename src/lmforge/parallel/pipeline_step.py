"""The train step, eval and gradient norm over a :class:`~lmforge.parallel.pipeline.Pipeline`.

:func:`pipeline_gradient_computation` computes the gradients :func:`~lmforge.training.train_step.
gradient_computation` computes, with the step's microbatches as the pipeline's microbatches. Every
pp rank of a data-parallel group holds the same microbatches, so each stage gets each microbatch's
metadata (``position_ids``, ``document_ids``) as a keyword of its forward. On the last stage the
objective's own ``loss_fn`` runs unchanged *inside* that stage's forward (as ``Transformer.forward``'s
``head``; FSDP2 unshards the output weight for that call only): it is handed a stand-in for the model
whose call applies the objective's head to the stage's final-normed hidden states. The stage returns
``objective * scale_world / normalizer`` and the schedule back-propagates it as the loss, exactly the
term ``gradient_computation`` calls ``backward`` on.

Statistics exist on the last stage; it sends them to the other stages, so every rank returns them and
``LossStats.global_totals`` sums them over the data group as in any other step.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from lmforge.parallel.pipeline import Pipeline
from lmforge.losses.stats import LossStats, accumulate

LossFn = Callable[[Any, Any], "tuple[Tensor, LossStats]"]


class _FinalHidden:
    """Stands in for the model in ``loss_fn(model, microbatch)`` on the last stage: the layers and the
    final norm have run; the objective's one call applies its head (or the output projection) to them.
    Its metadata must be the microbatch's, which the stages already used."""

    def __init__(self, mb: Any, hidden: Tensor, weight: Tensor) -> None:
        self.mb, self.hidden, self.weight, self.called = mb, hidden, weight, False

    def __call__(self, tokens: Tensor, position_ids: Tensor | None = None, document_ids: Tensor | None = None,
                 kv_cache: Any = None, head: Any = None) -> Any:
        if self.called or kv_cache is not None:
            raise RuntimeError("under pipeline parallelism an objective calls the model once per microbatch, "
                               "without a kv_cache")
        if position_ids is not _meta(self.mb, "position_ids") or document_ids is not _meta(self.mb, "document_ids"):
            raise RuntimeError("under pipeline parallelism an objective must call the model with its microbatch's "
                               "own position_ids and document_ids (the stages have used them)")
        self.called = True
        return head(self.hidden, self.weight) if head is not None else F.linear(self.hidden, self.weight)


def _meta(mb: Any, name: str) -> Tensor | None:
    return getattr(mb, name, None)


def _positions(mb: Any) -> Tensor:
    """The microbatch's positions, made explicit when it has none (0..T-1): a later stage's input may be
    a slice of the sequence (sequence parallelism), which cannot tell it how long the sequence is."""
    positions = _meta(mb, "position_ids")
    if positions is None:
        positions = torch.arange(mb.input_ids.shape[1], device=mb.input_ids.device).unsqueeze(0)
    return positions


class _ObjectiveHead:
    """The last stage's ``head`` for microbatch ``index``: runs the objective and keeps its statistics."""

    def __init__(self, loss_fn: LossFn, mb: Any, index: int, scale: Tensor | None, sink: dict[int, LossStats]) -> None:
        self.loss_fn, self.mb, self.index, self.scale, self.sink = loss_fn, mb, index, scale, sink

    def __call__(self, hidden: Tensor, weight: Tensor) -> Tensor:
        objective, stats = self.loss_fn(_FinalHidden(self.mb, hidden, weight), self.mb)
        self.sink[self.index] = stats  # the shape-inference forward's are overwritten by the real one
        if self.scale is None:  # forward only
            return objective.detach().float().reshape(())
        return objective * self.scale


def _run(pipeline: Pipeline, train: bool, microbatches: list[Any], loss_fn: LossFn, scale: Tensor | None,
         autocast: Any) -> LossStats:
    sink: dict[int, LossStats] = {}
    kwargs = [{"position_ids": _positions(mb), "document_ids": _meta(mb, "document_ids"),
               "head": _ObjectiveHead(loss_fn, mb, i, scale, sink)} for i, mb in enumerate(microbatches)]
    pipeline.run(train, microbatches, kwargs, autocast)
    totals = None
    if pipeline.has_last_stage:
        for i in range(len(microbatches)):
            totals = accumulate(totals, sink[i])
    return _shared_structure(pipeline, totals, train)


def _shared_structure(pipeline: Pipeline, totals: LossStats | None, train: bool) -> LossStats:
    """The last stage's ``totals`` on every rank of the pipeline (its structure, then its values, sent
    from the last stage over the pipeline group), so that the loss and counts are summed over the data
    group like any other step's, and rank 0 (a first-stage rank) logs them. An objective's statistics
    keep one structure, so it is sent once (per train and eval) and the values in one tensor after."""
    import torch.distributed as dist

    cache = pipeline.__dict__.setdefault("stats_structure", {})
    if train not in cache:
        spec = None
        if totals is not None:
            spec = [(t.shape, t.dtype) for t in (totals.loss_sum, totals.loss_weight, totals.target_tokens)]
            spec.append({k: (v.shape, v.dtype) for k, v in sorted(totals.sums.items())})
        box = [spec]
        dist.broadcast_object_list(box, src=pipeline.last_stage_rank, group=pipeline.group, device=pipeline.device)
        cache[train] = box[0]
    *heads, sums = cache[train]
    shapes = [*heads, *sums.values()]
    if totals is not None:
        parts = [totals.loss_sum, totals.loss_weight, totals.target_tokens, *(totals.sums[k] for k in sums)]
        flat = torch.cat([t.detach().double().reshape(-1) for t in parts])
    else:
        flat = torch.zeros(sum(torch.Size(s).numel() for s, _ in shapes), dtype=torch.float64, device=pipeline.device)
    dist.broadcast(flat, src=pipeline.last_stage_rank, group=pipeline.group)
    values = [t.reshape(s).to(d) for t, (s, d) in zip(flat.split([torch.Size(s).numel() for s, _ in shapes]), shapes)]
    return LossStats(*values[:3], dict(zip(sums, values[3:])))


def pipeline_gradient_computation(pipeline: Pipeline, microbatches: list[Any], loss_fn: LossFn, normalizer: Tensor,
                                  autocast: torch.autocast | None, scale_world: float) -> LossStats:
    """Accumulate gradients of ``scale_world * sum(objective) / normalizer`` over one schedule step.

    As in ``gradient_computation``, ``normalizer`` is the step's global count and ``scale_world``
    undoes the data-parallel wrapper's mean: the number of data-parallel ranks when ``normalizer``
    counts each data-parallel rank's tokens once; the world size (dp x pp) when it is the plain
    all-reduce over every rank (``objective.normalizer``), which counts them once per pp rank.
    FSDP2 stages reduce their gradients over their data-parallel mesh after the last microbatch (the
    schedule's reduce step). Returns the summed statistics: real on the last stage's rank, zeros of the
    same values on the pipeline's other ranks.
    """
    scale = scale_world / normalizer.clamp(min=1)
    return _run(pipeline, True, microbatches, loss_fn, scale, autocast)


def pipeline_eval_forward(pipeline: Pipeline, batches: list[Any], loss_fn: LossFn,
                          autocast: torch.autocast | None = None) -> LossStats:
    """The summed statistics of ``loss_fn`` over ``batches`` (forward only, no grad): the pipeline's
    microbatches are the batches, one schedule step per run of batches of one shape. On every rank of the
    pipeline, as :func:`pipeline_gradient_computation`. Every rank of the pipeline
    passes the same batches."""
    was_training = [p.training for p in pipeline.parts]
    for part in pipeline.parts:
        part.eval()
    totals: LossStats | None = None
    try:
        with torch.no_grad():
            start = 0
            while start < len(batches):
                end = start + 1
                while end < len(batches) and batches[end].input_ids.shape == batches[start].input_ids.shape:
                    end += 1
                totals = accumulate(totals, _run(pipeline, False, batches[start:end], loss_fn, None, autocast))
                start = end
    finally:
        for part, mode in zip(pipeline.parts, was_training):
            part.train(mode)
    if totals is None:
        raise ValueError("pipeline_eval_forward: no batches")
    return totals


def pipeline_clip_grad_norm_(pipeline: Pipeline, max_norm: float) -> Tensor:
    """Clip the gradients of this rank's stages to a total norm over the whole model (every stage of the
    pipeline; FSDP2's sharded gradients are first reduced over their mesh) and return that norm: the
    pipeline's version of ``clip_grad_norm_`` in ``run_optimizer_step``. ``max_norm`` <= 0: only measure."""
    import torch.distributed as dist

    grads = [p.grad for part in pipeline.parts for p in part.parameters() if p.grad is not None]
    local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=pipeline.device)
    if hasattr(local, "full_tensor"):
        local = local.full_tensor()
    square = local.float().pow(2)
    dist.all_reduce(square, group=pipeline.group)
    norm = square.sqrt()
    if max_norm > 0 and grads:
        torch.nn.utils.clip_grads_with_norm_([p for part in pipeline.parts for p in part.parameters()
                                              if p.grad is not None], max_norm, norm)
    return norm
