"""Knowledge distillation from a frozen teacher into the run's model (the student), on SFT records.

Off-policy (logit) distillation trains on the same records, chat rendering and loss masks as SFT
(:mod:`lmforge.data.sft_inputs`; the ``[sft]`` keys apply): at every target token the student's
next-token distribution is pulled towards the teacher's by the divergence of ``distill.divergence``
(:mod:`lmforge.objectives.distill`). On-policy distillation (GKD): on a share ``distill.on_policy`` of
the steps, chosen by a pure function of the seed and the step, the student first samples completions
of the batch's prompts and the divergence is taken on its own tokens. That sampling is the step
source's business (:class:`lmforge.recipes.jobs.teacher.DistillSource`), so the loss is the same code
either way.

The teacher is anything lmforge loads as a model (a Hugging Face directory, a ``.gguf`` file, an
lmforge run or checkpoint), frozen on the trainer's device; it must share the student's vocabulary.
Each step's FLOPs include the teacher's forward pass; checkpoints record the teacher's source.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from lmforge.config import Config, RunSection, Section, StartEvalSection, TasksSection
from lmforge.data.inputs import train_spec
from lmforge.data.sft_inputs import SFTSection
from lmforge.errors import UserError
from lmforge.recipes.base import Recipe, register

if TYPE_CHECKING:  # recipe modules import no torch until a run starts (lmforge --help stays fast)
    from lmforge.models.load import ModelSource
    from lmforge.runtime import Runtime
    from lmforge.training.loop import Job


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


@register
class Distill(Recipe):
    name = "distill"
    config = DistillConfig
    summary = "knowledge distillation from a frozen teacher (forward/reverse KL, JSD; on-policy GKD) on SFT data"

    def check(self, cfg: DistillConfig) -> ModelSource:
        from lmforge.models.load import ModelSource
        from lmforge.recipes.jobs.teacher import scoring_head

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
        from lmforge.data.chat import stop_token_ids, training_chat_format
        from lmforge.data.sft_inputs import sft_datasets
        from lmforge.evaluation.loss import validation_eval
        from lmforge.evaluation.tasks import TaskEval, held_out_examples
        from lmforge.objectives.distill import DistillObjective, DistillSettings
        from lmforge.recipes.jobs.teacher import DistillSource, load_teacher
        from lmforge.training.loop import Job

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
