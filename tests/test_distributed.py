"""Data parallelism end to end (real torchrun, 2 CPU processes, gloo): DDP, FSDP2, gradient
accumulation and resuming a checkpoint at another world size all reproduce one process's losses.

One uninterrupted single-process run is the reference. The other runs stop at step 4 on a token
budget (saving a checkpoint) and continue in another layout, so every run below checks both an
equivalence and a resume:

* 1 process, micro batch G/2 (accumulation), steps 1-4  ->  2 processes DDP, steps 5-8
* 2 processes FSDP2 with accumulation, steps 1-4        ->  1 process, steps 5-8

fp32 losses are compared to 1e-5 relative: sums over other microbatch and rank splits round
differently in the last bits only.
"""

from __future__ import annotations

import pytest

from _torchrun import (STEPS, TOKENS_PER_STEP, assert_losses_match, lmforge, losses, records,
                       reference_losses, tail, tiny_args, torchrun, write_corpus)

HALF = STEPS // 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("data") / "corpus.txt")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    return reference_losses(tmp_path_factory, corpus)


def first_half(*extra: str, nproc: int, run) -> None:
    budget = f"--training.max_tokens={HALF * TOKENS_PER_STEP}"
    args = ("pretrain", *tiny_args(run.parent / "corpus.txt"), *extra, budget, f"--run.dir={run}")
    proc = lmforge(*args) if nproc == 1 else torchrun(*args, nproc=nproc)
    assert proc.returncode == 0, tail(proc)
    assert (run / "checkpoints" / f"step_{HALF:08d}").is_dir()


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory, corpus):
    run = corpus.parent / "accumulated"
    first_half("--training.micro_batch_size=4", nproc=1, run=run)
    return run


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory, corpus):
    run = corpus.parent / "fsdp"
    first_half("--training.micro_batch_size=2", "--parallel.mode=fsdp", nproc=2, run=run)
    return run


def test_gradient_accumulation_matches_one_full_microbatch(accumulated, reference):
    got = losses(accumulated)
    assert sorted(got) == list(range(1, HALF + 1))
    assert_losses_match(got, reference, range(1, HALF + 1))


def test_fsdp2_two_ranks_match_one_process(fsdp, reference):
    got = losses(fsdp)
    assert sorted(got) == list(range(1, HALF + 1))
    assert_losses_match(got, reference, range(1, HALF + 1))
    train = records(fsdp, "train")
    assert all(r["world_size"] == 2 for r in train)
    assert records(fsdp, "setup")[0]["parallel"] == "fsdp"


def test_ddp_two_ranks_continue_a_one_process_checkpoint(accumulated, reference):
    """Saved by 1 process with accumulation, resumed by 2 DDP ranks without: same global batches."""
    proc = torchrun("pretrain", *tiny_args(accumulated.parent / "corpus.txt"), "--training.micro_batch_size=4",
                    "--parallel.mode=ddp", f"--run.dir={accumulated}")
    assert proc.returncode == 0, tail(proc)
    resume = records(accumulated, "resume")[-1]
    assert resume["step"] == HALF and resume["saved_world_size"] == 1
    assert_losses_match(losses(accumulated), reference, range(1, STEPS + 1))
    assert [r["world_size"] for r in records(accumulated, "train")][-1] == 2
    assert "world_size: 2" in proc.stdout


def test_one_process_continues_an_fsdp2_checkpoint(fsdp, reference):
    """Sharded over 2 ranks, resharded onto 1 by DCP; the data position is global."""
    proc = lmforge("pretrain", *tiny_args(fsdp.parent / "corpus.txt"), "--training.micro_batch_size=8",
                   f"--run.dir={fsdp}")
    assert proc.returncode == 0, tail(proc)
    resume = records(fsdp, "resume")[-1]
    assert resume["step"] == HALF and resume["saved_world_size"] == 2
    assert_losses_match(losses(fsdp), reference, range(1, STEPS + 1))
