"""Held-out exact match of a vision-language model on the embedded image task (:mod:`lmforge.data.shape_task`),
overall and per question (``colour``, ``count``, ``kind``).

An answer is right when greedy decoding after the prompt writes exactly the answer and then ends the
turn. That happens exactly when, fed the true answer, the model's argmax at every answer position (its
end-of-turn token included) is the true next token: greedy decoding picks the argmax, and it only sees
its own earlier picks, which are then the true ones. So one teacher-forced forward per example scores
what greedy generation would (up to exact ties of two logits), with the images in the batch and no
KV-cache decode of multimodal positions.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from lmforge.data.image_tokens import ImageEncoding
from lmforge.data.packing import IGNORE_INDEX, Batch, collate
from lmforge.data.sft_data import DataSummary, SFTDataset, prepare_examples, tokenize_records
from lmforge.data.shape_task import ShapeExample, shape_records
from lmforge.data.chat import ChatFormat
from lmforge.errors import UserError
from lmforge.models.tokenizer import Tokenizer
from lmforge.runtime import Runtime

__all__ = ["answers_right", "ImageTaskEval"]


def answers_right(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """[B] bool: each row's answer tokens all predicted (argmax) from the true prefix."""
    mask = batch.labels != IGNORE_INDEX
    images = batch.image_inputs()
    positions = None if "image_grid_thw" in images else batch.position_ids
    predicted = model(batch.input_ids, position_ids=positions, document_ids=batch.document_ids,
                      head=lambda h, w: (h[mask].float() @ w.float().T).argmax(-1), **images)
    hit = torch.ones_like(mask)
    hit[mask] = predicted == batch.labels[mask]
    return hit.all(-1) & mask.any(-1)


class ImageTaskEval:
    """``evaluate(rt, step) -> {"exact_match": ..., "exact_match_<question>": ...}`` on the held-out pictures;
    each rank scores its share of the rows and the hits are summed."""

    def __init__(self, examples: Sequence[ShapeExample], tokenizer: Tokenizer, chat: ChatFormat,
                 images: ImageEncoding | None, batch_size: int = 32) -> None:
        if images is None:
            raise UserError("tasks.names=[\"shapes\"] is an image task: train a vision-language model "
                            "(e.g. model.size=\"qwen2.5-vl-debug\")")
        summary = DataSummary(source="shapes (test)")
        tokenized = tokenize_records(shape_records(list(examples), "test"), tokenizer, chat, "assistant", images)
        kept = prepare_examples(tokenized, max(len(t[0]) for t in tokenized), "skip", summary)
        assert len(kept) == len(examples), "every held-out picture is one scored row"
        self.dataset = SFTDataset(kept, max(len(e) for e in kept), tokenizer.pad_id, packing=False, images=images)
        self.questions = [e.question for e in examples]
        self.batch_size = batch_size

    def __bool__(self) -> bool:
        return len(self.dataset) > 0

    def __call__(self, rt: Runtime, step: int = 0) -> dict[str, float]:
        rank, world = rt.world.dist.batch_share, rt.world.dist.batch_shares
        names = ["all", *sorted(set(self.questions))]
        counts = torch.zeros(2, len(names), dtype=torch.float64)
        per_rank = math.ceil(len(self.dataset) / world)
        lo = rank * per_rank
        rows = list(range(lo, min(lo + per_rank, len(self.dataset))))
        model = rt.model.module
        was_training = model.training
        model.eval()
        with torch.no_grad(), rt.model.autocast():
            for k in range(0, len(rows), self.batch_size):
                chunk = rows[k:k + self.batch_size]
                batch = collate([self.dataset[i] for i in chunk])
                right = answers_right(model, batch.to(rt.world.dist.device)).cpu()
                for i, ok in zip(chunk, right.tolist()):
                    for t in (0, names.index(self.questions[i])):
                        counts[0, t] += ok
                        counts[1, t] += 1
        model.train(was_training)
        counts = rt.world.dist.reduce.sum(counts.to(rt.world.dist.device)).cpu()
        scores = {name: float(counts[0, t] / counts[1, t].clamp(min=1)) for t, name in enumerate(names)}
        return {"exact_match": scores.pop("all")} | {f"exact_match_{q}": v for q, v in scores.items()}

