"""The modular train step: accumulation and ranks give the big-batch gradient; budgets; schedule."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _helpers import STEP_MODEL_ARGS, make_batch, split_batch
from lmforge.data.packing import IGNORE_INDEX, Batch
from lmforge.models.model import Transformer
from lmforge.training.state import TrainState
from lmforge.objectives.next_token import NextTokenObjective, cross_entropy_loss
from lmforge.losses.stats import LossStats
from lmforge.optim.schedule import learning_rate
from lmforge.training.train_step import (
    compute_global_loss, global_target_count, gradient_computation, should_continue_training,
)


def grads_after(microbatches: list[Batch]) -> tuple[list[torch.Tensor], dict]:
    torch.manual_seed(0)
    model = Transformer(STEP_MODEL_ARGS)
    model.init_weights(seed=0)
    stats = gradient_computation(model, microbatches, cross_entropy_loss, global_target_count(microbatches))
    return [p.grad.clone() for p in model.parameters()], compute_global_loss(stats)


@pytest.mark.parametrize("parts", [2, 4])
def test_accumulation_equals_one_big_batch(parts):
    batch = make_batch()
    ref_grads, ref = grads_after([batch])
    grads, got = grads_after(split_batch(batch, parts))
    for a, b in zip(ref_grads, grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert got["total_weights"].item() == ref["total_weights"].item() == (batch.labels != IGNORE_INDEX).sum()
    assert got["loss_weight"].item() == got["total_weights"].item()
    torch.testing.assert_close(got["loss"], ref["loss"])


def test_loss_is_token_weighted_not_mean_of_means():
    batch = make_batch()
    _, stats = cross_entropy_loss(Transformer(STEP_MODEL_ARGS), batch)
    assert isinstance(stats, LossStats) and set(stats.sums) == {"correct"}
    assert int(stats.loss_weight) == int(stats.target_tokens) == int((batch.labels != IGNORE_INDEX).sum())
    # two microbatches with different token counts: the global loss is sum/sum
    t = torch.tensor
    a = LossStats(t(10.0), t(10.0), t(10.0), {"correct": t(1.0)})
    b = LossStats(t(2.0), t(1.0), t(1.0), {"correct": t(1.0)})
    out = NextTokenObjective().log_values(compute_global_loss(a + b))
    assert out["loss"].item() == pytest.approx(12.0 / 11.0)
    assert out["accuracy"].item() == pytest.approx(2.0 / 11.0)
    assert set(out) == {"loss", "total_weights", "accuracy"}


def test_loss_weight_and_target_tokens_stay_apart():
    """A loss averaged over something else than tokens (DPO's pairs) still reports its target tokens as
    total_weights, and its loss over its own weight: no objective renames keys back."""
    t = torch.tensor
    pairs = LossStats(t(3.0), t(2.0), t(40.0), {"x_sum": t(5.0)})
    out = compute_global_loss(pairs + pairs)
    assert out["loss"].item() == pytest.approx(6.0 / 4.0)
    assert out["total_weights"].item() == 80.0 and out["loss_weight"].item() == 4.0 and out["x_sum"].item() == 10.0


def test_two_ranks_equal_one_big_batch(tmp_path):
    """Real torchrun, 2 gloo ranks with DDP and uneven target counts vs 1 process, same global batch."""
    script = Path(__file__).with_name("_ddp_grad_check.py")
    out = tmp_path / "grads.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(script), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    dist_grads = torch.load(out, weights_only=True)
    ref_grads, _ = grads_after([make_batch()])
    for a, b in zip(ref_grads, dist_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


class B:
    steps, max_tokens, max_seconds, target_eval_loss = 10, 0, 0.0, 0.0


def test_should_continue_training_reasons():
    b = B()
    assert should_continue_training(TrainState(step=3), b) == (True, "")
    assert "training.steps=10" in should_continue_training(TrainState(step=10), b)[1]
    b.max_tokens = 100
    assert "max_tokens" in should_continue_training(TrainState(step=1, tokens_seen=100), b)[1]
    b.max_seconds = 5.0
    assert "max_seconds" in should_continue_training(TrainState(step=1, training_seconds=6), b)[1]
    b.target_eval_loss = 1.5
    assert "target_eval_loss" in should_continue_training(TrainState(step=1, last_eval_loss=1.4), b)[1]
    assert should_continue_training(TrainState(step=1, last_eval_loss=1.6), b)[0]
    assert "SIGTERM" in should_continue_training(TrainState(step=1, stop_requested="SIGTERM"), b)[1]


def test_a_stop_signal_waits_for_every_ranks_agreement():
    """A signal only marks this rank's wish to stop; the loop stops once the ranks have agreed on it at the
    same step (loop.end_of_step). Stopping on the local flag alone let one rank save while the other ran
    its next step, and both waited in different collectives (a SIGTERMed 2-rank run that never exited)."""
    import os
    import signal

    from lmforge.training.signals import StopSignals

    state = TrainState(step=1)
    with StopSignals(state):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs between bytecodes of the main thread
            if state.stop_signal:
                break
    assert state.stop_signal == "SIGTERM" and state.stop_requested is None
    assert should_continue_training(state, B()) == (True, "")


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant", "wsd"])
def test_schedule_warmup_and_end(kind):
    lr = lambda s: learning_rate(s, base_lr=1.0, total_steps=100, kind=kind, warmup_steps=10,  # noqa: E731
                                 min_lr_ratio=0.1, decay_fraction=0.2)
    assert lr(1) == pytest.approx(0.1) and lr(10) == pytest.approx(1.0)
    end = 1.0 if kind == "constant" else 0.1
    assert lr(100) == pytest.approx(end)
    assert all(lr(s) >= lr(s + 1) - 1e-12 for s in range(10, 100))
    if kind == "wsd":
        assert lr(80) == 1.0 and lr(90) == pytest.approx(0.55)
    if kind == "cosine":
        assert lr(55) == pytest.approx(0.55)


def test_checkpointed_token_count_includes_steps_not_yet_logged():
    """Token counts stay on the device between log steps; a checkpoint in between must count them all."""
    state = TrainState()
    for _ in range(3):
        state.count_tokens(torch.tensor(100.0), read_now=False)
    assert state.tokens_seen == 0  # nothing read from the device yet
    assert state.state_dict()["tokens_seen"] == 300
    resumed = TrainState()
    resumed.load_state_dict(state.state_dict())
    assert resumed.tokens_seen == 300 and not resumed.pending_tokens
