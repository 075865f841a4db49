"""``lmforge report`` on a real run directory, on several runs, and on a run still being written."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from lmforge.cli import main as cli_main
from lmforge.metrics import MetricLogger
from lmforge.metrics.records import iter_records, read_records
from lmforge.metrics.report import read_run

PARTIAL_LINE = '{"time": 1, "kind": "train", "step": 9, "lo'
"""The last line of a run killed while writing it."""
PLOTS = ("loss_vs_step", "loss_vs_tokens", "throughput", "learning_rate", "grad_norm", "goodput", "overview")


def assert_real_png(path: Path) -> None:
    """A valid PNG of sensible size that shows more than a blank canvas."""
    from PIL import Image

    assert path.stat().st_size > 5000, path
    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.format == "PNG" and im.width >= 400 and im.height >= 250
        colors = im.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colors is None or len(colors) > 50, (path, len(colors))


def test_report_on_a_real_run_directory(tmp_path, capsys, observed_run):
    run_dir, *_ = observed_run  # the session's one CLI run (conftest.py)
    out = tmp_path / "report"
    assert cli_main(["report", str(run_dir), "--out", str(out)]) == 0
    assert str(out / "report.md") in capsys.readouterr().out
    for name in PLOTS:
        assert_real_png(out / f"{name}.png")
    assert not (out / "reward.png").exists()  # no GRPO reward in a pretraining run
    md = (out / "report.md").read_text()
    records = read_records(run_dir)
    last_train = [r for r in records if r["kind"] == "train"][-1]
    last_eval = [r for r in records if r["kind"] == "eval"][-1]
    g = records[-1]
    line = next(line for line in md.splitlines() if line.startswith(f"| {run_dir.name} | finished |"))
    assert f"| 12 | {12 * 4 * 32:,} | {last_train['loss']:.4f} | {last_eval['loss']:.4f} |" in line
    assert f"{100 * g['productive'] / g['wall']:.1f}% |" in line
    assert "reached training.steps=12" in md
    for name in PLOTS:
        assert f"({name}.png)" in md


def _write_run(run_dir: Path, losses: dict[int, float], *, resume_at: int | None = None,
               redo: dict[int, float] | None = None, reward: bool = False, partial_line: bool = False) -> None:
    """A run written by the MetricLogger itself (log every step), optionally with a restart."""
    def attempt(values: dict[int, float], final: bool, resumed: bool = False) -> None:
        m = MetricLogger(run_dir, log_every=1, tensorboard=False, console=lambda line: None)
        m.log_setup({"trainer": "pretrain"}, "")
        if resumed:
            m.record_event("resume", resume_at, path="checkpoints/step_x")
        m.start_clock()
        for step, loss in values.items():
            metrics = {"loss": loss, "total_weights": 100.0, "lr": 1e-3, "grad_norm": 1.0}
            if reward:
                metrics["reward/mean"] = 1.0 - loss / 10
            m.record_step(step, 400, metrics)
        if reward:  # GRPO eval logs a reward too; it must not replace the rollouts' one of that step
            m.record_eval(max(values), {"loss": 1.5, "reward/mean": 0.5}, 0.1)
        if final:  # a crashed attempt leaves only its periodic goodput records
            m.log_goodput(max(values), final=True)
        m.close()

    attempt(losses, final=resume_at is None)
    if resume_at is not None:
        attempt(redo or {}, final=True, resumed=True)
    if partial_line:
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write(PARTIAL_LINE)


def test_redone_steps_replace_those_of_the_failed_attempt(tmp_path):
    _write_run(tmp_path / "a", {1: 5.0, 2: 4.0, 3: 3.0, 4: 2.5, 5: 9.0, 6: 9.5}, resume_at=4,
               redo={5: 2.2, 6: 2.1}, partial_line=True)
    run = read_run(tmp_path / "a")
    assert [(r["step"], r["loss"]) for r in run.train] == [(1, 5.0), (2, 4.0), (3, 3.0), (4, 2.5), (5, 2.2), (6, 2.1)]
    assert run.cumulative_tokens()[-1] == (6, 600.0)
    assert run.finished and [e["kind"] for e in run.events] == ["resume"]
    # Goodput adds up both processes: the crashed one's newest (periodic) record and the final one.
    skipped: list[str] = []
    records = list(iter_records(tmp_path / "a", skipped=skipped))
    assert skipped == [PARTIAL_LINE]  # the last line is half-written
    last_of_first = [r for r in records if r["kind"] == "goodput" and r["step"] == 6][0]
    final = records[-1]
    assert final["final"] and run.goodput["attempts"] == 2
    for key in ("wall", "productive", "first_step", "setup"):
        assert run.goodput[key] == pytest.approx(last_of_first[key] + final[key])


def test_several_runs_overlay_with_grpo_reward_and_a_running_run(tmp_path, observed_run):
    run_dir, *_ = observed_run
    _write_run(tmp_path / "grpo", {1: 3.0, 2: 2.0, 3: 1.0}, reward=True)
    running = tmp_path / "running"
    running.mkdir()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    cut = next(i for i, line in enumerate(lines) if '"kind": "eval"' in line)  # before the first eval
    (running / "metrics.jsonl").write_text("\n".join(lines[:cut]) + '\n{"time": 1, "kind": "tr')
    out = tmp_path / "cmp"
    assert cli_main(["report", str(run_dir), str(tmp_path / "grpo"), str(running), "--out", str(out)]) == 0
    for name in PLOTS + ("reward",):
        assert_real_png(out / f"{name}.png")
    md = (out / "report.md").read_text()
    assert "| running | running or interrupted |" in md and "| grpo | finished |" in md
    assert "| running (so far) |" in md  # goodput of a running run: the latest periodic record
    # Three runs, three colours on the loss plot: check through matplotlib's own drawing.
    import matplotlib.pyplot as plt

    from lmforge.metrics.report import panel_loss_vs_step, panel_reward, read_run as read

    fig, (ax, ax2) = plt.subplots(1, 2)
    runs = [read(p) for p in (run_dir, tmp_path / "grpo", running)]
    assert panel_loss_vs_step(ax, runs)
    assert {line.get_color() for line in ax.get_lines()} == {"C0", "C1", "C2"}
    assert panel_reward(ax2, runs)
    lines = {line.get_label(): list(line.get_ydata()) for line in ax2.get_lines()}
    assert lines == {"grpo rollouts": [0.7, 0.8, 0.9], "grpo eval": [0.5]}
    plt.close(fig)


def test_report_errors_are_one_line(tmp_path, capsys, monkeypatch):
    assert cli_main(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no metrics.jsonl" in err and len(err.splitlines()) == 1
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text('{"kind": "setup", "time": 1}\n')
    assert cli_main(["report", str(tmp_path / "empty")]) == 2
    assert "no train, eval or goodput records yet" in capsys.readouterr().err
    _write_run(tmp_path / "ok", {1: 2.0})
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if matplotlib were not installed
    assert cli_main(["report", str(tmp_path / "ok")]) == 2
    assert "pip install 'lmforge[report]'" in capsys.readouterr().err


def test_nan_losses_are_left_out_of_the_plots(tmp_path):
    _write_run(tmp_path / "n", {1: 3.0, 2: float("nan"), 3: 2.0})
    run = read_run(tmp_path / "n")
    from lmforge.metrics.report import _series

    assert _series(run.train, "loss") == ([1, 3], [3.0, 2.0])
    assert math.isnan(run.train[1]["loss"])
