"""Goodput accounting, non-finite/spike guards and the progress bar, on real runs.

``observed_run`` (a conftest fixture, also read by test_report.py) runs one short pretraining through
the CLI with eval and checkpoints, once per test session.
"""

from __future__ import annotations

import dataclasses

import functools
import io
import re
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from lmforge.metrics import GOODPUT_CATEGORIES, MetricLogger
from lmforge.metrics.records import read_records

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def terminal_lines(out: str) -> list[str]:
    """What each line of terminal output shows: the text after the last carriage return."""
    return [_ANSI.sub("", seg.rstrip("\r")).rsplit("\r", 1)[-1] for seg in out.split("\n")]


# ---------------------------------------------------------------------- goodput
def test_goodput_categories_add_up_to_the_process_wall_time(observed_run):
    run_dir, launched, exited, stdout = observed_run
    records = read_records(run_dir)
    final = [r for r in records if r["kind"] == "goodput" and r["final"]]
    assert len(final) == 1
    g = final[0]
    wall = g["wall"]
    # Every second in exactly one category: the categories sum to the wall time, and none claims
    # time another one has (that would push the sum over the wall time, `other` being clamped at 0).
    total = sum(g[c] for c in GOODPUT_CATEGORIES)
    assert abs(total - wall) <= 0.01 * wall, (total, wall)
    # The wall time is the process's: from its launch (interpreter start, imports) to the summary.
    measured = g["time"] - launched
    assert abs(wall - measured) <= 0.01 * measured, (wall, measured)
    # After the summary only closing files and the interpreter's own teardown follow (freeing torch
    # takes from 0.3 s to seconds on a busy machine); no lmforge record comes later.
    assert records[-1] is g and exited > g["time"]
    for c in ("setup", "first_step", "productive", "eval", "checkpoint_save"):
        assert g[c] > 0, c
    assert g["other"] < 0.05 * wall, g
    assert g["checkpoint_restore"] == g["lost_progress"] == g["recovery"] == g["rollout"] == 0.0

    # The categories agree with what the train and eval records measured on their own.
    train = [r for r in records if r["kind"] == "train"]
    step_seconds = sum(r["seconds"] * r["steps_averaged"] for r in train)
    stepped = g["first_step"] + g["productive"] + g["data_wait"]
    assert stepped == pytest.approx(step_seconds, rel=1e-3, abs=1e-3)
    eval_seconds = sum(r["eval_seconds"] for r in records if r["kind"] == "eval")
    assert g["eval"] == pytest.approx(eval_seconds, rel=0.05, abs=0.05)
    # A goodput record every log period, then the final one and its console summary.
    periodic = [r for r in records if r["kind"] == "goodput" and not r["final"]]
    assert [r["step"] for r in periodic] == [r["step"] for r in train] == [1, 4, 8, 12]
    assert any(re.match(r"goodput \d+\.\d% of \d+\.\ds wall: setup [\d.]+, first_step [\d.]+, productive", line)
               for line in terminal_lines(stdout)), stdout


def test_nested_timed_blocks_count_each_second_once():
    m = MetricLogger("unused", rank=1, tensorboard=False)  # rank 1 writes nothing
    m.start_clock()
    with m.timed("recovery"):
        time.sleep(0.05)
        with m.timed("checkpoint_restore"):
            time.sleep(0.1)
    assert m.goodput["checkpoint_restore"] == pytest.approx(0.1, abs=0.04)
    assert m.goodput["recovery"] == pytest.approx(0.05, abs=0.04)
    assert m._excluded == pytest.approx(0.15, abs=0.05)  # the surrounding step loses both
    with pytest.raises(ValueError, match="unknown goodput category"):
        with m.timed("lunch"):
            pass


# ---------------------------------------------------------------------- progress
def test_progress_is_off_without_a_terminal_and_lines_stay_plain():
    *_, console = skip_run()  # metrics.progress=auto, stdout a StringIO
    assert "\r" not in console and "\x1b" not in console and "step 8/8" not in console
    assert len(re.findall(r"^completed step: \d+, seconds: ", console, re.M)) == 3


def test_progress_eta_from_the_budget_that_ends_first():
    from lmforge.metrics.progress import ProgressBar, progress_bar

    assert progress_bar("auto", 100, stream=io.StringIO()) is None
    assert progress_bar("on", 100, stream=io.StringIO(), is_main=False) is None
    bar = ProgressBar(steps=100, max_tokens=1000, stream=io.StringIO())
    bar.update(1, {"total_weights": torch.tensor(100.0)})
    assert bar.expected_total(1) == 10  # the token budget ends the run at step 10, before step 100
    bar.update(2, {"total_weights": torch.tensor(100.0)})
    assert bar._bar.total == 10 and bar._bar.n == 2
    bar.close()
    assert ProgressBar(steps=5, max_tokens=10**9).expected_total(1) == 5
    resumed = ProgressBar(steps=100, max_tokens=1000, stream=io.StringIO())
    resumed.update(6, {"total_weights": 50.0})  # resumed after step 5 at 50 tokens per step
    assert resumed.tokens == 300 and resumed.expected_total(6) == 20
    resumed.close()


_TRAIN_LINE = re.compile(r"^completed step: \d+, seconds: [\d.]+, TFLOP/s/device: [\d.]+, Tokens/s/device: [\d.]+, "
                         r"total_weights: \d+, loss: [\d.]+, lr: \S+, grad_norm: \S+, accuracy: \S+, "
                         r"mfu: [\d.]+%, mem: [\d.]+ GB( \((first step: warm-up, not representative|time averaged over \d+ steps)\))?$")


def test_progress_bar_on_a_terminal_does_not_garble_log_lines(observed_run):
    *_, out = observed_run
    # The bar was drawn, with its ETA, and reached the step budget.
    assert re.search(r"train +\d+%\|.*\| step 12/12 \[[\d:]+<[\d:?]+", out), out
    # Each log line, once the bar has been wiped before it (carriage return), is whole and alone.
    shown = terminal_lines(out)
    train_lines = [s for s in shown if "completed step" in s]
    assert len(train_lines) == 4, shown
    for line in train_lines:
        assert _TRAIN_LINE.match(line), line
    for prefix in ("setup: trainer=pretrain", "eval metrics after step: 6,", "stopping after step 12",
                   "eval metrics after step: 12,", "checkpoint: ", "goodput "):
        assert any(s.startswith(prefix) for s in shown), (prefix, shown)


# ---------------------------------------------------------------------- guards
def _in_process_run(run_dir: Path, loss_fn, progress: str = "off", metrics: dict | None = None, **training):
    """A tiny pretraining in this process with an injected loss function; returns (runtime, error)."""
    from lmforge.config import Config, validate_config
    from lmforge.data.corpus import embedded_corpus
    from lmforge.data.packing import PackedTokenDataset
    from lmforge.training.loop import train
    from lmforge.runtime import build_runtime
    from lmforge.recipes.jobs.next_token import LoaderSource, NextTokenObjective

    cfg = validate_config(Config, {
        "model": {"n_layers": 2, "dim": 64}, "data": {"seq_len": 32, "prefetch": 0},
        "training": {"steps": 8, "global_batch_size": 4, "micro_batch_size": 4, **training},
        "optimizer": {"lr": 1e-3}, "schedule": {"warmup_steps": 0},
        "eval": {"interval": 0}, "checkpoint": {"enabled": False},
        "metrics": {"log_every": 4, "tensorboard": False, "peak_tflops": 1.0, "progress": progress,
                    **(metrics or {})},
        "run": {"dir": str(run_dir)}})
    rt = build_runtime(cfg, "pretrain")
    loader = LoaderSource(rt, PackedTokenDataset(embedded_corpus("train", num_docs=200), rt.model.tokenizer, 32))
    objective = NextTokenObjective()
    objective.loss_fn = loss_fn
    error = None
    try:
        train(rt, loader, objective, None)
    except Exception as e:  # noqa: BLE001 - returned to the test
        error = e
    finally:
        loader.close()
        rt.metrics.close()
    return rt, error


def _loss_with(changes: dict[int, str | float]):
    """cross_entropy_loss, changed on the given 1-based calls (one call per step here).

    A number multiplies the loss (nan, inf, 20.0); ``"nan_grad"`` keeps the loss value but makes
    its gradient NaN (d/dx sqrt(x) at 0 is inf, and the unselected branch of where() gets 0 * inf).
    """
    from lmforge.objectives.next_token import cross_entropy_loss

    calls = {"n": 0}

    def loss_fn(model, batch):
        calls["n"] += 1
        objective, stats = cross_entropy_loss(model, batch)
        change = changes.get(calls["n"])
        if change == "nan_grad":
            w = next(model.parameters())
            objective = objective + torch.where(torch.tensor(True), torch.zeros(()), torch.sqrt(w.sum() * 0))
        elif change is not None:
            objective = objective * change
            stats = dataclasses.replace(stats, loss_sum=stats.loss_sum * change)
        return objective, stats
    return loss_fn


@pytest.mark.parametrize("change, what", [(float("nan"), "loss (nan)"), ("nan_grad", "grad norm (nan)")])
def test_nonfinite_stops_the_run_with_a_message_naming_the_step(tmp_path, change, what):
    from lmforge.errors import UserError
    from lmforge.runtime.guard import NonFiniteLoss

    _, error = _in_process_run(tmp_path / "run", _loss_with({3: change}), steps=5)
    assert isinstance(error, NonFiniteLoss) and isinstance(error, UserError)  # the CLI prints one error line
    assert f"non-finite {what} at step 3;" in str(error), error
    records = read_records(tmp_path / "run")
    assert [r["step"] for r in records if r["kind"] == "nonfinite_stop"] == [3]
    assert not any(r["kind"] == "stop" for r in records)


@functools.lru_cache(maxsize=None)
def skip_run() -> tuple:
    """8 steps with training.nonfinite=skip: NaN loss at step 3, inf at 5, a 20x loss spike at 7;
    the console goes to a StringIO (not a terminal) with metrics.progress=auto."""
    run_dir = Path(tempfile.mkdtemp(prefix="lmforge_skip_")) / "run"
    out = io.StringIO()
    from contextlib import redirect_stdout

    with redirect_stdout(out):
        rt, error = _in_process_run(run_dir, _loss_with({3: float("nan"), 5: float("inf"), 7: 20.0}),
                                    progress="auto", nonfinite="skip", spike_factor=3.0)
    return rt, error, read_records(run_dir), out.getvalue()


def test_nonfinite_skip_skips_and_counts_the_updates():
    rt, error, records, console = skip_run()
    assert error is None
    skips = [r for r in records if r["kind"] == "nonfinite_skip"]
    assert [(r["step"], r["skipped_updates"]) for r in skips] == [(3, 1), (5, 2)]
    assert "warning: step 3: non-finite grad norm, update skipped (1 so far)" in console
    # The run went through all 8 steps, but AdamW took only 6 of them, and the weights stayed finite.
    assert any(r["kind"] == "stop" and r["step"] == 8 for r in records)
    assert {int(s["step"]) for s in rt.optimizer.state.values()} == {6}
    assert all(torch.isfinite(p).all() for p in rt.model.raw.parameters())


def test_loss_spike_is_logged_as_a_warning_with_its_step():
    _, _, records, console = skip_run()
    spikes = [r for r in records if r["kind"] == "loss_spike"]
    assert [r["step"] for r in spikes] == [7]  # not at the non-finite steps, not after the spike
    assert spikes[0]["loss"] > 3 * 4.0
    assert re.search(r"^warning: loss spike at step 7: [\d.]+ is over 3x the running mean [\d.]+$", console, re.M)


# ---------------------------------------------------------------------- Weights & Biases
class _FakeWandbRun:
    def __init__(self, **kwargs) -> None:
        self.kwargs, self.logged, self.finished = kwargs, [], 0
        self.id = kwargs.get("id") or "fake0001"

    def log(self, values: dict, step: int) -> None:
        self.logged.append((step, dict(values)))

    def finish(self) -> None:
        self.finished += 1


def _fake_wandb(runs: list) -> object:
    import types

    module = types.ModuleType("wandb")

    def init(**kwargs):
        runs.append(_FakeWandbRun(**kwargs))
        return runs[-1]
    module.init = init
    return module


def test_wandb_sink_gets_the_tensorboard_scalars_through_the_runtime(tmp_path, monkeypatch):
    from lmforge.metrics.sinks import WANDB_ID_FILE

    runs: list[_FakeWandbRun] = []
    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(runs))
    _, error = _in_process_run(tmp_path / "run", _loss_with({3: float("nan")}), steps=4, nonfinite="skip",
                               metrics={"wandb": True})
    assert error is None and len(runs) == 1
    run = runs[0]
    assert run.kwargs["config"]["training"]["nonfinite"] == "skip" and run.kwargs["dir"] == str(tmp_path / "run")
    steps_with_loss = [step for step, values in run.logged if "learning/loss" in values]
    assert steps_with_loss == [1, 4]
    assert (3, {"nonfinite_skip/skipped_updates": 1}) in run.logged
    assert any("goodput/productive" in values for _, values in run.logged)
    assert run.finished == 1
    # A resumed run logs into the same W&B run.
    assert (tmp_path / "run" / WANDB_ID_FILE).read_text() == "fake0001"
    from lmforge.metrics.sinks import WandbSink

    WandbSink.start(tmp_path / "run", {}).close()
    assert runs[-1].kwargs["id"] == "fake0001" and runs[-1].kwargs["resume"] == "allow"


def test_wandb_requested_but_not_installed_is_a_user_error(tmp_path, monkeypatch):
    from lmforge.errors import UserError
    from lmforge.metrics.sinks import WandbSink

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(UserError, match=r"metrics.wandb=true needs the wandb package: pip install 'lmforge\[wandb\]'"):
        WandbSink.start(tmp_path, {})


def test_wandb_offline_with_the_real_package(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from lmforge.metrics.sinks import WandbSink

    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    m = MetricLogger(tmp_path / "run", tensorboard=False, log_every=1, console=lambda line: None)
    m.sinks.append(WandbSink.start(tmp_path / "run", {"training": {"steps": 2}}))
    m.start_clock()
    m.record_step(1, 100, {"loss": torch.tensor(2.5), "total_weights": torch.tensor(100.0)})
    m.record_eval(1, {"loss": 2.25}, 0.1)
    m.close()
    files = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    for _ in range(100):  # W&B's writer process finishes the file a moment after finish() returns
        data = files[0].read_bytes()
        if b"eval/loss" in data:
            break
        time.sleep(0.1)
    for key in (b"learning/loss", b"eval/loss", b"perf/tokens_per_sec_per_device", b"goodput/productive"):
        assert key in data, key
