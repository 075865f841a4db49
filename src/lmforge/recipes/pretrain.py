"""Pretraining: next-token prediction on packed documents (the embedded corpus by default, prepared
token shards, raw files prepared on first use, or a weighted mixture of them: :mod:`lmforge.data.corpora`)."""

from __future__ import annotations

from lmforge.config import Config
from lmforge.data.corpora import Corpora, read_corpora
from lmforge.recipes.base import Recipe, register
from lmforge.training.loop import Job
from lmforge.recipes.jobs.next_token import next_token_job
from lmforge.runtime import Runtime


@register
class Pretrain(Recipe):
    name = "pretrain"
    config = Config
    summary = "next-token pretraining on packed documents"
    splits_model = True

    def check(self, cfg: Config) -> Corpora:
        return read_corpora(cfg)

    def build(self, rt: Runtime, cfg: Config, inputs: Corpora) -> Job:
        return next_token_job(rt, inputs)
