"""``lmforge prepare`` and the prepared-directory reader: tokens, boundaries, re-runs, damage, errors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from _helpers import REPO, lmforge_in_process, run_lmforge, tiny_run_args
from lmforge.data import chunks
from lmforge.data import prepare as prepare_mod
from lmforge.data.corpus import embedded_corpus
from lmforge.data.fingerprint import dataset_fingerprint
from lmforge.data.packing import PackedTokenDataset
from lmforge.data.prepare import prepare
from lmforge.data.shards import PackedShardDataset, PreparedTokens
from lmforge.data.sources import read_documents, read_records
from lmforge.errors import UserError
from lmforge.models.tokenizer import ByteTokenizer, load_tokenizer

QWEN = REPO / "tests" / "fixtures" / "tokenizers" / "qwen2.5-instruct"
DOCS = embedded_corpus("validation", 120) + ["ünïcödé ✓ 例子 " * 3 + "end"]


def _quiet(line: str) -> None:
    pass


def _inputs(root: Path) -> dict[str, Path]:
    """The same documents as .txt, .jsonl, .parquet and a datasets directory."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    datasets = pytest.importorskip("datasets")
    root.mkdir(parents=True, exist_ok=True)
    out = {k: root / f"docs.{k}" for k in ("txt", "jsonl", "parquet")}
    out["txt"].write_text("\n\n\n".join(DOCS) + "\n")
    out["jsonl"].write_text("".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(DOCS)))
    pq.write_table(pa.Table.from_pylist([{"text": d} for d in DOCS]), out["parquet"], row_group_size=25)
    out["hf"] = root / "hf_docs"
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(out["hf"]))
    return out


def _expected(tokenizer, docs: list[str]) -> tuple[np.ndarray, np.ndarray]:
    ids = [tokenizer.encode(d) + [tokenizer.eos_id] for d in docs]
    return np.concatenate([np.asarray(x) for x in ids]), np.cumsum([len(x) for x in ids])


@pytest.mark.parametrize("tokenizer_spec", ["byte", str(QWEN)])
def test_every_input_format_round_trips(tmp_path, monkeypatch, tokenizer_spec):
    """Tokens equal direct tokenization (EOS after every document), boundaries are the documents', in
    several chunks and shards; packed samples equal the in-memory dataset's."""
    monkeypatch.setattr(chunks, "CHUNK_BYTES", 700)  # many chunks per file
    monkeypatch.setattr(chunks, "HF_CHUNK_ROWS", 17)
    tok = load_tokenizer(tokenizer_spec)
    want, ends = _expected(tok, DOCS)
    for kind, path in _inputs(tmp_path / "in").items():
        assert read_documents(path) == DOCS, kind
        res = prepare([path], tmp_path / f"out_{kind}", tok, shard_tokens=5000, log=_quiet, progress=False)
        data = PreparedTokens(res.out)
        assert data.dtype == (np.uint16 if tokenizer_spec == "byte" else np.uint32)
        assert len(res.index["shards"]) > 1, kind
        np.testing.assert_array_equal(data.read(0, data.num_tokens), want, err_msg=kind)
        np.testing.assert_array_equal(data.document_ends(), ends, err_msg=kind)
        assert data.verify() == []
    packed = PackedShardDataset(data, 64)
    ref = PackedTokenDataset(DOCS, tok, 64)
    assert len(packed) == len(ref)
    for i in range(len(ref)):
        assert packed[i].input_ids.tolist() == ref[i].input_ids.tolist()
        assert packed[i].labels.tolist() == ref[i].labels.tolist()


def test_two_workers_write_the_same_bytes_and_a_rerun_is_a_no_op(tmp_path):
    src = tmp_path / "docs.txt"
    src.write_text("\n\n".join(embedded_corpus("train", 3000)))
    one = tmp_path / "one"
    prepare([src], one, ByteTokenizer(), log=_quiet)
    proc = run_lmforge("prepare", src, "--out", tmp_path / "two", "--workers", "2", "--shard-tokens", "300000")
    assert proc.returncode == 0, proc.stderr[-2000:]
    two = PreparedTokens(tmp_path / "two")
    assert len(two.index["shards"]) > 1
    np.testing.assert_array_equal(two.read(0, two.num_tokens), PreparedTokens(one).read(0, two.num_tokens))
    before = {p.name: p.stat().st_mtime_ns for p in one.iterdir()}
    again = run_lmforge("prepare", src, "--out", one)
    assert again.returncode == 0 and again.stdout.strip().splitlines() == [
        f"{one} is up to date ({PreparedTokens(one).num_tokens:,} tokens, 3,000 documents): nothing to do"]
    assert {p.name: p.stat().st_mtime_ns for p in one.iterdir()} == before
    with open(src, "a") as f:
        f.write("\n\none more document")
    assert not prepare([src], one, ByteTokenizer(), log=_quiet).skipped  # a changed input is prepared again
    assert PreparedTokens(one).index["num_documents"] == 3001


def test_another_tokenizer_on_an_existing_directory_is_refused(tmp_path, capfd):
    src = tmp_path / "docs.txt"
    src.write_text("a first document\n\na second one")
    prepare([src], tmp_path / "out", ByteTokenizer(), log=_quiet)
    rc = lmforge_in_process("prepare", src, "--out", tmp_path / "out", "--tokenizer", QWEN)
    err = capfd.readouterr().err
    assert rc == 2
    assert err.strip().count("\n") == 0 and "was prepared with tokenizer byte" in err, err
    assert PreparedTokens(tmp_path / "out").index["tokenizer_name"] == "byte"


def _digest(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


def test_an_interrupted_prepare_leaves_nothing_and_keeps_the_earlier_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(chunks, "CHUNK_BYTES", 2000)
    src = tmp_path / "docs.txt"
    src.write_text("\n\n".join(embedded_corpus("train", 200)))
    calls = []
    real = prepare_mod._tokenize_chunk

    def interrupted(chunk):
        calls.append(chunk)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(chunk)

    monkeypatch.setattr(prepare_mod, "_tokenize_chunk", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare([src], tmp_path / "out", ByteTokenizer(), log=_quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.txt"]  # no DIR, no partial directory

    monkeypatch.setattr(prepare_mod, "_tokenize_chunk", real)
    prepare([src], tmp_path / "out", ByteTokenizer(), log=_quiet)
    before = _digest(tmp_path / "out")
    src.write_text("\n\n".join(embedded_corpus("train", 300)))  # changed: the next prepare replaces it...
    calls.clear()
    monkeypatch.setattr(prepare_mod, "_tokenize_chunk", interrupted)
    with pytest.raises(KeyboardInterrupt):  # ...but is interrupted
        prepare([src], tmp_path / "out", ByteTokenizer(), log=_quiet)
    assert _digest(tmp_path / "out") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.txt", "out"]


def test_a_changed_or_damaged_shard_is_detected(tmp_path, capfd):
    src = tmp_path / "docs.txt"
    src.write_text("\n\n".join(embedded_corpus("train", 3000)))  # ~1.9 MB of tokens: 64 x 4 KiB is a sample
    out = tmp_path / "out"
    prepare([src], out, ByteTokenizer(), log=_quiet)
    shard = out / "tokens-00000.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 1  # the first block is always among the sampled ones: found on open
    shard.write_bytes(data)
    with pytest.raises(UserError, match="tokens-00000.bin: shard changed since it was prepared"):
        PreparedTokens(out)
    data[0] ^= 1
    shard.write_bytes(data[:-2])
    with pytest.raises(UserError, match="shard has the wrong size"):
        PreparedTokens(out)
    data[6000] ^= 1  # between the first two sampled blocks: only the full check (--verify) sees it
    shard.write_bytes(data)
    assert PreparedTokens(out).verify() == [f"{shard}: content differs from its checksum in index.json"]
    rc = lmforge_in_process("prepare", "--out", out, "--verify")
    assert rc == 2 and capfd.readouterr().err.strip().splitlines() == [
        f"error: {out} is damaged: {shard}: content differs from its checksum in index.json"]
    shard.unlink()
    rc = lmforge_in_process("pretrain", *tiny_run_args(out), f"--run.dir={tmp_path / 'run2'}")
    assert rc == 2 and capfd.readouterr().err.strip().splitlines() == [
        f"error: data.train={out}: {shard}: shard missing since it was prepared; run lmforge prepare again"]


def test_bad_rows_are_named_with_their_line_across_chunks(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(chunks, "CHUNK_BYTES", 300)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(200)) + '{"text": 5}\n')
    with pytest.raises(UserError, match=r"bad\.jsonl:201: field 'text' must be a string, got int"):
        prepare([bad], tmp_path / "out", ByteTokenizer(), log=_quiet)
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"".join(b"line %d\n\n" % i for i in range(100)) + b"caf\xe9\n")
    with pytest.raises(UserError, match=r"latin\.txt:201: not valid UTF-8 \(byte 0xe9\)"):
        prepare([latin], tmp_path / "out", ByteTokenizer(), log=_quiet)
    assert not (tmp_path / "out").exists()
    monkeypatch.undo()  # the CLI runs with the real chunk size
    capfd.readouterr()
    rc = lmforge_in_process("prepare", bad, "--out", tmp_path / "out", "--text-field", "body")
    assert rc == 2 and capfd.readouterr().err.strip().splitlines() == [f"error: {bad}:1: missing field 'body'"]
    rc = lmforge_in_process("prepare", tmp_path / "nope.jsonl", "--out", tmp_path / "out")
    assert rc == 2 and capfd.readouterr().err.strip().splitlines() == [
        f"error: data file not found: {tmp_path / 'nope.jsonl'}"]


def test_records_of_every_format_for_sft_and_grpo(tmp_path):
    """read_records (SFT examples, GRPO prompts) reads text blocks and datasets directories too."""
    datasets = pytest.importorskip("datasets")
    (tmp_path / "notes.txt").write_text("first block\nline two\n\n\nsecond block\n")
    got = read_records(tmp_path / "notes.txt")
    assert [(w.rsplit("/", 1)[1], r) for w, r in got] == [("notes.txt:1", {"text": "first block\nline two"}),
                                                            ("notes.txt:5", {"text": "second block"})]
    datasets.Dataset.from_dict({"prompt": ["p1", "p2"], "answer": ["1", "2"]}).save_to_disk(str(tmp_path / "hf"))
    assert [(w.rsplit("/", 1)[1], r) for w, r in read_records(tmp_path / "hf")] == [
        ("hf: row 0", {"prompt": "p1", "answer": "1"}), ("hf: row 1", {"prompt": "p2", "answer": "2"})]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["x"]})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(UserError, match=r"a dataset with splits \(train\); name one split's directory"):
        read_records(tmp_path / "dd")


def test_a_prepared_directory_packs_like_the_in_memory_corpus(tmp_path, capfd):
    """The embedded corpus packed in memory and the same documents prepared into shards give the same
    samples (so the same fingerprint and the same losses); a directory prepared with another tokenizer
    is refused by a run with one line."""
    text = tmp_path / "embedded.txt"
    docs = embedded_corpus("train")
    text.write_text("\n\n".join(docs))
    prepare([text], tmp_path / "prepared", ByteTokenizer(), log=_quiet)
    memory = PackedTokenDataset(docs, ByteTokenizer(), 32)
    shards = PackedShardDataset(PreparedTokens(tmp_path / "prepared"), 32)
    assert dataset_fingerprint(memory) == dataset_fingerprint(shards) and len(memory) == len(shards)
    for i in range(0, len(memory), 997):
        assert shards[i].input_ids.tolist() == memory[i].input_ids.tolist()
    text.write_text("\n\n".join(docs[:300]))
    prepare([text], tmp_path / "qwen", load_tokenizer(str(QWEN)), log=_quiet)
    capfd.readouterr()
    rc = lmforge_in_process("pretrain", *tiny_run_args(data_train=tmp_path / "qwen"), f"--run.dir={tmp_path / 'q'}")
    err = capfd.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1, err[-2000:]
    assert f"data.train={tmp_path / 'qwen'}: prepared with tokenizer {QWEN}" in err
