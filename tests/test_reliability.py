"""Crash anywhere, resume exactly; damaged checkpoints are detected; loading never runs code.

The end-to-end tests drive the real CLI in subprocesses through a small runner that can inject
faults (a pause inside a checkpoint save, so a SIGKILL lands mid-save; a disk that fills up). The
runner (``_helpers.FAULT_RUNNER``, the ``fault_runner`` fixture) patches only test hooks; the
training code is the shipped one. The uninterrupted run is the session's ``reference_run``.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from _helpers import RELIABLE_STEPS as STEPS, finish, start_reliable_run
from lmforge.metrics.records import read_records
from lmforge.checkpoint import checkpointer as ckpt_mod
from lmforge.checkpoint.checkpointer import Checkpointer, checkpoint_problem, list_checkpoints
from lmforge.checkpoint.dcp_safe import safe_loading_classes
from lmforge.checkpoint.verify import write_manifest
from lmforge.errors import UserError
from lmforge.models.model import ModelArgs, Transformer
from lmforge.checkpoint.runlock import hold_run_lock, release_run_lock
from lmforge.optim.adamw import build_optimizer


def wait_for(proc: subprocess.Popen, condition, timeout: float = 240) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.01)
    raise TimeoutError("condition never met")


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.communicate()


def full_state(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the newest checkpoint: model weights and AdamW moments."""
    args = ModelArgs.from_dict(json.loads((run_dir / "model_args.json").read_text())["model_args"])
    model = Transformer(args)
    opt = build_optimizer(model, 1e-3, 0.1, (0.9, 0.95), 1e-8)
    c = Checkpointer(run_dir)
    c.load(c.latest(), model, opt)
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"optim.{i}.{k}": v for k, v in st.items() if torch.is_tensor(v)})
    return out


@pytest.fixture(scope="module")
def reference_and_crashed(tmp_path_factory, fault_runner, reference_run, stop_run):
    """One uninterrupted run, and the same run killed with SIGKILL four times and restarted; before the
    last restart its newest checkpoint is also truncated, so the run must fall back and still match."""
    crash_dir = tmp_path_factory.mktemp("reliability") / "crashed"
    rng = random.Random(8)
    kills: list[str] = []

    def logged_step() -> int:
        return max((r["step"] for r in read_records(crash_dir, "train")), default=0)

    def partial(with_manifest: bool):
        def seen() -> bool:
            root = crash_dir / "checkpoints"
            parts = list(root.glob("step_*.partial")) if root.is_dir() else []
            return bool(list_checkpoints(root)) and any(  # a save with a complete one before it
                (p / ckpt_mod.MANIFEST_FILE).is_file() == with_manifest and (p / ckpt_mod.STATE_FILE).is_file()
                for p in parts)
        return seen

    plan = [("step", ""), ("save", "pause_before_commit:0.6"), ("step", ""), ("save", "pause_before_manifest:0.6")]
    for what, fault in plan:
        proc = start_reliable_run(fault_runner, crash_dir, fault=fault)
        if what == "step":
            target = logged_step() + rng.randint(1, 3)
            hit = wait_for(proc, lambda: logged_step() >= target)
            time.sleep(rng.uniform(0.0, 0.05))  # anywhere inside the following step
        else:
            hit = wait_for(proc, partial(with_manifest=fault.startswith("pause_before_commit")))
        assert hit, f"run ended before the kill ({what}): {finish(proc)[2][-2000:]}"
        kill(proc)
        kills.append(f"{what} after step {logged_step()}")
        reference_run.poll()
        for c in list_checkpoints(crash_dir / "checkpoints"):  # every committed checkpoint stays intact
            assert checkpoint_problem(c) is None, (c, kills)
        if what == "save":
            assert list_checkpoints(crash_dir / "checkpoints"), "the previous checkpoint vanished mid-save"
    newest = list_checkpoints(crash_dir / "checkpoints")[-1]
    shard = next(newest.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])  # truncated, as by a full disk during a copy
    kills.append(f"truncated {newest.name}")
    rc, out, err = finish(start_reliable_run(fault_runner, crash_dir))
    assert rc == 0, err[-3000:]
    return reference_run.path(), crash_dir, kills, out


def test_killed_run_logs_exactly_the_uninterrupted_losses(reference_and_crashed):
    ref_dir, crash_dir, kills, _ = reference_and_crashed
    ref = {r["step"]: r for r in read_records(ref_dir, "train")}
    assert sorted(ref) == list(range(1, STEPS + 1))
    crashed = read_records(crash_dir, "train")
    assert {r["step"] for r in crashed} == set(ref)
    assert len(crashed) > STEPS, "no step was redone: the kills landed nowhere"
    for r in crashed:  # every attempt's record of a step, redone or not, matches bit for bit
        for key in ("loss", "grad_norm", "lr", "total_weights", "accuracy"):
            assert r[key] == ref[r["step"]][key], (key, r["step"], kills)


def test_killed_run_ends_with_exactly_the_uninterrupted_weights(reference_and_crashed):
    ref_dir, crash_dir, kills, out = reference_and_crashed
    assert "resumed from" in out
    ref, crashed = full_state(ref_dir), full_state(crash_dir)
    assert ref.keys() == crashed.keys() and len(ref) > 10
    for k in ref:
        assert torch.equal(ref[k], crashed[k]), (k, kills)
    assert not list((crash_dir / "checkpoints").glob("*.partial"))


def test_damaged_newest_checkpoint_falls_back_in_one_line(reference_and_crashed):
    _, crash_dir, kills, out = reference_and_crashed
    warnings = [x for x in out.splitlines() if x.startswith("warning:")]
    damaged = kills[-1].split()[-1]
    assert len(warnings) == 1 and damaged in warnings[0] and "truncated" in warnings[0], out
    assert (crash_dir / "checkpoints" / (damaged + ".damaged")).is_dir()
    assert read_records(crash_dir, "checkpoint_damaged")


@pytest.fixture(scope="module")
def stop_run(reference_run, fault_runner, tmp_path_factory):
    """A copy of the reference run whose newest checkpoint lost trainer_state.json, resumed with
    on_damaged=stop (started early so it overlaps other tests' work)."""
    run = tmp_path_factory.mktemp("damaged") / "stop"
    launched: dict = {}

    def launch(ref_dir: Path) -> None:
        shutil.copytree(ref_dir, run)
        (list_checkpoints(run / "checkpoints")[-1] / ckpt_mod.STATE_FILE).unlink()
        launched["before"] = snapshot(run / "checkpoints")
        launched["proc"] = start_reliable_run(fault_runner, run, checkpoint_on_damaged="stop",
                                              training_steps=STEPS + 2)

    reference_run.when_done(launch)
    return run, launched


def test_damaged_checkpoint_with_on_damaged_stop_exits_2(reference_run, stop_run):
    reference_run.path()
    run, launched = stop_run
    before, proc = launched["before"], launched["proc"]
    rc, out, err = finish(proc)
    assert rc == 2, (out, err)
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "damaged" in lines[0] and "trainer_state.json is missing" in lines[0], err
    assert "Traceback" not in err
    assert snapshot(run / "checkpoints") == before


def step_of(p: Path) -> int:
    return int(p.name[5:])


def snapshot(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): hash(p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------- in-process, fast
class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def two_checkpoints(tmp_path: Path) -> tuple[Checkpointer, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    c = Checkpointer(tmp_path, keep=3)
    for step in (1, 2):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        c.save(step, model, opt, {"data": {"samples_consumed": step}})
    return c, model, opt


def _truncate(p: Path) -> None:
    f = p / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:-7])


def _flip_byte(p: Path) -> None:
    f = p / "__0_0.distcp"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))


def _drop_state(p: Path) -> None:
    (p / ckpt_mod.STATE_FILE).unlink()


def _drop_manifest(p: Path) -> None:
    (p / ckpt_mod.MANIFEST_FILE).unlink()


@pytest.mark.parametrize("damage, words", [
    (_truncate, "truncated"), (_flip_byte, "corrupted"), (_drop_state, "trainer_state.json is missing"),
    (_drop_manifest, "no manifest.json"),
])
def test_damage_is_detected_reported_once_and_set_aside(tmp_path, damage, words):
    c, model, opt = two_checkpoints(tmp_path)
    newest = c.latest()
    assert newest.name == "step_00000002"
    damage(newest)
    lines: list[str] = []
    assert Checkpointer(tmp_path, report=lines.append).latest().name == "step_00000001"  # a reader: skips only
    assert newest.is_dir() and len(lines) == 1 and "skipped it" in lines[0]
    lines.clear()
    hold_run_lock(tmp_path)  # the run that owns the directory sets the damaged checkpoint aside
    try:
        found = Checkpointer(tmp_path, on_damaged="fallback", report=lines.append).latest()
    finally:
        release_run_lock(tmp_path)
    assert found is not None and found.name == "step_00000001"
    assert len(lines) == 1 and words in lines[0] and "\n" not in lines[0], lines
    assert (tmp_path / "checkpoints" / "step_00000002.damaged").is_dir()
    assert Checkpointer(tmp_path).load(found, model, opt)["data"]["samples_consumed"] == 1


def test_on_damaged_stop_raises_one_line_and_moves_nothing(tmp_path):
    c, *_ = two_checkpoints(tmp_path)
    _flip_byte(c.latest())
    with pytest.raises(UserError, match="damaged.*corrupted.*on_damaged=stop"):
        Checkpointer(tmp_path, on_damaged="stop").latest()
    assert (tmp_path / "checkpoints" / "step_00000002").is_dir()


def _reseal(p: Path) -> None:
    """Rewrite the manifest to match the files, as someone able to edit the directory could."""
    (p / ckpt_mod.MANIFEST_FILE).unlink()
    write_manifest(p, collective=False)


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_hostile_metadata_pickle_is_refused_without_running_code(tmp_path):
    c, model, opt = two_checkpoints(tmp_path)
    newest = c.latest()
    marker = tmp_path / "code_ran"
    (newest / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(marker))))
    _reseal(newest)  # checksums match: only the restricted unpickler stands in the way
    with pytest.raises(UserError, match="not allowed"):
        Checkpointer(tmp_path).load(newest, model, opt)
    assert not marker.exists()


def test_non_tensor_values_are_read_weights_only(tmp_path):
    marker = tmp_path / "code_ran"
    planner = safe_loading_classes()[1]()
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(None, io.BytesIO(pickle.dumps(_RunsCode(str(marker)), protocol=2)))
    assert not marker.exists()


def test_disk_full_during_save_keeps_previous_and_cleans_partial(tmp_path, monkeypatch):
    c, model, opt = two_checkpoints(tmp_path)
    before = snapshot(tmp_path / "checkpoints")

    def full_disk(*args, **kwargs):
        partial = Path(kwargs["checkpoint_id"])
        (partial / "__0_0.distcp").write_bytes(b"\0" * 100)  # a half-written shard
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(partial / "__0_0.distcp"))

    import torch.distributed.checkpoint as dcp

    monkeypatch.setattr(dcp, "save", full_disk)
    with pytest.raises(UserError) as e:
        c.save(3, model, opt, {})
    msg = str(e.value)
    assert "step 3 failed: No space left on device" in msg and "step_00000002 is intact" in msg
    assert "\n" not in msg
    assert snapshot(tmp_path / "checkpoints") == before  # no .partial left, nothing else touched


def test_full_disk_reported_without_errno_is_named(tmp_path, monkeypatch):
    """torch's zip writer reports a short write on a full disk as "unexpected pos N vs M", no errno
    (seen in bench/soak.py on a full tmpfs): the message says the file system is full."""
    c, model, opt = two_checkpoints(tmp_path)
    import torch.distributed.checkpoint as dcp

    def short_write(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(dcp, "save", short_write)
    monkeypatch.setattr(ckpt_mod.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 << 20, 10 << 20, 512))
    with pytest.raises(UserError, match=r"unexpected pos 704 vs 598 \(its file system is full: 512 bytes free\)"):
        c.save(3, model, opt, {})
    monkeypatch.setattr(ckpt_mod.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 << 20, 0, 10 << 20))
    with pytest.raises(UserError) as e:  # room enough: some other failure, said as it is
        c.save(3, model, opt, {})
    assert "full" not in str(e.value)


def test_interrupted_replace_of_a_step_is_recovered(tmp_path):
    c, *_ = two_checkpoints(tmp_path)
    newest = c.latest()
    os.replace(newest, newest.with_name(newest.name + ".old"))  # killed between the two renames
    assert Checkpointer(tmp_path).latest() == newest


def test_resaving_over_a_symlinked_checkpoint_commits_and_leaves_the_target(tmp_path):
    c, model, opt = two_checkpoints(tmp_path)
    newest = c.latest()
    elsewhere = tmp_path / "archive" / newest.name
    shutil.move(str(newest), elsewhere)
    newest.symlink_to(elsewhere, target_is_directory=True)  # e.g. checkpoints kept on another disk
    before = snapshot(elsewhere)
    c.save(2, model, opt, {"data": {"samples_consumed": 2}})  # a redone step saved again: no error
    assert newest.is_dir() and not newest.is_symlink() and checkpoint_problem(newest) is None
    assert snapshot(elsewhere) == before
