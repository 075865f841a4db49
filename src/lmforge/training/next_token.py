"""Next-token training, shared by pretraining, SFT and elastic runs: the packed-data step source
and the cross-entropy objective that :func:`lmforge.training.loop.train` runs."""

from __future__ import annotations

import functools
from typing import Any

import torch

from lmforge.data.fingerprint import check_fingerprint, dataset_fingerprint
from lmforge.data.loader import StepLoader
from lmforge.data.packing import Batch, SampleDataset
from lmforge.training.loop import StepBatch
from lmforge.training.runtime import Runtime
from lmforge.training.chunked_loss import DEFAULT_CHUNK_TOKENS
from lmforge.training.train_step import cross_entropy_loss, global_target_count


class LoaderSource:
    """The step source over a packed dataset: each step is this rank's slice of the next global batch."""

    def __init__(self, rt: Runtime, dataset: SampleDataset) -> None:
        t = rt.cfg.training
        self.fingerprint = dataset_fingerprint(dataset)
        self.on_data_change = rt.cfg.checkpoint.on_data_change
        self.warn = rt.metrics.console
        self.flops = rt.training_flops
        self.loader = StepLoader(dataset, t.global_batch_size, t.micro_batch_size, rt.dist.rank, rt.dist.world_size,
                                 seed=t.seed, shuffle=rt.cfg.data.shuffle, prefetch=rt.cfg.data.prefetch,
                                 device=rt.dist.device)

    def next_step(self, step: int) -> StepBatch:
        microbatches = self.loader.next_step()
        lengths = [n for mb in microbatches for n in mb.real_document_lengths()]
        return StepBatch(microbatches, tokens=sum(mb.input_ids.numel() for mb in microbatches),
                         flops=self.flops(lengths))

    def state_dict(self) -> dict[str, Any]:
        return {**self.loader.state_dict(), "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_fingerprint(state.get("fingerprint"), self.fingerprint, self.on_data_change, self.warn)
        self.loader.load_state_dict(state)

    def rank_state(self) -> dict[str, Any]:
        return {}  # the data position is global (samples consumed): nothing per rank

    def load_rank_state(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        self.loader.close()


class NextTokenObjective:
    """Summed cross-entropy over target tokens, divided by the target tokens of the whole step (all
    microbatches, all ranks): accumulation and ranks give the same gradient as one big batch."""

    console_keys = ("accuracy",)
    watch_spikes = True

    def __init__(self, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        self.loss_fn = functools.partial(cross_entropy_loss, chunk_tokens=chunk_tokens)

    def normalizer(self, microbatches: list[Batch]) -> torch.Tensor:
        return global_target_count(microbatches)

    def log_values(self, totals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return totals
