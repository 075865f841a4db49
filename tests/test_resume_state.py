"""What a resume reads back besides tensors: token counts, the metrics file, the run's own files.

Each test runs the CLI's entry point (``lmforge.cli.main``, in this process: the same code path as
``lmforge``, without seconds of imports per run) on a tiny model; what it checks is named in the test.
A failed run's output is in the test's captured stdout/stderr.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from _helpers import TOKENS_PER_STEP, lmforge_in_process, tiny_run_args
from lmforge.checkpoint.layout import STATE_FILE
from lmforge.metrics.records import read_records


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"}


def _pretrain(run: Path, **overrides) -> None:
    assert lmforge_in_process("pretrain", *tiny_run_args(**overrides), f"--run.dir={run}") == 0


def test_token_count_survives_resume_between_log_steps_and_a_damaged_metrics_line(tmp_path):
    """A checkpoint between log steps counts every token it contains (interval 15, log every 10); a
    resumed run continues the count, and a torn line in metrics.jsonl does not block the resume."""
    run = tmp_path / "run"
    _pretrain(run, training_steps=15, checkpoint_interval=15, metrics_log_every=10)
    state = json.loads((run / "checkpoints" / "step_00000015" / STATE_FILE).read_text())
    assert state["tokens_seen"] == 15 * TOKENS_PER_STEP
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 1')  # torn by a crash mid-write
    _pretrain(run, training_steps=20, checkpoint_interval=15, metrics_log_every=10)
    final = json.loads((run / "checkpoints" / "step_00000020" / STATE_FILE).read_text())
    assert final["tokens_seen"] == 20 * TOKENS_PER_STEP
    assert [r["step"] for r in read_records(run, "train")][-1] == 20


def test_a_run_with_a_torn_model_args_file_resumes_and_exports(tmp_path):
    """model_args.json emptied by a crash of an older version: checkpoints describe themselves."""
    run = tmp_path / "run"
    _pretrain(run, training_steps=4)
    (run / "model_args.json").write_text("")
    _pretrain(run, training_steps=6)
    assert json.loads((run / "model_args.json").read_text())["model_args"]["n_layers"] == 2  # rewritten whole
    (run / "model_args.json").write_text("{")
    assert lmforge_in_process("export", str(run), "--hf", str(tmp_path / "hf")) == 0
    assert (tmp_path / "hf" / "config.json").is_file()


def test_starting_from_another_run_only_reads_it(tmp_path):
    """``--model.from_checkpoint=RUN`` must not repair, prune or lock anything inside RUN, even with a
    leftover of an interrupted replace (``step_X.old``) in it."""
    source = tmp_path / "source"
    _pretrain(source, training_steps=4, checkpoint_interval=2)
    newest = source / "checkpoints" / "step_00000004"
    newest.rename(newest.with_name(newest.name + ".old"))
    before = _digest(source)
    assert lmforge_in_process("sft", *tiny_run_args(training_steps=2, data_seq_len=64),
                              f"--model.from_checkpoint={source}", f"--run.dir={tmp_path / 'sft'}") == 0
    assert _digest(source) == before
    assert (source / "checkpoints" / "step_00000004.old").is_dir()
