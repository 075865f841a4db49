"""Next-token training's step source (packed data, shared by every recipe but GRPO) and the
next-token job over checked corpora that pretraining runs."""

from __future__ import annotations

from typing import Any

from lmforge.data.corpora import Corpora, build_datasets
from lmforge.data.fingerprint import check_fingerprint, dataset_fingerprint
from lmforge.data.loader import StepLoader, eval_batches
from lmforge.data.packing import SampleDataset
from lmforge.errors import UserError
from lmforge.evaluation.loss import validation_eval
from lmforge.objectives.next_token import NextTokenObjective
from lmforge.training.loop import Job, StepBatch
from lmforge.runtime import Runtime


class LoaderSource:
    """The step source over a packed dataset: each step is this rank's slice of the next global batch."""

    def __init__(self, rt: Runtime, dataset: SampleDataset) -> None:
        t = rt.cfg.training
        self.fingerprint = dataset_fingerprint(dataset)
        self.on_data_change = rt.cfg.checkpoint.on_data_change
        self.warn = rt.metrics.console
        self.flops, self.image_flops = rt.model.training_flops, rt.model.image_flops
        self.context_shard, self.cp = rt.world.shard_batch, rt.world.layout.cp
        self.loader = StepLoader(dataset, t.global_batch_size, t.micro_batch_size, rt.world.dist.batch_share, rt.world.dist.batch_shares,
                                 seed=t.seed, shuffle=rt.cfg.data.shuffle, prefetch=rt.cfg.data.prefetch,
                                 device=rt.world.dist.device)

    def next_step(self, step: int) -> StepBatch:
        microbatches = self.loader.next_step()
        lengths = [n for mb in microbatches for n in mb.real_document_lengths()]
        # a vision-language batch's tower FLOPs, from its host-side grids (image tokens are in the decoder's)
        towers = sum(self.image_flops(mb.image_grid_thw, mb.image_count) for mb in microbatches)
        # under context parallelism this rank holds 1/cp of every sequence, and (load-balanced) of the work
        microbatches = [self.context_shard(mb) for mb in microbatches]
        return StepBatch(microbatches, tokens=sum(mb.input_ids.numel() for mb in microbatches),
                         flops=(self.flops(lengths) + towers) / self.cp)

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


def next_token_job(rt: Runtime, corpora: Corpora) -> Job:
    """Cross-entropy on the packed training corpus; eval loss on ``eval.steps`` fixed batches of the
    validation corpus (a validation set too small for one eval batch fails now, not after training)."""
    cfg = rt.cfg
    train_set, val_set = build_datasets(cfg, rt.model.tokenizer, corpora)
    e, rank, world = cfg.eval, rt.world.dist.batch_share, rt.world.dist.batch_shares
    if val_set is not None and e.interval:
        try:
            eval_batches(val_set, e.batch_size, e.steps, rank, world)
        except UserError as err:
            raise UserError(f"data.validation={cfg.data.validation}: {err} (eval.batch_size)") from None
    objective = NextTokenObjective.for_run(cfg.training, rt.model.args)
    evaluate = validation_eval(objective, val_set,
                               batches=lambda rt, ds: eval_batches(ds, e.batch_size, e.steps, rank, world))
    return Job(LoaderSource(rt, train_set), objective, evaluate)
