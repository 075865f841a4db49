"""Knowledge distillation from a frozen teacher into the run's model (the student), on SFT records.

Off-policy (logit) distillation trains on the same records, chat rendering and loss masks as SFT
(:mod:`lmforge.data.sft_inputs`; the ``[sft]`` keys apply): at every target token the student's
next-token distribution is pulled towards the teacher's by the divergence of ``distill.divergence``
(:mod:`lmforge.objectives.distill`). On-policy distillation (GKD): on a share ``distill.on_policy`` of
the steps, chosen by a pure function of the seed and the step, the student first samples completions
of the batch's prompts and the divergence is taken on its own tokens. That sampling is the step
source's business (:class:`DistillSource`), so the loss is the same code either way.

The teacher is anything lmforge loads as a model (a Hugging Face directory, a ``.gguf`` file, an
lmforge run or checkpoint), frozen on the trainer's device; it must share the student's vocabulary.
Each step's FLOPs include the teacher's forward pass; checkpoints record the teacher's source.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from lmforge import distributed as dist_utils
from lmforge.config import Config, RunSection, Section, StartEvalSection, TasksSection
from lmforge.data.chat import stop_token_ids, training_chat_format
from lmforge.data.inputs import train_spec
from lmforge.data.sft_data import SFTDataset
from lmforge.data.sft_inputs import SFTSection, sft_datasets
from lmforge.errors import UserError
from lmforge.evaluation.loss import validation_eval
from lmforge.evaluation.tasks import TaskEval, held_out_examples
from lmforge.models.load import ModelSource, checkpoint_description, load_model
from lmforge.models.spec import spec_for_args
from lmforge.models.tokenizer import Tokenizer
from lmforge.objectives.distill import DistillObjective, DistillSettings
from lmforge.recipes.base import Recipe, register
from lmforge.training.loop import Job, StepBatch
from lmforge.recipes.jobs.next_token import LoaderSource
from lmforge.recipes.jobs.on_policy import sample_on_policy
from lmforge.objectives.reference import FrozenReference
from lmforge.runtime import Runtime


class DistillSection(Section):
    teacher: str = ""
    """The teacher model: a Hugging Face directory, a ``.gguf`` file (tokenizer: ``model.tokenizer``), or
    an lmforge run or checkpoint directory. Same vocabulary as the student."""
    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    """``forward_kl`` KL(teacher || student), ``reverse_kl`` KL(student || teacher), ``jsd`` generalized JSD."""
    jsd_beta: float = Field(0.5, ge=0, le=1)
    """JSD's mixture weight of the teacher; 0 and 1 mean forward and reverse KL (docs/distill.md)."""
    temperature: float = Field(1.0, gt=0)
    """Both models' logits are divided by it before the divergence (the loss is not scaled by T^2)."""
    ce_weight: float = Field(0.0, ge=0)
    """Weight of the student's cross-entropy on the data's labels, added to the divergence."""
    on_policy: float = Field(0.0, ge=0, le=1)
    """Share (probability per step) of steps on the student's own completions of the batch's prompts."""
    max_new_tokens: int = Field(64, gt=0)
    """Longest on-policy completion."""
    sampling_temperature: float = Field(1.0, ge=0)
    """Temperature of on-policy sampling (0: greedy)."""


class DistillConfig(Config):
    distill: DistillSection = DistillSection()
    sft: SFTSection = SFTSection()
    tasks: TasksSection = TasksSection()
    eval: StartEvalSection = StartEvalSection()
    run: RunSection = RunSection(dir="runs/distill")


def check_same_vocabulary(teacher: Any, rt: Runtime, where: str) -> None:
    """One line unless teacher and student share their vocabulary: the divergence compares the two
    distributions token id by token id."""
    a, b = rt.model.tokenizer, teacher.tokenizer
    probe = "Distillation compares 12 + 30 = 42 token by token: ÄÖü, 東京, <tags>."
    if teacher.args.vocab_size != rt.model.args.vocab_size or not _same_tokenizer(a, b, probe):
        raise UserError(f"{where}: the teacher's vocabulary (vocab_size {teacher.args.vocab_size}, tokenizer "
                        f"{teacher.tokenizer_spec}) differs from the student's (vocab_size {rt.model.args.vocab_size}, "
                        f"tokenizer {rt.model.description['tokenizer']}); distillation needs the same tokenizer")


def _same_tokenizer(a: Tokenizer, b: Tokenizer, probe: str) -> bool:
    return (a.vocab_size, a.eos_id, a.pad_id, a.encode(probe)) == (b.vocab_size, b.eos_id, b.pad_id, b.encode(probe))


def scoring_head(source: ModelSource) -> str | None:
    """The head a checkpoint or Hugging Face directory scores sequences with instead of predicting tokens
    (a reward model's ``score``; ``*ForSequenceClassification``), read from its description alone."""
    if source.kind == "checkpoint":
        return checkpoint_description(Path(source.where)).get("head") or None
    if source.kind == "hf":
        config = Path(source.where) / "config.json"
        try:
            architectures = json.loads(config.read_text()).get("architectures") or []
        except (OSError, ValueError, AttributeError):
            return None  # loading the teacher says what is wrong with it
        if any(str(a).endswith("ForSequenceClassification") for a in architectures):
            return "score"
    return None


def load_teacher(rt: Runtime, path: str) -> FrozenReference:
    """The teacher, frozen on the trainer's device, with its source recorded in checkpoints (a resumed
    run distills from the teacher it started with)."""
    def load(source: ModelSource) -> torch.nn.Module:
        loaded = load_model(source, tokenizer=rt.model.description["tokenizer"])
        if getattr(loaded.model, "score", None) is not None:  # also a teacher swapped for one since check
            raise UserError(f"distill.teacher={path}: a reward model (a score head), not a language model")
        check_same_vocabulary(loaded, rt, f"distill.teacher={path}")
        if rt.cfg.data.seq_len > loaded.args.max_seq_len:
            raise UserError(f"distill.teacher={path}: data.seq_len={rt.cfg.data.seq_len} is longer than the teacher "
                            f"allows (max_seq_len={loaded.args.max_seq_len})")
        return loaded.model.to(rt.world.dist.device).eval().requires_grad_(False)

    source = ModelSource.at(path)
    return FrozenReference(load(source), source, load, lambda line: rt.metrics.record_event("teacher", 0, line))


class DistillSource(LoaderSource):
    """SFT's packed loader; on on-policy steps its batches' prompts completed by the student. Adds the
    teacher's forward pass to each step's FLOPs and the teacher's source to each checkpoint."""

    def __init__(self, rt: Runtime, dataset: SFTDataset, teacher: FrozenReference, d: DistillSection,
                 stop_ids: list[int]) -> None:
        super().__init__(rt, dataset)
        self.rt, self.teacher, self.d, self.stop_ids = rt, teacher, d, stop_ids
        self.seed = rt.cfg.training.seed
        self._decided = (0, 0)  # (steps decided, of which on-policy): the running share, a pure function of the step

    def on_policy(self, step: int) -> bool:
        """Whether ``step`` trains on the student's own samples: a pure function of the seed and step."""
        lam = self.d.on_policy
        return lam > 0 and float(np.random.default_rng([self.seed, step, 0xD157]).random()) < lam

    def on_policy_share(self, step: int) -> float:
        done, count = self._decided if self._decided[0] <= step else (0, 0)
        for s in range(done + 1, step + 1):
            count += self.on_policy(s)
        self._decided = (step, count)
        return count / step

    def next_step(self, step: int) -> StepBatch:
        batch = super().next_step(step)
        metrics: dict[str, Any] = {"distill/on_policy": self.on_policy_share(step)}
        if self.on_policy(step):
            with self.rt.metrics.timed("rollout"):
                batch, metrics["completion/mean_length"] = self.sample(batch, step)
        lengths = [n for mb in batch.microbatches for n in mb.real_document_lengths()]
        # plus the teacher's forward pass: a third of its training FLOPs (2 of 6 per parameter and token)
        args = self.teacher.frozen.args
        batch.flops += spec_for_args(args).training_flops(args, lengths) / 3
        batch.metrics = metrics
        return batch

    def sample(self, batch: StepBatch, step: int) -> tuple[StepBatch, float]:
        """The step's microbatches replaced by the student's completions of their prompts. Each call's
        generator is seeded by the seed, the step and the microbatch's global index (rank-major)."""
        rt, micro = self.rt, batch.microbatches
        sampled, lengths = [], []
        with dist_utils.full_parameters(rt.model.raw) as policy:
            for j, mb in enumerate(micro):
                index = (step * rt.world.dist.batch_shares + rt.world.dist.batch_share) * len(micro) + j
                gen = torch.Generator(device=rt.world.dist.device).manual_seed(self.seed * 1_000_003 + 7919 * index + 1)
                sb, n = sample_on_policy(policy, mb, max_new_tokens=self.d.max_new_tokens,
                                         temperature=self.d.sampling_temperature, stop_ids=self.stop_ids,
                                         pad_id=rt.model.tokenizer.pad_id, generator=gen,
                                         teacher_max_len=self.teacher.frozen.args.max_seq_len,
                                         lockstep=rt.world.dist.world_size > 1, autocast=rt.model.autocast())
                sampled.append(sb)
                lengths += n
        totals = dist_utils.all_reduce_sum(torch.tensor([float(sum(lengths)), float(len(lengths))],
                                                        dtype=torch.float64, device=rt.world.dist.device)).tolist()
        student = rt.model.training_flops([n for mb in sampled for n in mb.real_document_lengths()])
        return (StepBatch(sampled, tokens=sum(mb.input_ids.numel() for mb in sampled), flops=student),
                totals[0] / max(totals[1], 1.0))

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | self.teacher.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.teacher.load_state_dict(state)


@register
class Distill(Recipe):
    name = "distill"
    config = DistillConfig
    summary = "knowledge distillation from a frozen teacher (forward/reverse KL, JSD; on-policy GKD) on SFT data"

    def check(self, cfg: DistillConfig) -> ModelSource:
        if not cfg.distill.teacher:
            raise UserError("distill.teacher is not set: name the teacher (a Hugging Face directory, a .gguf file, "
                            "or an lmforge run or checkpoint directory)")
        if train_spec(cfg.data).kind == "none":
            raise UserError("data.train=none: distillation needs training records (embedded, or a .jsonl/.parquet file)")
        try:
            source = ModelSource.at(cfg.distill.teacher)
            head = scoring_head(source)
        except UserError as e:  # said once, after the key: "distill.teacher=PATH: what is wrong with it"
            why = str(e).split(": ", 1)[-1] if str(e).startswith(str(Path(cfg.distill.teacher).expanduser())) else str(e)
            raise UserError(f"distill.teacher={cfg.distill.teacher}: {why}") from None
        if head:
            raise UserError(f"distill.teacher={cfg.distill.teacher}: a reward model (a {head} head): it gives a score, not "
                            "the next-token distribution distillation needs; name a language model")
        return source

    def build(self, rt: Runtime, cfg: DistillConfig, inputs: ModelSource) -> Job:
        d = cfg.distill
        teacher = load_teacher(rt, d.teacher)
        chat = training_chat_format(rt.model.tokenizer, rt.model.args.vocab_size, cfg.sft.chat_template)
        train_set, val_set = sft_datasets(cfg, rt.model.tokenizer, chat, lambda split, summary: rt.metrics.record_event(
            "sft_data", 0, summary.line(), split=split, **summary.counts()))
        settings = DistillSettings(d.divergence, d.jsd_beta, d.temperature, d.ce_weight, cfg.training.loss_chunk_tokens)
        objective = DistillObjective(teacher, settings)
        tasks = TaskEval(held_out_examples(cfg.tasks) if cfg.data.train == "embedded" else [],
                         cfg.tasks.eval_max_new_tokens)
        stop_ids = stop_token_ids(rt.model.tokenizer, cfg.sft.chat_template) if d.on_policy > 0 else []
        source = DistillSource(rt, train_set, teacher, d, stop_ids)
        return Job(source, objective, validation_eval(objective, val_set, tasks))
