"""Every bad input gets one clear line, a non-zero exit, and harms nothing already saved.

Each case runs the real CLI against its own copy of a finished run directory and checks: exit code
2, exactly one ``error:`` line on stderr naming the problem, no traceback, and every file the earlier
run saved byte-identical afterwards.

A case refused by config loading or a start-up check runs the CLI's entry point, ``lmforge.cli.main``,
in the test's own process (a subprocess would spend seconds importing torch for a millisecond's
check). The cases a real process matters to run as subprocesses, concurrently with the others: a
fault injected by the fault runner, a run directory held by another live process.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from _helpers import RELIABLE_STEPS as STEPS, finish, lmforge_in_process, reliable_run_args, start_reliable_run
from lmforge.errors import UserError
from lmforge.checkpoint.runlock import hold_run_lock, release_run_lock


@dataclass
class Case:
    args: Callable[[Path, Path], list[str]]
    """(run dir copy, scratch dir) -> extra CLI arguments."""
    expect: list[str]
    """Substrings of the error line."""
    fault: str = ""
    guarded: Callable[[Path], Path] = lambda run: run
    """What must be unchanged: the whole run directory, or a part of it (a run that trained a little)."""
    files: dict[str, bytes] = field(default_factory=dict)
    """Input files to create in the scratch dir."""
    process: bool = False
    """Needs a CLI process of its own (another live process...); a case with a ``fault`` always does
    (the fault runner injects it). Else the case runs in-process."""


def _tokenizer_dir(scratch: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(498)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out = scratch / "tok500"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    return out


def _newest(run: Path) -> Path:
    return sorted((run / "checkpoints").glob("step_*"))[-1]


def _edit_state(run: Path, **changes) -> None:
    """Hand-edit the newest checkpoint's trainer state and re-seal its manifest (so only the state
    checks, not the checksums, stand between the edit and a resume)."""
    from lmforge.checkpoint.verify import write_manifest

    ckpt = _newest(run)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    for key, value in changes.items():
        if value is _DROP:
            state.pop(key)
        else:
            state[key] = value
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    write_manifest(ckpt, False)


def _hostile_metadata(run: Path) -> None:
    from lmforge.checkpoint.verify import write_manifest

    ckpt = _newest(run)
    (ckpt / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(run.parent / "code_ran"))))
    write_manifest(ckpt, False)


def _truncate_shard(run: Path) -> None:
    shard = sorted(_newest(run).glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


_DROP = object()


def _mutate(fn: Callable[[Path], None], args: list[str]) -> Callable[[Path, Path], list[str]]:
    """A case that first changes the saved run (before its files are fingerprinted), then runs ``args``."""
    def prepare(run: Path, scratch: Path) -> list[str]:
        fn(run)
        return args
    return prepare


OTHER_TEXT = b"".join(b"a different corpus, line %d, with enough words to pack a few windows\n" % i
                      for i in range(60))

CASES: dict[str, Case] = {
    "unknown_key": Case(lambda r, s: ["--training.stesp=5"],
                        ["unknown config key `training.stesp`", "did you mean `training.steps`"]),
    "wrong_type": Case(lambda r, s: ["--training.steps=many"], ["`training.steps`", "integer", "'many'"]),
    "out_of_range": Case(lambda r, s: ["--optimizer.lr=-0.1"], ["`optimizer.lr`", "greater than 0"]),
    "missing_data_file": Case(lambda r, s: [f"--data.train={s}/nope.txt"], ["data file not found", "nope.txt"]),
    "empty_dataset": Case(lambda r, s: [f"--data.train={s}/empty.txt"], ["no documents in", "empty.txt"],
                          files={"empty.txt": b"\n\n  \n"}),
    "non_utf8_text": Case(lambda r, s: [f"--data.train={s}/latin1.txt"], ["latin1.txt:3:", "not valid UTF-8"],
                          files={"latin1.txt": b"first line\n\ncaf\xe9 au lait\n"}),
    "malformed_jsonl": Case(lambda r, s: [f"--data.train={s}/docs.jsonl"], ["docs.jsonl:2:", "invalid JSON"],
                            files={"docs.jsonl": b'{"text": "one"}\n{"text": "two"\n{"text": "three"}\n'}),
    "sequence_too_long": Case(lambda r, s: ["--data.seq_len=4096"],
                              ["data.seq_len=4096", "longer than the model allows", "max_seq_len=1024"]),
    "tokenizer_vocab_mismatch": Case(lambda r, s: [f"--model.tokenizer={_tokenizer_dir(s)}"],
                                     ["tokenizer's vocabulary (500)", "checkpoints' (320)"]),
    "incompatible_model": Case(lambda r, s: ["--model.n_layers=3"],
                               ["holds checkpoints of another model", "n_layers: 2 there, 3 now"]),
    "unwritable_run_dir": Case(lambda r, s: [f"--run.dir={r}/config.toml/inner"],
                               ["config.toml/inner", "cannot write the run directory"]),
    "disk_full_during_checkpoint": Case(lambda r, s: [f"--training.steps={STEPS + 2}"],
                                        [f"checkpoint save at step {STEPS + 2} failed", "No space left on device",
                                         f"step_{STEPS:08d} is intact"],
                                        fault="disk_full:20000", guarded=lambda run: run / "checkpoints"),
    "run_dir_held_by_live_run": Case(lambda r, s: [], ["is in use by another live run", "pid "], process=True),
    # Refused before anything is written: the run directory stays byte-identical.
    "resume_never_onto_checkpoints": Case(lambda r, s: ["--checkpoint.resume=never"],
                                          ["checkpoint.resume=never", "already holds checkpoints"]),
    "resume_with_other_data": Case(lambda r, s: [f"--data.train={s}/other.txt"],
                                   ["trained on other data", "checkpoint.on_data_change=continue"],
                                   files={"other.txt": OTHER_TEXT}),
    "resume_with_other_seq_len": Case(lambda r, s: ["--data.seq_len=16"], ["trained on other data", "data.seq_len"]),
    "batch_not_divisible": Case(lambda r, s: ["--training.global_batch_size=5"],
                                ["training.global_batch_size (5)", "divisible"]),
    "one_byte_data_file": Case(lambda r, s: [f"--data.train={s}/one.txt"], ["data.train=", "one.txt", "not enough data"],
                               files={"one.txt": b"x"}),
    "validation_smaller_than_eval_batch": Case(
        lambda r, s: [f"--data.validation={s}/small.txt", "--eval.interval=2", "--eval.batch_size=64"],
        ["data.validation=", "small.txt", "fewer than one eval batch"], files={"small.txt": OTHER_TEXT[:400]}),
    "negative_seed": Case(lambda r, s: ["--training.seed=-1"], ["`training.seed`", "greater than or equal to 0"]),
    "huge_seed": Case(lambda r, s: ["--training.seed=100000000000000000000"], ["`training.seed`", "less than"]),
    "infinite_lr": Case(lambda r, s: ["--optimizer.lr=inf"], ["`optimizer.lr`", "finite"]),
    "cuda_without_cuda": Case(lambda r, s: ["--training.device=cuda"], ["training.device=cuda", "CUDA is not available"]),
    "section_of_wrong_type": Case(lambda r, s: [f"--config={s}/bad.toml"], ["bad.toml", "config key `training`"],
                                  files={"bad.toml": b"training = [1, 2]\n"}),
    "damaged_checkpoint_with_stop": Case(_mutate(_truncate_shard, ["--checkpoint.on_damaged=stop"]),
                                         ["is damaged", "checkpoint.on_damaged=stop"]),
    "hostile_metadata": Case(_mutate(_hostile_metadata, []), ["refused .metadata", "not allowed"]),
    "state_step_a_string": Case(_mutate(lambda r: _edit_state(r, step="twelve"), []), ["'step' must be", "'twelve'"]),
    "state_step_huge": Case(_mutate(lambda r: _edit_state(r, step=10**12), []), ["directory is for step"]),
    "state_without_step": Case(_mutate(lambda r: _edit_state(r, step=_DROP), []), ["'step' must be", "None"]),
    "metrics_file_is_a_directory": Case(
        _mutate(lambda r: ((r / "metrics.jsonl").unlink(), (r / "metrics.jsonl").mkdir()), []),
        ["cannot write the run's metrics"]),
    "tensorboard_is_a_file": Case(_mutate(lambda r: (r / "tensorboard").write_text("x"), ["--metrics.tensorboard=true"]),
                                  ["cannot write the run's metrics"]),
    "path_too_long": Case(lambda r, s: [f"--run.dir={s}/{'d' * 4000}"], ["cannot write the run directory"]),
}


def digest(root: Path) -> dict[str, str]:
    """Every saved file's hash; ``.lock`` only names the latest process to take the lock, so it is left out."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}


def cli(runner: Path, run_dir: Path, extra: list[str], fault: str = "", steps: int = STEPS,
        wait: bool = True):
    proc = start_reliable_run(runner, run_dir, *extra, fault=fault, training_steps=steps)
    return finish(proc, timeout=400) if wait else proc


def wait_until_paused(proc: subprocess.Popen, run_dir: Path) -> None:
    deadline = time.monotonic() + 240
    while not list((run_dir / "checkpoints").glob("*.partial/manifest.json")):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "the holding run never reached its save"
        time.sleep(0.05)


HELD = "run_dir_held_by_live_run"
IN_PROCESSES = [name for name, case in CASES.items() if case.process or case.fault]
IN_PROCESS = [name for name in CASES if name not in IN_PROCESSES]


def prepare(base: Path, saved: Path, name: str) -> tuple[Path, list[str]]:
    """A copy of the saved run and the case's input files: (run dir, the case's extra CLI arguments)."""
    case = CASES[name]
    run, scratch = base / name / "run", base / name / "inputs"
    shutil.copytree(saved, run)
    scratch.mkdir()
    for fname, data in case.files.items():
        (scratch / fname).write_bytes(data)
    return run, case.args(run, scratch)


@pytest.fixture(scope="module")
def subprocess_outcomes(tmp_path_factory, fault_runner, reference_run):
    """The cases that need a process of their own, started at once in the background (the in-process
    cases run meanwhile): name -> future of (exit code, stdout, stderr, digest before, digest after, run)."""
    base = tmp_path_factory.mktemp("bad_inputs")
    saved = reference_run.path()
    prepared = {name: prepare(base, saved, name) for name in IN_PROCESSES}
    before = {name: digest(CASES[name].guarded(prepared[name][0])) for name in IN_PROCESSES}
    holder = cli(fault_runner, prepared[HELD][0], ["--checkpoint.interval=1"], fault="pause_before_commit:600",
                 steps=STEPS * 10, wait=False)  # a live run on that directory, paused inside a save

    def attempt(name: str):
        run, extra = prepared[name]
        if name == HELD:
            try:
                wait_until_paused(holder, run)
                before[name] = digest(run)  # the holder changed it before pausing; nothing may change now
                result = cli(fault_runner, run, extra, fault=CASES[name].fault)
                after = digest(run)
            finally:
                holder.send_signal(signal.SIGKILL)
                holder.communicate()
        else:
            result = cli(fault_runner, run, extra, fault=CASES[name].fault)
            after = digest(CASES[name].guarded(run))
        return (*result, before[name], after, run)

    pool = ThreadPoolExecutor(max_workers=len(IN_PROCESSES))
    try:
        yield {name: pool.submit(attempt, name) for name in IN_PROCESSES}
    finally:
        pool.shutdown(wait=True)
        if holder.poll() is None:
            holder.send_signal(signal.SIGKILL)
            holder.communicate()


def check(name: str, rc: int, out: str, err: str, before: dict, after: dict, run: Path) -> None:
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2, (rc, out[-2000:], err[-3000:])
    assert len(errors) == 1, err[-3000:]
    for words in CASES[name].expect:
        assert words in errors[0], (words, errors[0])
    assert "Traceback" not in err, err[-3000:]
    assert before == after, "saved files changed"
    assert not list(run.glob("checkpoints/*.partial")) or name == HELD
    assert not (run.parent / "code_ran").exists(), "a checkpoint's pickle ran code"


@pytest.mark.parametrize("name", IN_PROCESS + IN_PROCESSES)  # the subprocesses' results last: they run meanwhile
def test_bad_input_fails_in_one_line_and_harms_nothing(request, reference_run, tmp_path, capfd, name):
    if name in IN_PROCESSES:
        check(name, *request.getfixturevalue("subprocess_outcomes")[name].result(timeout=600))
        return
    selected = {item.callspec.params.get("name") for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")}
    if selected & set(IN_PROCESSES):  # start them now, to run while the in-process cases do
        request.getfixturevalue("subprocess_outcomes")
    run, extra = prepare(tmp_path, reference_run.path(), name)
    before = digest(CASES[name].guarded(run))
    capfd.readouterr()
    rc = lmforge_in_process(*reliable_run_args(run, *extra, training_steps=STEPS))
    out, err = capfd.readouterr()
    check(name, rc, out, err, before, digest(CASES[name].guarded(run)), run)


def test_lock_of_a_killed_run_does_not_block(tmp_path):
    """flock dies with its process: a SIGKILLed holder leaves a .lock file but no lock."""
    code = ("import sys, time; from lmforge.checkpoint.runlock import hold_run_lock; hold_run_lock(sys.argv[1]); "
            "print('held', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match="in use by another live run"):
            hold_run_lock(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (tmp_path / ".lock").is_file()
    hold_run_lock(tmp_path)
    release_run_lock(tmp_path)
