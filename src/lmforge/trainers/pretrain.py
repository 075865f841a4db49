"""Pretraining: next-token prediction on packed documents (the embedded corpus by default)."""

from __future__ import annotations

from typing import Callable

from lmforge.config import Config
from lmforge.data.corpus import embedded_corpus
from lmforge.data.loader import StepLoader, eval_batches
from lmforge.data.packing import PackedTokenDataset
from lmforge.data.sources import read_documents
from lmforge.training.loop import evaluate_loss, train
from lmforge.training.runtime import Runtime, build_runtime
from lmforge.models.tokenizer import Tokenizer
from lmforge.training.train_step import cross_entropy_loss


def documents(spec: str, split: str, text_field: str) -> list[str]:
    return embedded_corpus(split) if spec == "embedded" else read_documents(spec, text_field=text_field)


def read_corpora(cfg: Config) -> tuple[list[str], list[str]]:
    """Train and validation documents. Read before the run directory is touched, so a bad data file
    fails the run without changing anything an earlier run saved there."""
    d = cfg.data
    return documents(d.train, "train", d.text_field), documents(d.validation, "validation", d.text_field)


def build_datasets(cfg: Config, tokenizer: Tokenizer,
                   corpora: tuple[list[str], list[str]] | None = None) -> tuple[PackedTokenDataset, PackedTokenDataset]:
    train_docs, val_docs = corpora or read_corpora(cfg)
    train_set = PackedTokenDataset(train_docs, tokenizer, cfg.data.seq_len)
    val_set = PackedTokenDataset(val_docs, tokenizer, cfg.data.seq_len)
    return train_set, val_set


def make_loader(rt: Runtime, dataset) -> StepLoader:
    cfg = rt.cfg
    return StepLoader(dataset, cfg.training.global_batch_size, cfg.training.micro_batch_size,
                      rt.dist.rank, rt.dist.world_size, seed=cfg.training.seed, shuffle=cfg.data.shuffle,
                      prefetch=cfg.data.prefetch, device=rt.dist.device)


def run(cfg: Config, trainer: str = "pretrain", setup: Callable[[Runtime], None] | None = None) -> Runtime:
    """Pretrain; ``setup(rt)`` lets a trainer built on this one adjust the runtime before the loop."""
    corpora = read_corpora(cfg)
    rt = build_runtime(cfg, trainer)
    if setup is not None:
        setup(rt)
    train_set, val_set = build_datasets(cfg, rt.tokenizer, corpora)
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
