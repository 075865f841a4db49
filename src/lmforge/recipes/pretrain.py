"""Pretraining: next-token prediction on packed documents (the embedded corpus by default, prepared
token shards, raw files prepared on first use, or a weighted mixture of them: :mod:`lmforge.data.corpora`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmforge.config import Config
from lmforge.recipes.base import Recipe, register

if TYPE_CHECKING:  # recipe modules import no torch until a run starts (lmforge --help stays fast)
    from lmforge.data.corpora import Corpora
    from lmforge.runtime import Runtime
    from lmforge.training.loop import Job


@register
class Pretrain(Recipe):
    name = "pretrain"
    config = Config
    summary = "next-token pretraining on packed documents"
    splits_model = True

    def check(self, cfg: Config) -> Corpora:
        from lmforge.data.corpora import read_corpora

        return read_corpora(cfg)

    def build(self, rt: Runtime, cfg: Config, inputs: Corpora) -> Job:
        from lmforge.recipes.jobs.next_token import next_token_job

        return next_token_job(rt, inputs)
