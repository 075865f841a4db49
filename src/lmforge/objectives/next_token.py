"""Next-token cross-entropy: the objective of pretraining and SFT."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from lmforge.distributed import EVERY_RANK, ReduceGroup
from lmforge.models.args import ModelArgs

from lmforge.data.packing import IGNORE_INDEX, Batch
from lmforge.objectives.router import RouterLossWeights, add_router_terms, router_log_values
from lmforge.losses.chunked_loss import DEFAULT_CHUNK_TOKENS, TargetLogprobSumHead
from lmforge.losses.stats import LossStats
from lmforge.training.train_step import global_target_count

if TYPE_CHECKING:  # pragma: no cover
    from lmforge.config import TrainingSection


def cross_entropy_loss(model: nn.Module, batch: Batch, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                       router: RouterLossWeights | None = None) -> tuple[torch.Tensor, LossStats]:
    """Summed next-token cross-entropy over target tokens (labels != IGNORE_INDEX).

    Statistics: the loss sum, the target tokens (both the loss's weight and ``target_tokens``) and
    ``correct`` (argmax hits), all sums, so they add up exactly across microbatches and ranks.

    Logits exist only at target positions and only ``chunk_tokens`` rows at a time (fp32), in
    forward and backward (see :mod:`lmforge.losses.chunked_loss`); the values equal the full
    ``F.cross_entropy`` over fp32 logits. Bind ``chunk_tokens`` with ``functools.partial``.

    For a mixture of experts, ``router`` adds the load-balancing terms, over the batch's real
    (non-padding) tokens, to the loss that is differentiated (not to the logged loss; see
    :mod:`lmforge.objectives.router`).

    A batch with images (``pixel_values``, Qwen's ``image_grid_thw``) hands them to the model, whose tower
    puts their features at the image tokens.
    """
    mask = batch.labels != IGNORE_INDEX
    head = TargetLogprobSumHead(batch.labels, mask, chunk_tokens=chunk_tokens)
    images = batch.image_inputs()
    # with Qwen's grids the model numbers the tokens itself (multimodal positions, per document)
    positions = None if "image_grid_thw" in images else batch.position_ids
    logprob_sum, hits = model(batch.input_ids, position_ids=positions, document_ids=batch.document_ids,
                              head=head, **images)
    loss_sum = -logprob_sum
    targets = mask.sum()
    stats = LossStats(loss_sum.detach(), targets, targets, {"correct": hits.sum()})
    real = batch.real_token_mask() if router is not None else None
    return add_router_terms(loss_sum, stats, model, router, real), stats


class NextTokenObjective:
    """Summed cross-entropy over target tokens, divided by the target tokens of the whole step (all
    microbatches, all ranks): accumulation and ranks give the same gradient as one big batch."""

    console_keys = ("accuracy",)
    watch_spikes = True

    def __init__(self, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, router: RouterLossWeights | None = None) -> None:
        self.loss_fn = functools.partial(cross_entropy_loss, chunk_tokens=chunk_tokens, router=router)

    def normalizer(self, microbatches: list[Batch], reduce: ReduceGroup = EVERY_RANK) -> torch.Tensor:
        return global_target_count(microbatches, reduce)

    def log_values(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``loss``, ``total_weights`` (target tokens), ``accuracy`` (argmax hits per target) and, for a
        mixture of experts, the router statistics."""
        return {"loss": totals["loss"], "total_weights": totals["total_weights"],
                "accuracy": totals["correct"] / totals["total_weights"].clamp(min=1), **router_log_values(totals)}

    @classmethod
    def for_run(cls, training: "TrainingSection", args: ModelArgs) -> "NextTokenObjective":
        """The objective of a run: its loss chunking and, for an MoE model, its router loss weights."""
        return cls(training.loss_chunk_tokens,
                   RouterLossWeights.for_run(training.router_aux_loss_coef, training.router_z_loss_coef, args))
