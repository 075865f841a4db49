"""Preference-method test helpers: pairs of varied lengths, a tiny peaked model, and rows of pair
batches split back into documents (test_dpo, test_preference_methods, _preference_ddp_check)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from _helpers import run_lmforge, tail, torchrun

from lmforge.data.packing import IGNORE_INDEX, Sample
from lmforge.data.sources import Record
from lmforge.models.load import ModelSource
from lmforge.models.model import ModelArgs, Transformer
from lmforge.objectives.reference import FrozenReference
from lmforge.training.train_step import compute_global_loss, gradient_computation


def task_pairs(n: int) -> list[Record]:
    """Plain-text and conversational pairs of varied lengths (so rows pack differently)."""
    out: list[Record] = []
    for i in range(n):
        prompt, good, bad = f"What is {i} plus {i + 3}?", str(2 * i + 3), "x" * (1 + i % 5)
        if i % 2:
            rec = {"prompt": [{"role": "user", "content": prompt}], "chosen": [{"role": "assistant", "content": good}],
                   "rejected": [{"role": "assistant", "content": bad}]}
        else:
            rec = {"prompt": prompt, "chosen": " " + good, "rejected": " " + bad}
        out.append((f"pairs.jsonl:{i + 1}", rec))
    return out


def tiny_model(seed: int, vocab: int = 320) -> Transformer:
    model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab, max_seq_len=128))
    model.init_weights(seed=seed)
    with torch.no_grad():  # peaked logits make any leak between packed sequences visible
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return model


def Reference(model):  # noqa: N802 - reads like the class it builds
    """A frozen reference of ``model`` (None: the policy with its adapters off)."""
    return FrozenReference(model, ModelSource("init", "0"))


def grads_and_values(model, objective, microbatches):
    model.zero_grad()
    stats = gradient_computation(model, microbatches, objective.loss_fn, objective.normalizer(microbatches))
    values = objective.log_values(compute_global_loss(stats))
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, values


def split_documents(sample):
    """A packed row's real documents as (input_ids, labels) pairs."""
    out, at = [], 0
    for n in sample.document_lengths:
        out.append((sample.input_ids[at:at + n], sample.labels[at:at + n]))
        at += n
    return out


def full_logit_logprob(model, ids, labels):
    logp = torch.log_softmax(model(ids[None]).float()[0], -1)
    keep = labels != IGNORE_INDEX
    return logp[keep].gather(-1, labels[keep, None]).sum()


def row_sample(batch, i) -> Sample:
    """Row ``i`` of a batch as a sample again (to re-split a batch into microbatches)."""
    return Sample(batch.input_ids[i], batch.labels[i], batch.position_ids[i], batch.document_ids[i],
                  batch.document_lengths[i], batch.document_values[i] if batch.document_values else None)


def assert_two_ddp_ranks_equal_one_process(args: Callable[..., list[str]], picked: Callable[[Path], Any],
                                           tmp_path: Path) -> None:
    """``args(run_dir, **overrides)`` trained for 3 steps by one process (4 rows a microbatch) and by 2
    DDP ranks under torchrun (1 row a microbatch): ``picked(run_dir)`` (step -> logged values) agree."""
    one, two = tmp_path / "one", tmp_path / "two"
    single = run_lmforge(*args(one, training_steps=3, training_micro_batch_size=4, checkpoint_enabled=False))
    assert single.returncode == 0, tail(single)
    ddp = torchrun(*args(two, training_steps=3, training_micro_batch_size=1, checkpoint_enabled=False,
                         parallel_mode="ddp"))
    assert ddp.returncode == 0, tail(ddp)
    a, b = picked(one), picked(two)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step
