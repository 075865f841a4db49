"""Bad inputs around models, in one line: a LoRA base moved or changed, degenerate preference pairs,
bad task YAMLs for ``lmforge eval``, exports onto existing places or cut off, and a router that sends
every token to one expert or produces NaN.

Everything runs through the CLI's entry point in this process (``lmforge_in_process``) and checks what
``tests/test_bad_inputs.py`` checks of every bad input: exit status 2, exactly one ``error:`` line
naming the problem, no traceback, and the files already saved unchanged.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from _helpers import lmforge_in_process, tiny_run_args, write_corpus
from test_bad_inputs import digest

LORA = dict(lora_enabled=True, lora_rank=4, lora_alpha=8, optimizer_lr=1e-2)


def _one_error_line(rc: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (rc, err[-3000:])
    return lines[0]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


# ---------------------------------------------------------------------------- LoRA on a moved or changed base
def _base(corpus: Path, run: Path, seed: int) -> Path:
    assert lmforge_in_process("pretrain", *tiny_run_args(corpus, training_steps=2, training_seed=seed),
                              f"--run.dir={run}") == 0
    return run / "checkpoints" / "step_00000002"


def test_a_lora_base_is_known_by_its_weights_not_its_path(corpus, tmp_path, capfd):
    """Moved: the resume finds it again at its new path (same weights); an export that still looks at
    the old path says which base it needs. Replaced by other weights at the same path: the resume and
    the export are refused in one line, nothing written."""
    base = _base(corpus, tmp_path / "base", seed=0)
    lora_args = lambda steps, start: [*tiny_run_args(corpus, training_steps=steps, **LORA),  # noqa: E731
                                      f"--model.from_checkpoint={start}", f"--run.dir={tmp_path / 'lora'}"]
    assert lmforge_in_process("pretrain", *lora_args(2, base)) == 0
    moved = tmp_path / "moved"
    shutil.move(tmp_path / "base", moved)
    capfd.readouterr()
    assert lmforge_in_process("export", "--hf", tmp_path / "hf", tmp_path / "lora") == 2
    line = _one_error_line(2, capfd.readouterr().err)
    assert f"base model checkpoint:{base}" in line and "no longer exists" in line, line
    assert not (tmp_path / "hf").exists()

    rc = lmforge_in_process("pretrain", *lora_args(4, moved / "checkpoints" / "step_00000002"))
    out, err = capfd.readouterr()
    assert rc == 0 and "resumed from" in out, err[-3000:]

    shutil.rmtree(moved)
    other = _base(corpus, moved, seed=1)  # the same shape, other weights, at the path the run now names
    before = digest(tmp_path / "lora")
    capfd.readouterr()
    line = _one_error_line(lmforge_in_process("pretrain", *lora_args(6, other)), capfd.readouterr().err)
    assert "holds adapters for the base model" in line and "has other weights" in line, line
    assert digest(tmp_path / "lora") == before
    line = _one_error_line(lmforge_in_process("export", "--hf", tmp_path / "hf", tmp_path / "lora"),
                           capfd.readouterr().err)
    assert f"base model checkpoint:{other}, whose weights changed since" in line, line
    assert not (tmp_path / "hf").exists()
