"""MetricLogger: step-time rules, sinks (console, JSONL, real TensorBoard events), no eager reads."""

import json
import time

import pytest
import torch

from lmforge.metrics import MetricLogger, format_train_line
from lmforge.metrics.records import read_records


class Poison:
    """A metric value that fails if anything reads it (it must stay untouched on non-log steps)."""

    def __float__(self):
        raise AssertionError("metric read on a non-log step")


def test_timed_work_is_excluded_from_step_seconds(tmp_path):
    lines = []
    m = MetricLogger(tmp_path, log_every=1, flops_per_token=100.0, peak_flops=1e6, tensorboard=False,
                     console=lines.append)
    m.start_clock()
    time.sleep(0.05)
    m.record_step(1, tokens=1000, metrics={"loss": torch.tensor(2.0), "total_weights": torch.tensor(1000.0)})
    with m.timed("checkpoint_save"):
        time.sleep(0.3)
    time.sleep(0.05)
    rec = m.record_step(2, tokens=1000, metrics={"loss": torch.tensor(1.0), "total_weights": torch.tensor(1000.0)})
    assert 0.04 < rec["seconds"] < 0.2, rec["seconds"]
    assert rec["tokens_per_sec_per_device"] == pytest.approx(1000 / rec["seconds"])
    assert rec["tflops_per_device"] == pytest.approx(100.0 * 1000 / rec["seconds"] / 1e12)
    assert m.goodput["checkpoint_save"] >= 0.3
    assert "first step" in lines[0] and "first step" not in lines[1]
    m.close()


def test_setup_time_before_clock_is_not_a_step(tmp_path):
    m = MetricLogger(tmp_path, log_every=1, tensorboard=False, console=lambda s: None)
    time.sleep(0.2)  # model build, restore...
    m.start_clock()
    rec = m.record_step(1, tokens=10, metrics={"loss": 1.0})
    assert rec["seconds"] < 0.1 and rec["first_step"]
    assert m.goodput["setup"] >= 0.2
    m.close()


def test_non_log_steps_read_nothing_and_log_steps_average_the_window(tmp_path):
    m = MetricLogger(tmp_path, log_every=4, tensorboard=False, console=lambda s: None)
    m.start_clock()
    assert m.record_step(1, tokens=10, metrics={"loss": 1.0}) is not None  # first step: always logged
    for step in (2, 3):
        assert m.record_step(step, tokens=10, metrics={"loss": Poison()}) is None
    rec = m.record_step(4, tokens=10, metrics={"loss": torch.tensor(0.5)})
    assert rec["steps_averaged"] == 3 and rec["loss"] == 0.5
    m.close()


def test_sinks_jsonl_console_and_tensorboard(tmp_path):
    lines = []
    m = MetricLogger(tmp_path, log_every=1, flops_per_token=10.0, peak_flops=1e9, console=lines.append)
    m.log_setup({"parameters": 123}, "[training]\nsteps = 2\n")
    m.start_clock()
    for step in (1, 2):
        m.record_step(step, tokens=64, metrics={"loss": torch.tensor(3.0 - step), "total_weights": torch.tensor(60.0),
                                                "lr": 0.1, "grad_norm": torch.tensor(1.5)})
    m.record_eval(2, {"loss": torch.tensor(1.25), "total_weights": torch.tensor(100.0)}, seconds=0.5)
    m.close()
    recs = read_records(tmp_path / "metrics.jsonl")
    assert [r["kind"] for r in recs] == ["setup", "train", "goodput", "train", "goodput", "eval"]  # goodput every log
    recs = [r for r in recs if r["kind"] != "goodput"]
    assert recs[2]["loss"] == 1.0 and recs[2]["total_weights"] == 60.0 and recs[3]["loss"] == 1.25
    assert lines[-1].startswith("eval metrics after step: 2, loss=1.25, total_weights=100")
    assert lines[-2].startswith("completed step: 2, seconds: ") and "total_weights: 60, loss: 1.0000, lr: 0.1" in lines[-2]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"learning/loss", "learning/lr", "learning/grad_norm", "perf/tokens_per_sec_per_device",
            "perf/tflops_per_device", "eval/loss", "eval/total_weights"} <= tags
    assert [e.value for e in acc.Scalars("learning/loss")] == [2.0, 1.0]


def test_only_rank0_writes(tmp_path):
    lines = []
    m = MetricLogger(tmp_path / "r1", rank=1, world_size=2, tensorboard=True, console=lines.append)
    m.start_clock()
    m.record_step(1, tokens=1, metrics={"loss": 1.0})
    m.close()
    assert not (tmp_path / "r1").exists() and lines == []


def test_goodput_adds_up_to_wall(tmp_path):
    m = MetricLogger(tmp_path, log_every=1, tensorboard=False, console=lambda s: None, process_start=time.time())
    time.sleep(0.05)
    m.start_clock()
    for s in range(1, 4):
        time.sleep(0.02)
        m.record_step(s, tokens=1, metrics={"loss": 1.0}, data_wait=0.005)
        with m.timed("eval"):
            time.sleep(0.02)
    g = m.goodput_summary()
    parts = sum(v for k, v in g.items() if k != "wall")
    assert parts == pytest.approx(g["wall"], rel=0.01)
    assert g["data_wait"] == pytest.approx(0.01) and g["eval"] >= 0.06
    m.close()


def test_train_line_format():
    line = format_train_line({"step": 5, "seconds": 0.5, "tflops_per_device": 0.1, "tokens_per_sec_per_device": 800.0,
                              "total_weights": 400.0, "loss": 2.0, "lr": 0.001, "grad_norm": 0.5, "mfu": 0.25})
    assert line.startswith("completed step: 5, seconds: 0.500, TFLOP/s/device: 0.100, Tokens/s/device: 800.0, "
                           "total_weights: 400, loss: 2.0000, lr: 0.001, grad_norm: 0.5")
    assert line.endswith("mfu: 25.0%")


def test_train_line_shows_only_the_trainers_chosen_fields():
    """Every field reaches JSONL/TensorBoard; the console line keeps the shared ones and the trainer's few."""
    rec = {"step": 5, "seconds": 0.5, "tflops_per_device": 0.1, "tokens_per_sec_per_device": 800.0,
           "total_weights": 400.0, "loss": 2.0, "lr": 0.001, "grad_norm": 0.5, "mfu": 0.25,
           "reward/mean": 0.75, "grpo/kl": 0.01, "grpo/entropy": 0.3, "reward/format": 1.0, "accuracy": 0.5}
    line = format_train_line(rec, ("reward/mean", "grpo/kl"))
    assert line.startswith("completed step: 5, seconds: 0.500, TFLOP/s/device: 0.100, Tokens/s/device: 800.0, "
                           "total_weights: 400, loss: 2.0000, lr: 0.001, grad_norm: 0.5, reward/mean: 0.75, grpo/kl: 0.01")
    assert "entropy" not in line and "reward/format" not in line and "accuracy" not in line
    assert "accuracy: 0.5" in format_train_line(rec)  # the next-token trainers' default


def test_a_full_disk_while_logging_is_one_line(tmp_path):
    import errno

    from lmforge.errors import UserError

    class FullDisk:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

        def close(self):
            pass

    m = MetricLogger(tmp_path, log_every=1, tensorboard=False, console=lambda s: None)
    m._jsonl = FullDisk()
    with pytest.raises(UserError, match=r"cannot write .*metrics\.jsonl \(No space left on device\)"):
        m.record_event("note", 0, "hello")


def test_deferred_logger_writes_nothing_until_opened(tmp_path):
    m = MetricLogger(tmp_path / "run", log_every=1, tensorboard=True, console=lambda s: None, defer=True)
    m.log_setup({"trainer": "x"}, "a = 1")
    m.record_event("note", 0, "before open")
    assert not (tmp_path / "run").exists()
    m.open()
    m.record_event("note", 1, "after open")
    m.close()
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert kinds == ["setup", "note", "note"]
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
