"""Data parallelism end to end (real torchrun, 2 CPU processes, gloo): DDP, FSDP2, gradient
accumulation and resuming a checkpoint at another world size all reproduce one process's losses.

One uninterrupted single-process run is the reference. The other runs stop at step 4 on a token
budget (saving a checkpoint) and continue in another layout, so every run below checks both an
equivalence and a resume:

* 1 process, micro batch G/2 (accumulation), steps 1-4  ->  2 processes DDP, steps 5-8
* 2 processes FSDP2 with accumulation, steps 1-4        ->  1 process, steps 5-8

fp32 losses are compared to 1e-5 relative: sums over other microbatch and rank splits round
differently in the last bits only. FSDP2 and HSDP also compare the pre-clip gradient norm of every
step (1e-4): a gradient scaled on the way (e.g. summed instead of averaged over ranks) leaves the
losses nearly unchanged, since AdamW's update does not depend on the gradient's scale.
"""

from __future__ import annotations

import pytest

from _helpers import (STEPS, TOKENS_PER_STEP, assert_losses_match, grad_norms, losses, run_lmforge, tail,
                      tiny_run_args, torchrun)
from lmforge.metrics.records import read_records

HALF = STEPS // 2


def first_half(run, corpus, nproc: int, **overrides) -> None:
    args = ("pretrain", *tiny_run_args(corpus, training_max_tokens=HALF * TOKENS_PER_STEP, **overrides),
            f"--run.dir={run}")
    proc = run_lmforge(*args) if nproc == 1 else torchrun(*args, nproc=nproc)
    assert proc.returncode == 0, tail(proc)
    assert (run / "checkpoints" / f"step_{HALF:08d}").is_dir()


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory, corpus):
    run = tmp_path_factory.mktemp("distributed") / "accumulated"
    first_half(run, corpus, nproc=1, training_micro_batch_size=4)
    return run


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory, corpus):
    run = tmp_path_factory.mktemp("distributed") / "fsdp"
    first_half(run, corpus, nproc=2, training_micro_batch_size=2, parallel_mode="fsdp")
    return run


def test_gradient_accumulation_matches_one_full_microbatch(accumulated, reference_losses):
    got = losses(accumulated)
    assert sorted(got) == list(range(1, HALF + 1))
    assert_losses_match(got, reference_losses, range(1, HALF + 1))


def test_fsdp2_two_ranks_match_one_process(fsdp, reference_losses, reference_grad_norms):
    got = losses(fsdp)
    assert sorted(got) == list(range(1, HALF + 1))
    assert_losses_match(got, reference_losses, range(1, HALF + 1))
    assert_losses_match(grad_norms(fsdp), reference_grad_norms, range(1, HALF + 1), rel=1e-4)  # the pre-clip norm
    train = read_records(fsdp, "train")
    assert all(r["world_size"] == 2 for r in train)
    assert read_records(fsdp, "setup")[0]["parallel"] == "fsdp"


def test_hsdp_on_a_two_by_two_mesh_matches_one_process(tmp_path, corpus, reference_losses, reference_grad_norms):
    """4 ranks: 2 replicas of a model sharded over 2 ranks each (FSDP2 on the 2-D mesh)."""
    run = tmp_path / "hsdp"
    first_half(run, corpus, nproc=4, training_micro_batch_size=2, parallel_dp_replicate=2, parallel_dp_shard=2)
    got = losses(run)
    assert sorted(got) == list(range(1, HALF + 1))
    assert_losses_match(got, reference_losses, range(1, HALF + 1))
    assert_losses_match(grad_norms(run), reference_grad_norms, range(1, HALF + 1), rel=1e-4)  # the pre-clip norm
    setup = read_records(run, "setup")[0]
    assert (setup["parallel"], setup["mesh"]) == ("hsdp", "dp_replicate=2 x dp_shard=2")


def test_ddp_two_ranks_continue_a_one_process_checkpoint(accumulated, corpus, reference_losses):
    """Saved by 1 process with accumulation, resumed by 2 DDP ranks without: same global batches."""
    proc = torchrun("pretrain", *tiny_run_args(corpus, training_micro_batch_size=4, parallel_mode="ddp"),
                    f"--run.dir={accumulated}")
    assert proc.returncode == 0, tail(proc)
    resume = read_records(accumulated, "resume")[-1]
    assert resume["step"] == HALF and resume["saved_world_size"] == 1
    assert_losses_match(losses(accumulated), reference_losses, range(1, STEPS + 1))
    assert [r["world_size"] for r in read_records(accumulated, "train")][-1] == 2
    assert "world_size: 2" in proc.stdout


def test_one_process_continues_an_fsdp2_checkpoint(fsdp, corpus, reference_losses):
    """Sharded over 2 ranks, resharded onto 1 by DCP; the data position is global."""
    proc = run_lmforge("pretrain", *tiny_run_args(corpus, training_micro_batch_size=8), f"--run.dir={fsdp}")
    assert proc.returncode == 0, tail(proc)
    resume = read_records(fsdp, "resume")[-1]
    assert resume["step"] == HALF and resume["saved_world_size"] == 2
    assert_losses_match(losses(fsdp), reference_losses, range(1, STEPS + 1))


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_accumulation_reduces_gradients_once_per_step(mode, tmp_path):
    """3 microbatches per rank: the gradients are reduced once (FSDP2: one reduce-scatter per unit, the
    2 blocks and the root; DDP: once per bucket), as for a single microbatch, and equal one process's."""
    import subprocess
    import sys
    from pathlib import Path

    import torch

    from _helpers import STEP_MODEL_ARGS, make_batch
    from lmforge.models.model import Transformer
    from lmforge.objectives.next_token import cross_entropy_loss
    from lmforge.training.train_step import global_target_count, gradient_computation

    out = tmp_path / "sync.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(Path(__file__).with_name("_grad_sync_check.py")), mode, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out, weights_only=True)
    if mode == "fsdp":
        assert got["one_microbatch"] == STEP_MODEL_ARGS.n_layers + 1
    assert got["three_microbatches"] == got["one_microbatch"] >= 1
    model = Transformer(STEP_MODEL_ARGS)
    model.init_weights(seed=0)
    batch = [make_batch(n=12, t=24)]
    gradient_computation(model, batch, cross_entropy_loss, global_target_count(batch))
    for p, g in zip(model.parameters(), got["grads"]):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)
