"""Bad prepared data, in one line: damaged shards and hand-edited indexes under a run that resumes, a
mixture source that changed between runs, two prepares racing on one directory, a full disk.

Each run case resumes (in this process) a finished 2-step run on a mixture of two prepared sources
and checks what ``tests/test_bad_inputs.py`` checks of every bad input: exit status 2, exactly one
``error:`` line naming the file, no traceback, the run directory byte-identical.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Callable

import pytest

from _helpers import lmforge_in_process, tiny_run_args
from lmforge.data import chunks
from lmforge.data import prepare as prepare_mod
from lmforge.data.corpus import embedded_corpus
from lmforge.data.prepare import prepare
from lmforge.data.shards import PreparedTokens, ShardWriter
from lmforge.errors import UserError
from lmforge.models.tokenizer import ByteTokenizer
from test_bad_inputs import digest


def _quiet(line: str) -> None:
    pass


def _prepare(text: str, root: Path, name: str) -> Path:
    (root / f"{name}.txt").write_text(text)
    return prepare([root / f"{name}.txt"], root / name, ByteTokenizer(), shard_tokens=8000, log=_quiet).out


def _run_args(a: Path, b: Path, run: Path, *extra: str, steps: int = 2) -> list[str]:
    spec = f'[{{path="{a}", weight=3}}, {{path="{b}", weight=1}}]'
    return ["pretrain", *tiny_run_args(data_validation=b, training_steps=steps), f"--data.sources={spec}",
            f"--run.dir={run}", *extra]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(source A with several shards, source B, a finished 2-step run on their mixture)."""
    root = tmp_path_factory.mktemp("mixture_run")
    a = _prepare("\n\n".join(embedded_corpus("train", 200)), root, "a")
    b = _prepare("\n\n".join(embedded_corpus("validation", 60)), root, "b")
    assert len(PreparedTokens(a).index["shards"]) >= 3
    assert lmforge_in_process(*_run_args(a, b, root / "run")) == 0
    return a, b, root / "run"


def _edit_index(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        index = json.loads((d / "index.json").read_text())
        change(index)
        (d / "index.json").write_text(json.dumps(index))
    return edit


def _swap(d: Path) -> None:
    first, second = d / "tokens-00000.bin", d / "tokens-00001.bin"
    data = first.read_bytes()
    first.write_bytes(second.read_bytes())
    second.write_bytes(data)


DAMAGE: dict[str, tuple[Callable[[Path], None], list[str]]] = {
    "shard_swapped": (_swap, ["tokens-00000.bin: shard changed since it was prepared"]),
    "shard_truncated": (lambda d: os.truncate(d / "tokens-00001.bin", 100), ["tokens-00001.bin: shard has the wrong size"]),
    "shard_deleted": (lambda d: (d / "tokens-00002.bin").unlink(), ["tokens-00002.bin: shard missing"]),
    "documents_deleted": (lambda d: (d / "documents.npy").unlink(), ["documents.npy: missing since it was prepared"]),
    "index_not_json": (lambda d: (d / "index.json").write_text('{"format": "lmforge-tokens-1", '),
                       ["index.json: not a readable prepared-data index"]),
    "index_more_tokens": (_edit_index(lambda i: i["shards"][0].update(tokens=i["shards"][0]["tokens"] + 100)),
                          ["index.json: shard tokens-00000.bin: 'tokens' (8100) x 2 bytes must equal 'bytes' (16000)"]),
    "index_wrong_total": (_edit_index(lambda i: i.update(num_tokens=5)), ["'num_tokens' is 5, the shards hold"]),
    "index_shard_repeated": (_edit_index(lambda i: i["shards"].append(i["shards"][0])),
                             ["must be tokens-0000", "found 'tokens-00000.bin'"]),
    "index_dtype": (_edit_index(lambda i: i.update(dtype="float64")), ["'dtype' must be uint16 or uint32"]),
    "index_without_shards": (_edit_index(lambda i: i.pop("shards")), ["'shards' must be a list"]),
}


def _one_error_line(rc: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (rc, err[-3000:])
    return lines[0]


@pytest.mark.parametrize("name", DAMAGE)
def test_damaged_prepared_source_stops_the_resume_in_one_line(saved, tmp_path, capfd, name):
    """Damage found on open (sizes, sampled hashes, the index's own consistency), before the run
    directory is touched; ``lmforge prepare`` of the same inputs then replaces the damaged directory whole."""
    a, b, run = saved
    damaged, copy = tmp_path / "a", tmp_path / "run"
    shutil.copytree(a, damaged)
    shutil.copytree(run, copy)
    damage, expect = DAMAGE[name]
    damage(damaged)
    before = digest(copy)
    capfd.readouterr()
    rc = lmforge_in_process(*_run_args(damaged, b, copy, steps=4))
    line = _one_error_line(rc, capfd.readouterr().err)
    assert f"data.sources[0].path={damaged}" in line and all(words in line for words in expect), line
    assert digest(copy) == before

    index = json.loads((a / "index.json").read_text())
    assert lmforge_in_process("prepare", *index["inputs"], "--out", damaged) == 0, capfd.readouterr().err[-2000:]
    assert PreparedTokens(damaged).verify() == []
    assert PreparedTokens(damaged).index["sources"] == index["sources"]


def test_a_mixture_source_that_changed_follows_checkpoint_on_data_change(saved, tmp_path, capfd):
    """Source B prepared again from other text: ``stop`` (the default) refuses the resume in one line
    and changes nothing; ``continue`` warns once and trains on from the saved sample index."""
    a, _, run = saved
    other = _prepare("\n\n".join(embedded_corpus("train", 80)[40:]), tmp_path, "b")
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    before = digest(copy)
    capfd.readouterr()
    rc = lmforge_in_process(*_run_args(a, other, copy, steps=4))
    line = _one_error_line(rc, capfd.readouterr().err)
    assert "trained on other data" in line and "checkpoint.on_data_change=continue" in line, line
    assert digest(copy) == before

    rc = lmforge_in_process(*_run_args(a, other, copy, "--checkpoint.on_data_change=continue", steps=4))
    out, err = capfd.readouterr()
    assert rc == 0, err[-3000:]
    assert (out + err).count("trained on other data") == 1 and "resumed from" in out, out[-2000:]


def test_a_full_disk_during_prepare_is_one_line_and_keeps_the_earlier_directory(tmp_path, monkeypatch, capfd):
    src = tmp_path / "docs.txt"
    src.write_text("\n\n".join(embedded_corpus("train", 60)))
    out = prepare([src], tmp_path / "out", ByteTokenizer(), log=_quiet).out
    before = digest(out)
    src.write_text("\n\n".join(embedded_corpus("train", 90)))  # changed: the next prepare replaces out...
    real, calls = ShardWriter.append, []

    def full(self, tokens, lengths):  # ...but the disk fills up after some shards are written
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(self, tokens, lengths)

    monkeypatch.setattr(chunks, "CHUNK_BYTES", 4000)
    monkeypatch.setattr(ShardWriter, "append", full)
    capfd.readouterr()
    rc = lmforge_in_process("prepare", src, "--out", out)
    line = _one_error_line(rc, capfd.readouterr().err)
    assert line == f"error: prepare --out {out}: cannot write the prepared data (No space left on device); nothing was changed"
    assert digest(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.txt", "out"]  # no partial directory


def test_two_prepares_racing_on_one_directory(tmp_path, monkeypatch):
    """B installs its preparation while A is still writing, or in the instant between A's check and
    A's rename. Same inputs: both succeed, one directory. Other inputs: the one that installs last
    wins, or, where B took the place in that instant, A stops in one line and B's result stands.
    Whatever happens, ``out`` is one whole, valid preparation and no temporary directory is left."""
    one, two = tmp_path / "one.txt", tmp_path / "two.txt"
    one.write_text("\n\n".join(embedded_corpus("train", 50)))
    two.write_text("\n\n".join(embedded_corpus("validation", 50)))
    out = tmp_path / "out"
    real_rename, real_pid = os.rename, os.getpid

    def as_other_process(inputs):  # B: another prepare (another pid) run to the end
        monkeypatch.setattr(prepare_mod.os, "getpid", lambda: real_pid() + 1)
        try:
            prepare(inputs, out, ByteTokenizer(), log=_quiet)
        finally:
            monkeypatch.setattr(prepare_mod.os, "getpid", real_pid)

    def racing(b_inputs):
        def rename(src, dst):
            if Path(src).name.startswith(".out.partial-") and not getattr(rename, "done", False):
                rename.done = True
                as_other_process(b_inputs)
            return real_rename(src, dst)
        return rename

    def inputs_of(d: Path) -> list[str]:
        assert PreparedTokens(d).verify() == []
        assert sorted(p.name for p in tmp_path.iterdir()) == ["one.txt", "out", "two.txt"]
        return json.loads((d / "index.json").read_text())["inputs"]

    for b_inputs, a_wins in (([one], True), ([two], None)):
        shutil.rmtree(out, ignore_errors=True)
        monkeypatch.setattr(prepare_mod.os, "rename", racing(b_inputs))
        if a_wins:
            prepare([one], out, ByteTokenizer(), log=_quiet)
        else:
            with pytest.raises(UserError, match=r"another prepare wrote other data there meanwhile"):
                prepare([one], out, ByteTokenizer(), log=_quiet)
        assert inputs_of(out) == [str(p.resolve()) for p in ([one] if a_wins else b_inputs)]

    # B finishes while A is still tokenizing, with other inputs: A, installing last, replaces it whole.
    shutil.rmtree(out)
    monkeypatch.setattr(prepare_mod.os, "rename", real_rename)
    real_tokenize = prepare_mod._tokenize_chunk

    def tokenize(chunk):
        if not getattr(tokenize, "done", False):
            tokenize.done = True
            as_other_process([two])
        return real_tokenize(chunk)

    monkeypatch.setattr(prepare_mod, "_tokenize_chunk", tokenize)
    prepare([one], out, ByteTokenizer(), log=_quiet)
    assert inputs_of(out) == [str(one.resolve())]
