"""On-policy batches: the student's own completions of a data batch's prompts (on-policy distillation).

A data batch holds SFT examples (packed or padded). Each example's *prompt* is its tokens up to and
including the position of its first loss target: what the model saw before the first token it had to
predict (for a chat, the conversation up to the first assistant answer, generation prompt included).
The student continues every prompt with lmforge's own generator, and each prompt + completion becomes
one right-padded row whose targets are the completion tokens (stop token included). Right padding
keeps every real token where it would be alone, with plain causal attention.

Sampling is seeded by the caller (the distillation step source seeds each call from the run's seed,
the step and the microbatch's global index), so a resumed run samples the same completions.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Sequence

import torch
from torch import nn

from lmforge.data.packing import IGNORE_INDEX, Batch
from lmforge.errors import UserError
from lmforge.models.generate import generate
from lmforge.objectives.distill import SampledBatch


def batch_prompts(batch: Batch) -> list[list[int]]:
    """Every example's prompt (see the module docstring), rows and packed documents in order; examples
    without a target (padding) give none."""
    ids, labels = batch.input_ids.tolist(), batch.labels.tolist()
    T = batch.input_ids.shape[1]
    prompts = []
    for i, (row, row_labels) in enumerate(zip(ids, labels)):
        lengths = batch.document_lengths[i] if batch.document_lengths is not None else [T]
        at = 0
        for n in lengths:
            first = next((k for k in range(at, at + n) if row_labels[k] != IGNORE_INDEX), None)
            if first is not None:
                prompts.append(row[at:first + 1])
            at += n
    return prompts


def completion_batch(prompts: Sequence[list[int]], completions: Sequence[list[int]], pad_id: int,
                     device: torch.device) -> SampledBatch:
    """``prompt + completion`` rows, right-padded, with the completion tokens as targets."""
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
    T = max(len(s) for s in seqs) - 1
    ids = torch.full((len(seqs), T + 1), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), T), IGNORE_INDEX, dtype=torch.long)
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        ids[i, :len(s)] = torch.tensor(s)
        labels[i, len(p) - 1:len(s) - 1] = ids[i, len(p):len(s)]
    return SampledBatch(ids[:, :-1].to(device), labels.to(device),
                        document_lengths=[[len(s) - 1] for s in seqs])


def sample_on_policy(policy: nn.Module, batch: Batch, *, max_new_tokens: int, temperature: float,
                     stop_ids: Sequence[int], pad_id: int, generator: torch.Generator, teacher_max_len: int,
                     lockstep: bool = False, autocast: Any = None) -> tuple[SampledBatch, list[int]]:
    """The student's completions of ``batch``'s prompts as a batch to distill on, and their lengths."""
    prompts = batch_prompts(batch)
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > teacher_max_len:
        raise UserError(f"distill.max_new_tokens={max_new_tokens}: a prompt of {longest - max_new_tokens} tokens "
                        f"plus the completion exceeds the teacher's max_seq_len {teacher_max_len}")
    with autocast if autocast is not None else nullcontext():
        completions = generate(policy, prompts, max_new_tokens, stop_ids=stop_ids, pad_id=pad_id,
                               temperature=temperature, generator=generator, lockstep=lockstep)
    return completion_batch(prompts, completions, pad_id, batch.input_ids.device), [len(c) for c in completions]
