"""Pretraining: next-token prediction on packed documents (the embedded corpus by default)."""

from __future__ import annotations

from typing import Callable

from lmforge.config import Config
from lmforge.data.corpus import embedded_corpus
from lmforge.data.loader import StepLoader, eval_batches
from lmforge.data.packing import PackedTokenDataset
from lmforge.data.sources import read_documents
from lmforge.loop import evaluate_loss, train
from lmforge.runtime import Runtime, build_runtime
from lmforge.tokenizer import Tokenizer
from lmforge.train_step import cross_entropy_loss


def documents(spec: str, split: str, text_field: str) -> list[str]:
    return embedded_corpus(split) if spec == "embedded" else read_documents(spec, text_field=text_field)


def build_datasets(cfg: Config, tokenizer: Tokenizer) -> tuple[PackedTokenDataset, PackedTokenDataset]:
    d = cfg.data
    train_set = PackedTokenDataset(documents(d.train, "train", d.text_field), tokenizer, d.seq_len)
    val_set = PackedTokenDataset(documents(d.validation, "validation", d.text_field), tokenizer, d.seq_len)
    return train_set, val_set


def make_loader(rt: Runtime, dataset) -> StepLoader:
    cfg = rt.cfg
    return StepLoader(dataset, cfg.training.global_batch_size, cfg.training.micro_batch_size,
                      rt.dist.rank, rt.dist.world_size, seed=cfg.training.seed, shuffle=cfg.data.shuffle,
                      prefetch=cfg.data.prefetch, device=rt.dist.device)


def run(cfg: Config, trainer: str = "pretrain", setup: Callable[[Runtime], None] | None = None) -> Runtime:
    """Pretrain; ``setup(rt)`` lets a trainer built on this one adjust the runtime before the loop."""
    rt = build_runtime(cfg, trainer)
    if setup is not None:
        setup(rt)
    train_set, val_set = build_datasets(cfg, rt.tokenizer)
    loader = make_loader(rt, train_set)

    def run_eval(rt: Runtime):
        batches = eval_batches(val_set, cfg.eval.batch_size, cfg.eval.steps, rt.dist.rank, rt.dist.world_size)
        return evaluate_loss(rt, batches, cross_entropy_loss)

    try:
        train(rt, loader, cross_entropy_loss, run_eval)
    finally:
        loader.close()
        rt.metrics.close()
    return rt
