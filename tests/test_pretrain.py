"""End to end through the real CLI: a short pretraining run, exact resume, honest eval sums."""

import json

import pytest
import torch

from _helpers import lmforge_in_process, run_lmforge, tiny_run_args
from lmforge.metrics.records import read_records
from lmforge.checkpoint.checkpointer import Checkpointer, load_model_weights
from lmforge.models.model import ModelArgs, Transformer

# configs/debug.toml (the embedded corpus, lr 3e-3, cosine schedule) shrunk: 12 steps of 8 sequences
# of 64 tokens in 2 microbatches, eval every 5 steps, a checkpoint every 6.
TINY = ["--config", "configs/debug.toml",
        *tiny_run_args(data_seq_len=64, training_micro_batch_size=4, training_steps=12, eval_interval=5,
                       eval_steps=3, eval_batch_size=4, checkpoint_interval=6, schedule_warmup_steps=3)]


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    args = ModelArgs.from_dict(json.loads((run_dir / "model_args.json").read_text())["model_args"])
    model = Transformer(args)
    load_model_weights(Checkpointer(run_dir).latest(), model)
    return model.state_dict()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run = tmp_path_factory.mktemp("straight")
    proc = run_lmforge("pretrain", *TINY, f"--run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, proc


def test_run_logs_falling_loss_and_points_to_files(straight):
    run, proc = straight
    train = read_records(run, "train")
    assert [r["step"] for r in train] == list(range(1, 13))
    assert train[-1]["loss"] < train[0]["loss"]
    assert train[0]["first_step"] and not train[1]["first_step"]
    assert all(r["total_weights"] == 8 * 64 for r in train)  # every packed token is a target
    assert "completed step: 12, seconds:" in proc.stdout
    assert f"tensorboard --logdir {run}/tensorboard" in proc.stdout
    assert (run / "config.toml").is_file() and (run / "model_args.json").is_file()
    assert "reached training.steps=12" in read_records(run, "stop")[0]["reason"]


def test_eval_sums_start_from_zero_every_eval(straight):
    run, _ = straight
    evals = read_records(run, "eval")
    assert [e["step"] for e in evals] == [5, 10, 12]
    assert len({e["total_weights"] for e in evals}) == 1 and evals[0]["total_weights"] == 3 * 4 * 64


def test_resume_continues_exactly(straight, tmp_path, capfd):
    """The interrupted and resumed runs go through the CLI's entry point in this process; the
    uninterrupted one they must equal bit for bit is the real CLI's (``straight``)."""
    run, _ = straight
    resumed = tmp_path / "resumed"
    rc = lmforge_in_process("pretrain", *TINY, f"--run.dir={resumed}", "--training.max_tokens=3072")
    assert rc == 0, capfd.readouterr().err[-3000:]
    assert Checkpointer(resumed).latest().name == "step_00000006"  # stopped by the token budget
    capfd.readouterr()
    rc = lmforge_in_process("pretrain", *TINY, f"--run.dir={resumed}")
    out, err = capfd.readouterr()
    assert rc == 0, err[-3000:]
    assert "resumed from" in out
    ref = {r["step"]: r["loss"] for r in read_records(run, "train")}
    got = {r["step"]: r["loss"] for r in read_records(resumed, "train")}
    assert got == ref  # identical loss lines, bit for bit
    for (k, a), b in zip(final_weights(run).items(), final_weights(resumed).values()):
        assert torch.equal(a, b), k


def test_user_error_is_one_line(tmp_path, capfd):
    rc = lmforge_in_process("pretrain", "--config", "configs/debug.toml", "--training.stepz=3", f"--run.dir={tmp_path}/r")
    assert rc == 2
    assert capfd.readouterr().err.strip().splitlines() == [
        "error: configs/debug.toml: unknown config key `training.stepz` (did you mean `training.steps`?)"]
    assert not (tmp_path / "r").exists()
