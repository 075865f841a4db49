"""Pretraining: next-token prediction on packed documents (the embedded corpus by default)."""

from __future__ import annotations

from lmforge.config import Config
from lmforge.data.corpus import embedded_corpus
from lmforge.data.loader import eval_batches
from lmforge.data.packing import PackedTokenDataset
from lmforge.data.sources import read_documents
from lmforge.errors import UserError
from lmforge.evaluation.downstream import with_downstream
from lmforge.evaluation.loss import evaluate_loss
from lmforge.models.tokenizer import Tokenizer
from lmforge.training.loop import train
from lmforge.training.next_token import LoaderSource, NextTokenObjective
from lmforge.training.runtime import Runtime, build_runtime

Corpora = tuple[list[str], list[str]]


def documents(spec: str, split: str, text_field: str) -> list[str]:
    return embedded_corpus(split) if spec == "embedded" else read_documents(spec, text_field=text_field)


def read_corpora(cfg: Config) -> Corpora:
    """Train and validation documents. Read before the run directory is touched, so a bad data file
    fails the run without changing anything an earlier run saved there."""
    d = cfg.data
    return documents(d.train, "train", d.text_field), documents(d.validation, "validation", d.text_field)


def build_datasets(cfg: Config, tokenizer: Tokenizer,
                   corpora: Corpora | None = None) -> tuple[PackedTokenDataset, PackedTokenDataset]:
    """Packed train and validation sets; a problem with either names its config key and file."""
    sets = []
    for key, docs in zip(("train", "validation"), corpora or read_corpora(cfg)):
        try:
            sets.append(PackedTokenDataset(docs, tokenizer, cfg.data.seq_len))
        except UserError as e:
            raise UserError(f"data.{key}={getattr(cfg.data, key)}: {e}") from None
    return sets[0], sets[1]


def train_on_corpora(rt: Runtime, corpora: Corpora) -> Runtime:
    """The pretraining job on an already built runtime (the elastic trainer runs it too)."""
    cfg = rt.cfg
    train_set, val_set = build_datasets(cfg, rt.tokenizer, corpora)
    objective = NextTokenObjective(cfg.training.loss_chunk_tokens)

    def evaluate(rt: Runtime, step: int):
        batches = eval_batches(val_set, cfg.eval.batch_size, cfg.eval.steps, rt.dist.rank, rt.dist.world_size)
        return evaluate_loss(rt, batches, objective.loss_fn)

    if cfg.eval.interval:  # a validation set too small for one eval batch fails now, not after training
        try:
            eval_batches(val_set, cfg.eval.batch_size, cfg.eval.steps, rt.dist.rank, rt.dist.world_size)
        except UserError as e:
            raise UserError(f"data.validation={cfg.data.validation}: {e} (eval.batch_size)") from None
    source = LoaderSource(rt, train_set)
    evaluate = with_downstream(evaluate, cfg)  # type: ignore[assignment]

    try:
        train(rt, source, objective, evaluate)
    finally:
        source.close()
        rt.metrics.close()
    return rt


def run(cfg: Config) -> Runtime:
    corpora = read_corpora(cfg)
    return train_on_corpora(build_runtime(cfg, "pretrain"), corpora)
