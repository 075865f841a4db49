"""Distillation's teacher and step source: the teacher loaded frozen on the trainer's device and checked
against the student's vocabulary, and :class:`DistillSource`, SFT's packed loader whose on-policy steps
the student completes itself (the recipe and its keys: :mod:`lmforge.recipes.distill`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmforge import distributed as dist_utils
from lmforge.data.sft_data import SFTDataset
from lmforge.errors import UserError
from lmforge.models.load import ModelSource, checkpoint_description, load_model
from lmforge.models.spec import spec_for_args
from lmforge.models.tokenizer import Tokenizer
from lmforge.objectives.reference import FrozenReference
from lmforge.recipes.jobs.next_token import LoaderSource
from lmforge.recipes.jobs.on_policy import sample_on_policy
from lmforge.runtime import Runtime
from lmforge.training.loop import StepBatch


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

    def __init__(self, rt: Runtime, dataset: SFTDataset, teacher: FrozenReference, d: Any,
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
        totals = rt.world.dist.reduce.sum(torch.tensor([float(sum(lengths)), float(len(lengths))],
                                                       dtype=torch.float64, device=rt.world.dist.device)).tolist()
        student = rt.model.training_flops([n for mb in sampled for n in mb.real_document_lengths()])
        return (StepBatch(sampled, tokens=sum(mb.input_ids.numel() for mb in sampled), flops=student),
                totals[0] / max(totals[1], 1.0))

    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | self.teacher.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.teacher.load_state_dict(state)
