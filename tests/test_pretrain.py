"""End to end through the real CLI: a short pretraining run, exact resume, honest eval sums."""

import json
import subprocess
import sys

import pytest
import torch

from lmforge.checkpoint.checkpointer import Checkpointer, load_model_weights
from lmforge.models.model import ModelArgs, Transformer

TINY = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--data.seq_len=64", "--training.global_batch_size=8", "--training.micro_batch_size=4",
        "--metrics.log_every=1", "--eval.interval=5", "--eval.steps=3", "--eval.batch_size=4",
        "--schedule.warmup_steps=3", "--training.threads=1", "--metrics.tensorboard=false"]


def lmforge(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmforge", *args], capture_output=True, text=True, timeout=timeout)


def records(run_dir, kind):
    out = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in out if r["kind"] == kind]


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    args = ModelArgs.from_dict(json.loads((run_dir / "model_args.json").read_text())["model_args"])
    model = Transformer(args)
    load_model_weights(Checkpointer(run_dir).latest(), model)
    return model.state_dict()


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run = tmp_path_factory.mktemp("straight")
    proc = lmforge("pretrain", "--config", "configs/debug.toml", *TINY, "--training.steps=12",
                   "--checkpoint.interval=6", f"--run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, proc


def test_run_logs_falling_loss_and_points_to_files(straight):
    run, proc = straight
    train = records(run, "train")
    assert [r["step"] for r in train] == list(range(1, 13))
    assert train[-1]["loss"] < train[0]["loss"]
    assert train[0]["first_step"] and not train[1]["first_step"]
    assert all(r["total_weights"] == 8 * 64 for r in train)  # every packed token is a target
    assert "completed step: 12, seconds:" in proc.stdout
    assert f"tensorboard --logdir {run}/tensorboard" in proc.stdout
    assert (run / "config.toml").is_file() and (run / "model_args.json").is_file()
    assert "reached training.steps=12" in [r for r in records(run, "stop")][0]["reason"]


def test_eval_sums_start_from_zero_every_eval(straight):
    run, _ = straight
    evals = records(run, "eval")
    assert [e["step"] for e in evals] == [5, 10, 12]
    assert len({e["total_weights"] for e in evals}) == 1 and evals[0]["total_weights"] == 3 * 4 * 64


def test_resume_continues_exactly(straight, tmp_path):
    run, _ = straight
    resumed = tmp_path / "resumed"
    first = lmforge("pretrain", "--config", "configs/debug.toml", *TINY, "--training.steps=12",
                    "--checkpoint.interval=6", f"--run.dir={resumed}", "--training.max_tokens=3072")
    assert first.returncode == 0, first.stderr[-3000:]
    assert Checkpointer(resumed).latest().name == "step_00000006"  # stopped by the token budget
    second = lmforge("pretrain", "--config", "configs/debug.toml", *TINY, "--training.steps=12",
                     "--checkpoint.interval=6", f"--run.dir={resumed}")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout
    ref = {r["step"]: r["loss"] for r in records(run, "train")}
    got = {r["step"]: r["loss"] for r in records(resumed, "train")}
    assert got == ref  # identical loss lines, bit for bit
    for (k, a), b in zip(final_weights(run).items(), final_weights(resumed).values()):
        assert torch.equal(a, b), k


def test_user_error_is_one_line(tmp_path):
    proc = lmforge("pretrain", "--config", "configs/debug.toml", "--training.stepz=3", f"--run.dir={tmp_path}/r")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: configs/debug.toml: unknown config key `training.stepz` (did you mean `training.steps`?)"]
    assert not (tmp_path / "r").exists()
