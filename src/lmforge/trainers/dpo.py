"""Direct preference optimization: raise the policy's log-ratio to a frozen reference on the chosen
response over the rejected one, from ``prompt``/``chosen``/``rejected`` records.

DPO runs the shared loop (:func:`lmforge.training.loop.train`) like every trainer. Its step source is
SFT's packed loader over rows of whole pairs (:mod:`lmforge.data.preference_data`); its objective,
here, is the DPO loss summed over a microbatch's pairs and divided by the pairs of the whole step.

Notation per pair: ``pc``/``pr`` the policy's log-probs of the chosen/rejected response (sums over
the response's tokens), ``rc``/``rr`` the reference's, ``z = (pc - rc) - (pr - rr)``. Losses:

* ``sigmoid``: ``-(1 - ls) * log sigmoid(beta * z) - ls * log sigmoid(-beta * z)``, where
  ``ls = label_smoothing`` > 0 is conservative DPO (a share ``ls`` of the labels is assumed flipped);
* ``ipo``: ``(z - 1 / (2 * beta))^2``, which stops pushing once the margin reaches ``1 / (2 beta)``.

``nll_weight`` > 0 adds that weight times the chosen response's negative log-likelihood per token
(RPO). Pure DPO only asks the chosen response to gain on the rejected one *relative to the
reference*; on pairs that differ in a token or two both can lose probability, the chosen one too
(the DPO demo measures exactly that), and the NLL term anchors the chosen response.

The reference is the run's starting model, frozen: a second copy loaded from the same source, or,
when the model carries LoRA adapters, the same model with its adapters switched off (no copy). Its
log-probs are computed inside the step, in the loss function, without grad: their time is step
time and their FLOPs (one more forward pass) count in the step's FLOPs.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import Tensor, nn

from lmforge import distributed as dist_utils
from lmforge.config import Config, RunSection, Section, StartEvalSection, TasksSection
from lmforge.data.packing import IGNORE_INDEX, Batch
from lmforge.data.preference_data import (PreferenceDataset, build_preference_dataset, pairs_in,
                                          read_preference_records, sequence_index)
from lmforge.errors import UserError
from lmforge.evaluation.downstream import with_downstream
from lmforge.evaluation.loss import evaluate_loss, validation_batches
from lmforge.evaluation.tasks import TaskEval, held_out_examples, record_task_summary
from lmforge.models.load import ModelSource, load_model
from lmforge.models.flops import training_flops
from lmforge.models.lora import BaseModelView, has_adapters
from lmforge.trainers.sft import chat_format
from lmforge.training.chunked_loss import DEFAULT_CHUNK_TOKENS, TargetLogprobHead
from lmforge.training.loop import EvalFn, StepBatch, train
from lmforge.training.next_token import LoaderSource
from lmforge.training.runtime import Runtime, build_runtime

LossType = Literal["sigmoid", "ipo"]


class DPOSection(Section):
    beta: float = Field(0.1, gt=0)
    """Strength of the pull towards the reference (the reward scale: reward = beta * log-ratio)."""
    loss_type: LossType = "sigmoid"
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """cDPO: the assumed share of flipped preference labels (sigmoid loss only)."""
    nll_weight: float = Field(0.0, ge=0)
    """Weight of the chosen response's per-token negative log-likelihood added to each pair's loss (RPO)."""
    packing: bool = True
    """Pack several pairs per row (isolated by document masks); false: one pair per row."""
    chat_template: str | None = None
    """A jinja file to use instead of the tokenizer's own chat template."""
    task_eval: bool = False
    """Also score held-out exact match on the embedded tasks at every eval (for pairs built from them)."""

    @model_validator(mode="after")
    def _smoothing_needs_sigmoid(self) -> "DPOSection":
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError(f"label_smoothing applies to the sigmoid loss only (loss_type={self.loss_type})")
        return self


class DPOConfig(Config):
    dpo: DPOSection = DPOSection()
    tasks: TasksSection = TasksSection()
    eval: StartEvalSection = StartEvalSection()
    run: RunSection = RunSection(dir="runs/dpo")


# ---------------------------------------------------------------------------------------- loss
def dpo_losses(z: Tensor, *, beta: float, loss_type: LossType, label_smoothing: float = 0.0) -> Tensor:
    """Per-pair loss from ``z = (pc - rc) - (pr - rr)`` (see the module docstring)."""
    if loss_type == "sigmoid":
        return -(1 - label_smoothing) * F.logsigmoid(beta * z) - label_smoothing * F.logsigmoid(-beta * z)
    if loss_type == "ipo":
        return (z - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown DPO loss type {loss_type!r}")


def sequence_logprobs(model: nn.Module, batch: Batch, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                      with_lengths: bool = False) -> Any:
    """Summed log-probs of every sequence's response tokens, ``[2 * pairs]`` (chosen, rejected
    alternating): per-token log-probs at target positions only (chunked output layer), then a
    segment sum by sequence. Differentiable when called with grad enabled. ``with_lengths``: also
    each sequence's number of response tokens."""
    mask = batch.labels != IGNORE_INDEX
    head = TargetLogprobHead(batch.labels, mask, chunk_tokens=chunk_tokens)
    out = model(batch.input_ids, position_ids=batch.position_ids, document_ids=batch.document_ids, head=head)
    index = sequence_index(batch, out.positions)
    sums = out.logprobs.new_zeros(2 * pairs_in(batch)).index_add(0, index, out.logprobs)
    if not with_lengths:
        return sums
    return sums, torch.zeros_like(sums).index_add_(0, index, torch.ones_like(out.logprobs))


class Reference:
    """The frozen starting model: ``frozen`` if given, else the policy itself with its LoRA adapters off."""

    def __init__(self, frozen: nn.Module | None, source: ModelSource | None = None) -> None:
        self.frozen, self.source = frozen, source

    @torch.no_grad()
    def sequence_logprobs(self, policy: nn.Module, batch: Batch, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Tensor:
        return sequence_logprobs(self.frozen if self.frozen is not None else BaseModelView(policy), batch, chunk_tokens)


def load_reference(rt: Runtime, source: ModelSource) -> Reference:
    """A model with adapters needs no copy; any other gets its starting weights loaded afresh."""
    if has_adapters(rt.raw_model):
        return Reference(None, source)
    ref = load_model(source, args=rt.model_args, tokenizer=rt.model_description["tokenizer"]).model
    return Reference(ref.to(rt.dist.device).eval().requires_grad_(False), source)


class DPOLoss:
    """``(model, rows of pairs) -> (summed DPO loss, summed statistics)`` for ``gradient_computation``."""

    def __init__(self, reference: Reference, *, beta: float, loss_type: LossType, label_smoothing: float = 0.0,
                 nll_weight: float = 0.0, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        self.reference, self.beta, self.loss_type = reference, beta, loss_type
        self.label_smoothing, self.nll_weight, self.chunk_tokens = label_smoothing, nll_weight, chunk_tokens

    def __call__(self, model: nn.Module, batch: Batch) -> tuple[Tensor, dict[str, Tensor]]:
        ref = self.reference.sequence_logprobs(model, batch, self.chunk_tokens)
        logps, lengths = sequence_logprobs(model, batch, self.chunk_tokens, with_lengths=True)
        pc, pr, rc, rr = logps[0::2], logps[1::2], ref[0::2], ref[1::2]
        losses = dpo_losses((pc - rc) - (pr - rr), beta=self.beta, loss_type=self.loss_type,
                            label_smoothing=self.label_smoothing)
        nll = -pc / lengths[0::2]  # per token of each chosen response
        objective = losses.sum() + self.nll_weight * nll.sum() if self.nll_weight else losses.sum()
        with torch.no_grad():
            chosen, rejected = self.beta * (pc - rc), self.beta * (pr - rr)
            stats = {
                "loss_sum": objective.detach(),
                "total_weights": losses.new_tensor(float(len(losses))),  # pairs: the loss is a mean over pairs
                "target_tokens": (batch.labels != IGNORE_INDEX).sum(),
                "chosen_reward_sum": chosen.sum(), "rejected_reward_sum": rejected.sum(),
                "ordered_count": (chosen > rejected).sum(),
                "chosen_logp_sum": pc.detach().sum(), "rejected_logp_sum": pr.detach().sum(),
                "chosen_nll_sum": nll.detach().sum(), "dpo_loss_sum": losses.detach().sum(),
            }
        return objective, stats


class DPOObjective:
    """The DPO loss, the step's pair count over all microbatches and ranks as its normalizer, and the
    logged means over pairs (exact under accumulation and ranks: sums over the global pair count)."""

    console_keys = ("rewards/accuracies", "rewards/margins")
    watch_spikes = False  # the loss heads for 0, where a ratio to its running mean flags ordinary noise

    def __init__(self, reference: Reference, *, beta: float, loss_type: LossType, label_smoothing: float = 0.0,
                 nll_weight: float = 0.0, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        self.loss_fn = DPOLoss(reference, beta=beta, loss_type=loss_type, label_smoothing=label_smoothing,
                               nll_weight=nll_weight, chunk_tokens=chunk_tokens)

    def normalizer(self, microbatches: list[Batch]) -> Tensor:
        local = torch.tensor(float(sum(pairs_in(mb) for mb in microbatches)), device=microbatches[0].input_ids.device)
        return dist_utils.all_reduce_sum(local)

    def log_values(self, totals: dict[str, Tensor]) -> dict[str, Tensor]:
        """``totals`` from ``compute_global_loss``: ``loss`` is already the objective summed over the
        pairs, divided by their number (the DPO loss, plus ``nll_weight`` x ``nll/chosen`` if set)."""
        pairs = totals["total_weights"].clamp(min=1)
        chosen, rejected = totals["chosen_reward_sum"] / pairs, totals["rejected_reward_sum"] / pairs
        return {"loss": totals["loss"], "total_weights": totals["target_tokens"], "pairs": totals["total_weights"],
                "rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/margins": chosen - rejected,
                "rewards/accuracies": totals["ordered_count"] / pairs,
                "logps/chosen": totals["chosen_logp_sum"] / pairs, "logps/rejected": totals["rejected_logp_sum"] / pairs,
                "nll/chosen": totals["chosen_nll_sum"] / pairs, "loss/dpo": totals["dpo_loss_sum"] / pairs}


# ---------------------------------------------------------------------------------------- data
class PreferenceSource(LoaderSource):
    """SFT's packed loader over rows of pairs; the step's FLOPs include the reference's forward pass,
    and checkpoints record the reference's source, so a resume scores against the same reference."""

    def __init__(self, rt: Runtime, dataset: PreferenceDataset, reference: Reference) -> None:
        super().__init__(rt, dataset)
        self.rt, self.reference = rt, reference

    def next_step(self, step: int) -> StepBatch:
        batch = super().next_step(step)
        # plus the reference's forward pass: a third of full training FLOPs (2 of 6 per parameter and
        # token, 4 of 12 for attention), whatever the policy's backward costs (LoRA's is cheaper)
        lengths = [n for mb in batch.microbatches for n in mb.real_document_lengths()]
        batch.flops += training_flops(self.rt.model_args, lengths) / 3
        return batch

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {"reference": str(self.reference.source)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        saved = ModelSource.parse(state.get("reference", str(self.reference.source)))
        if saved != self.reference.source and self.reference.frozen is not None:
            self.reference.frozen = load_reference(self.rt, saved).frozen
            self.reference.source = saved
            self.rt.metrics.record_event("reference", 0, f"reference model: {saved} (recorded in the checkpoint)")


def build_datasets(cfg: DPOConfig, rt: Runtime) -> tuple[PreferenceDataset, PreferenceDataset | None]:
    d = cfg.data
    if d.train == "embedded":
        raise UserError("data.train: DPO trains on preference records (.jsonl/.parquet with prompt, chosen, "
                        "rejected); examples/dpo_demo.py builds them from the embedded tasks")
    chat = chat_format(rt, cfg.dpo.chat_template)
    sets: list[PreferenceDataset | None] = []
    for spec, split in ((d.train, "train"), (d.validation, "validation")):
        if split == "validation" and spec in ("", "none", "embedded"):
            sets.append(None)
            continue
        dataset, summary = build_preference_dataset(read_preference_records(spec), spec, rt.tokenizer, chat,
                                                    seq_len=d.seq_len, packing=cfg.dpo.packing)
        rt.metrics.record_event("dpo_data", 0, summary.line(), split=split, **summary.counts())
        sets.append(dataset)
    return sets[0], sets[1]  # type: ignore[return-value]


def make_eval(cfg: DPOConfig, val_set: PreferenceDataset | None, objective: DPOObjective,
              tasks: TaskEval) -> EvalFn | None:
    """The DPO metrics on the validation pairs (eval loss: the mean DPO loss), plus held-out exact match."""
    if val_set is None and not tasks:
        return None

    def evaluate(rt: Runtime, step: int) -> dict:
        values: dict = {}
        if val_set is not None:
            batches = validation_batches(rt, val_set)
            values.update(objective.log_values(evaluate_loss(rt, batches, objective.loss_fn)))
        return values | tasks(rt, step)

    return evaluate


def run(cfg: DPOConfig) -> Runtime:
    rt = build_runtime(cfg, "dpo")
    source = None
    try:
        train_set, val_set = build_datasets(cfg, rt)
        dpo = cfg.dpo
        reference = load_reference(rt, rt.model_source)
        objective = DPOObjective(reference, beta=dpo.beta, loss_type=dpo.loss_type,
                                 label_smoothing=dpo.label_smoothing, nll_weight=dpo.nll_weight,
                                 chunk_tokens=cfg.training.loss_chunk_tokens)
        source = PreferenceSource(rt, train_set, reference)
        tasks = TaskEval(held_out_examples(cfg.tasks) if dpo.task_eval else [], cfg.tasks.eval_max_new_tokens)
        state = train(rt, source, objective, with_downstream(make_eval(cfg, val_set, objective, tasks), cfg))
        record_task_summary(rt, state.step)
    finally:
        if source is not None:
            source.close()
        rt.metrics.close()
    return rt


