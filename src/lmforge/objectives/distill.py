"""Knowledge distillation: a divergence between a frozen teacher's and the student's next-token
distributions at every target token, plus optionally the student's ordinary cross-entropy.

The divergences and their gradients are :mod:`lmforge.losses.chunked_divergence`. The teacher's
final hidden states at the target positions come from its own forward pass without grad, inside the
loss (its time is step time; the step source adds its FLOPs); the student's forward then runs the
divergence as its output head, so at most ``chunk_tokens`` rows of full-vocabulary logits of each
model exist at once, in forward and backward.

Normalization: the loss is a sum over target tokens divided by the target tokens of the whole step
(all microbatches, all ranks), as for cross-entropy. Which tokens are targets is the batch's business:
the SFT loss mask on data batches, the sampled completion on on-policy batches (whose labels are the
student's own samples, so they get no cross-entropy term: see :class:`SampledBatch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lmforge.distributed import EVERY_RANK, ReduceGroup
from lmforge.data.packing import IGNORE_INDEX, Batch
from lmforge.losses.chunked_divergence import DivergenceSums, Divergence, chunked_divergence
from lmforge.losses.chunked_loss import DEFAULT_CHUNK_TOKENS
from lmforge.objectives.reference import FrozenReference
from lmforge.losses.stats import LossStats
from lmforge.training.train_step import global_target_count


@dataclass
class SampledBatch(Batch):
    """A batch whose targets the student sampled itself (on-policy distillation): the divergence
    applies to them, the cross-entropy does not (it would reward the student for its own samples)."""


@dataclass(frozen=True)
class DistillSettings:
    divergence: Divergence = "forward_kl"
    jsd_beta: float = 0.5
    temperature: float = 1.0
    ce_weight: float = 0.0
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS


class TeacherRows:
    """The teacher's output head: its final hidden states at the ``mask`` positions and its output
    weight, for the student's head to project chunk by chunk."""

    def __init__(self, mask: Tensor) -> None:
        self.mask = mask

    def __call__(self, hidden: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
        positions = self.mask.flatten().nonzero().squeeze(1)
        return hidden.flatten(0, -2).index_select(0, positions), weight


class DivergenceHead:
    """The student's output head: the chunked divergence against the teacher's rows at ``mask``."""

    def __init__(self, teacher_rows: Tensor, teacher_weight: Tensor, labels: Tensor, mask: Tensor,
                 settings: DistillSettings) -> None:
        self.teacher_rows, self.teacher_weight, self.labels, self.mask = teacher_rows, teacher_weight, labels, mask
        self.s = settings

    def __call__(self, hidden: Tensor, weight: Tensor) -> DivergenceSums:
        positions = self.mask.flatten().nonzero().squeeze(1)
        rows = hidden.flatten(0, -2).index_select(0, positions)
        labels = self.labels.flatten().index_select(0, positions)
        s = self.s
        return chunked_divergence(rows, weight, self.teacher_rows, self.teacher_weight, labels, kind=s.divergence,
                                  beta=s.jsd_beta, temperature=s.temperature, ce_weight=s.ce_weight,
                                  chunk_tokens=s.chunk_tokens)


def _call(model: Any, batch: Batch, head: Any) -> Any:
    return model(batch.input_ids, position_ids=batch.position_ids, document_ids=batch.document_ids, head=head)


class DistillLoss:
    """``(student, batch) -> (summed objective, summed statistics)`` for ``gradient_computation``."""

    def __init__(self, teacher: FrozenReference, settings: DistillSettings) -> None:
        self.teacher, self.settings = teacher, settings

    def __call__(self, model: nn.Module, batch: Batch) -> tuple[Tensor, LossStats]:
        mask = batch.labels != IGNORE_INDEX
        with torch.no_grad():
            teacher_rows, teacher_weight = _call(self.teacher.model_for(model), batch, TeacherRows(mask))
        sampled = isinstance(batch, SampledBatch)
        s = self.settings
        if sampled and s.ce_weight:
            s = DistillSettings(s.divergence, s.jsd_beta, s.temperature, 0.0, s.chunk_tokens)
        labels = torch.full_like(batch.labels, IGNORE_INDEX) if sampled else batch.labels
        out = _call(model, batch, DivergenceHead(teacher_rows, teacher_weight, labels, mask, s))
        targets = mask.sum()
        ce_tokens = targets.new_zeros(()) if sampled else targets
        stats = LossStats(out.objective.detach(), targets, targets,
                          {"divergence_sum": out.divergence, "ce_sum": out.ce, "ce_tokens": ce_tokens,
                           "agree": out.agree})
        return out.objective, stats


class DistillObjective:
    """The distillation loss over the step's target tokens (all microbatches and ranks), and its
    logged means: ``divergence`` per target token, ``ce`` (the student's cross-entropy per labelled
    target token), ``agreement`` (share of targets where the student's argmax is the teacher's)."""

    watch_spikes = False
    # the divergence heads for 0, where a ratio to its running mean flags ordinary noise; and steps on
    # the student's samples leave out the cross-entropy that data steps add

    def __init__(self, teacher: FrozenReference, settings: DistillSettings) -> None:
        self.loss_fn = DistillLoss(teacher, settings)
        self.console_keys = ("divergence", "ce", "distill/on_policy")

    def normalizer(self, microbatches: list[Batch], reduce: ReduceGroup = EVERY_RANK) -> Tensor:
        return global_target_count(microbatches, reduce)

    def log_values(self, totals: dict[str, Tensor]) -> dict[str, Tensor]:
        targets = totals["total_weights"].clamp(min=1)
        return {"loss": totals["loss"], "total_weights": totals["total_weights"],
                "divergence": totals["divergence_sum"] / targets,
                "ce": totals["ce_sum"] / totals["ce_tokens"].clamp(min=1),
                "agreement": totals["agree"] / targets}
