"""Embedded corpus, file readers, packing and the world-size-independent step loader."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.data import (
    IGNORE_INDEX,
    PackedTokenDataset,
    Sample,
    StepLoader,
    collate,
    embedded_corpus,
    eval_batches,
    read_documents,
    read_jsonl_records,
)
from lmforge.data.sources import read_records
from lmforge.errors import UserError
from lmforge.models.tokenizer import ByteTokenizer

# -- corpus -------------------------------------------------------------------------------------


def test_corpus_deterministic_and_disjoint():
    train = embedded_corpus("train", 2000)
    assert train == embedded_corpus("train", 2000)
    assert embedded_corpus("train", 50) == train[:50]
    val = embedded_corpus("validation", 300)
    assert not set(train) & set(val)
    assert len(set(train)) == len(train)
    kinds = {d.split(":", 1)[0] for d in train if d.startswith(("People:", "Math practice:"))}
    assert kinds == {"People", "Math practice"}
    assert sum("Once upon a time" in d or "There once was" in d for d in train) > 500
    with pytest.raises(UserError):
        embedded_corpus("test")


def test_corpus_stories_reuse_the_name_and_sums_are_right():
    checked = {"sums": 0, "equations": 0, "named stories": 0}
    for doc in embedded_corpus("validation", 200):
        if doc.startswith(("Math practice:", "Some sums:", "Numbers:")):
            checked["sums"] += 1
            for line in doc.splitlines()[1:]:
                lhs, rhs = line.rstrip(".").split(" = ")
                assert eval(lhs) == int(rhs)
                checked["equations"] += 1
        elif " named " in doc or " called " in doc:  # "... a cat named Gus." / "... a cat called Gus."
            checked["named stories"] += 1
            name = doc.split(" named " if " named " in doc else " called ", 1)[1].split(".", 1)[0]
            assert doc.count(name) >= 3, (name, doc)
    assert all(n > 0 for n in checked.values()), checked


# -- sources ------------------------------------------------------------------------------------


def test_read_txt_and_jsonl_and_dir(tmp_path):
    (tmp_path / "a.txt").write_text("first doc\nline two\n\n\nsecond doc\n")
    (tmp_path / "b.jsonl").write_text('{"text": "j1"}\n\n{"text": "j2\\u2028x", "n": 1}\n')
    (tmp_path / "ignored.csv").write_text("x")
    assert read_documents(tmp_path / "a.txt") == ["first doc\nline two", "second doc"]
    assert read_documents(tmp_path / "b.jsonl") == ["j1", "j2\u2028x"]
    assert read_documents(tmp_path) == ["first doc\nline two", "second doc", "j1", "j2\u2028x"]
    assert read_jsonl_records(tmp_path / "b.jsonl")[1] == {"text": "j2\u2028x", "n": 1}


def test_read_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["p1", None, "p2"]}), tmp_path / "d.parquet")
    assert read_documents(tmp_path / "d.parquet", text_field="body") == ["p1", "p2"]
    with pytest.raises(UserError, match="no column 'text'"):
        read_documents(tmp_path / "d.parquet")


@pytest.mark.parametrize("line, expect", [
    ('{"text": ' + "[" * 100_000 + "}", "nested deeper than 64 levels"),  # json raises RecursionError
    ('{"text": "a", "x": ' + "[" * 65 + "]" * 65 + "}", "nested deeper than 64 levels"),  # parses, too deep
    ('{"text": "a", "n": ' + "9" * 5000 + "}", "Exceeds the limit (4300 digits)"),  # json raises ValueError
])
def test_hostile_json_lines_are_one_line_errors_in_every_reader(tmp_path, line, expect):
    """Every recipe's JSONL reading (records: SFT, preference, GRPO prompts; documents and prepare's chunks:
    pretraining) goes through ``parse_json_line``: one ``file:line`` error, whatever Python's json raises."""
    from lmforge.data.chunks import chunk_documents, plan_chunks

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok", "n": 12345, "m": [[1, 2], {"a": [3]}]}\n' + line + "\n")
    readers = {"records": read_records, "jsonl records": read_jsonl_records, "documents": read_documents,
               "chunks": lambda p: [chunk_documents(c) for c in plan_chunks(p)]}
    for what, read in readers.items():
        with pytest.raises(UserError) as e:
            read(bad)
        assert f"{bad}:2: " in str(e.value) and expect in str(e.value) and "\n" not in str(e.value), what


def test_source_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(UserError, match=r"bad\.jsonl:3: invalid JSON"):
        read_documents(bad)
    with pytest.raises(UserError, match=r"bad\.jsonl:3: invalid JSON"):
        read_jsonl_records(bad)

    field = tmp_path / "field.jsonl"
    field.write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(UserError, match=r"field\.jsonl:2: missing field 'text'"):
        read_documents(field)

    latin = tmp_path / "latin.txt"
    latin.write_bytes("line one\ncaf\xe9\n".encode("latin-1"))
    with pytest.raises(UserError, match=r"latin\.txt:2: not valid UTF-8"):
        read_documents(latin)

    with pytest.raises(UserError, match="not found"):
        read_documents(tmp_path / "missing.jsonl")
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    with pytest.raises(UserError, match="no documents in"):
        read_documents(tmp_path / "empty.txt")
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(UserError, match="unsupported file type"):
        read_documents(tmp_path / "x.csv")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(UserError, match="no documents in"):
        read_documents(tmp_path / "empty_dir")


def test_one_record_reader_for_jsonl_and_parquet(tmp_path):
    """SFT and GRPO read records through read_records: JSON lines and parquet rows, with locations."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_text('{"prompt": "p1", "answer": "1"}\n\n{"prompt": "p2", "answer": "2"}\n')
    pq.write_table(pa.Table.from_pylist([{"prompt": "p3", "answer": "3"}]), tmp_path / "b.parquet")
    (tmp_path / "notes.md").write_text("not a record file")
    got = read_records(tmp_path)
    assert [w.rsplit("/", 1)[1] for w, _ in got] == ["a.jsonl:1", "a.jsonl:3", "b.parquet: row 0"]
    assert [r["prompt"] for _, r in got] == ["p1", "p2", "p3"]
    assert read_jsonl_records(tmp_path / "b.parquet") == [{"prompt": "p3", "answer": "3"}]
    (tmp_path / "c.jsonl").write_text('{"prompt": "x"}\n[1, 2]\n')
    with pytest.raises(UserError, match=r"c\.jsonl:2: expected a JSON object, got list"):
        read_records(tmp_path)
    with pytest.raises(UserError, match=r"unsupported file type '\.md'; data must be \.jsonl, \.parquet, \.txt, a directory of them"):
        read_records(tmp_path / "notes.md")


def _grpo_cfg(*overrides: str):
    from lmforge.config import load_config
    from lmforge.recipes.grpo import GRPOConfig

    return load_config(GRPOConfig, None, list(overrides))


def prompt_records(cfg, split: str):
    """The GRPO recipe's prompt records of ``split`` under ``cfg`` (as its ``check`` reads them)."""
    from lmforge.data.prompts import prompt_records as read

    return read(cfg.data, cfg.tasks, split, cfg.grpo.prompt_field, cfg.grpo.answer_field)


def test_grpo_prompt_files_with_answer_column_and_message_prompts(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    f = tmp_path / "q.jsonl"
    f.write_text(json.dumps({"question": "1+1?", "solution": "1+1=2\n#### 2", "answer": "old"}) + "\n"
                 + json.dumps({"question": chat, "solution": 4}) + "\n")
    cfg = _grpo_cfg(f"--data.train={f}", "--data.validation=none", "--grpo.prompt_field=question",
                    "--grpo.answer_field=solution")
    train = prompt_records(cfg, "train")
    assert [r["answer"] for r in train] == ["1+1=2\n#### 2", 4]  # what the rewards receive as `answer`
    assert train[1]["question"] == chat and train[0]["solution"] == "1+1=2\n#### 2"
    assert prompt_records(cfg, "test") == []

    gsm8k = Path(__file__).parent / "fixtures" / "data"
    cfg = _grpo_cfg(f"--data.train={gsm8k / 'gsm8k_train.jsonl'}", f"--data.validation={gsm8k / 'gsm8k_test.jsonl'}",
                    "--tasks.eval_examples=10")
    train, test = prompt_records(cfg, "train"), prompt_records(cfg, "test")
    assert len(train) == 64 and len(test) == 10 and train[0]["answer"] == "72"


def test_message_prompts_use_the_chat_format():
    from lmforge.data.chat import chat_format_for
    from lmforge.inference import chat_prompt_ids
    from lmforge.rl.rollout_source import prompt_token_ids

    tok = ByteTokenizer()
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert prompt_token_ids(tok, chat) == chat_format_for(tok).prompt_ids(chat)
    assert prompt_token_ids(tok, "2+2?") == chat_prompt_ids(tok, "2+2?")
    assert prompt_token_ids(tok, "2+2?") == prompt_token_ids(tok, [{"role": "user", "content": "2+2?"}])


@pytest.mark.parametrize("line,message", [
    ('{"prompt": 3, "answer": "1"}', "record 2 has no string `prompt` column"),
    ('{"prompt": [], "answer": "1"}', "`prompt`: 'messages' must be a non-empty list"),
    ('{"prompt": [{"role": "bot", "content": "x"}], "answer": "1"}', "`prompt`: message 0 has role 'bot'"),
    ('{"prompt": "q"}', "missing answer column `answer`"),
    ('{"prompt": "q", "answer": ["1"]}', "`answer` must be a string or a number, got list"),
])
def test_grpo_prompt_errors_name_file_and_line(tmp_path, line, message):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok", "answer": "1"}\n' + line + "\n")
    with pytest.raises(UserError) as e:
        prompt_records(_grpo_cfg(f"--data.train={f}"), "train")
    assert str(e.value).startswith(f"{f}:2: {message}"), str(e.value)


def test_grpo_answer_field_must_exist(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "q"}\n')
    assert prompt_records(_grpo_cfg(f"--data.train={f}"), "train") == [{"prompt": "q"}]  # rewards without answers
    with pytest.raises(UserError, match=r"p\.jsonl: no record has the answer column `solution`"):
        prompt_records(_grpo_cfg(f"--data.train={f}", "--grpo.answer_field=solution"), "train")


# -- packing ------------------------------------------------------------------------------------


def test_packing_windows_reconstruct_stream():
    tok = ByteTokenizer()
    docs = ["hello", "wörld!", "abc" * 7]
    ds = PackedTokenDataset(docs, tok, seq_len=4)
    stream = []
    for d in docs:
        stream += tok.encode(d) + [tok.eos_id]
    assert ds.num_tokens == len(stream)
    assert len(ds) == (len(stream) - 1) // 4
    inputs = torch.cat([ds[i].input_ids for i in range(len(ds))]).tolist()
    labels = torch.cat([ds[i].labels for i in range(len(ds))]).tolist()
    assert inputs == stream[: len(ds) * 4]
    assert labels == stream[1 : len(ds) * 4 + 1]
    s = ds[0]
    assert s.input_ids.dtype == torch.long and s.position_ids is None and s.document_ids is None
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(UserError, match="not enough data"):
        PackedTokenDataset(["hi"], tok, seq_len=64)


def test_collate_and_batch():
    samples = [
        Sample(torch.arange(4), torch.tensor([1, 2, IGNORE_INDEX, 4])),
        Sample(torch.arange(4), torch.tensor([IGNORE_INDEX] * 3 + [0])),
    ]
    b = collate(samples)
    assert b.input_ids.shape == (2, 4) and b.position_ids is None
    assert isinstance(b.num_targets, torch.Tensor) and int(b.num_targets) == 4
    assert b.to("cpu").labels.equal(b.labels)


# -- loader -------------------------------------------------------------------------------------


class _Indexed:
    """Sample i holds the value i, so batches reveal exactly which samples they contain."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Sample:
        t = torch.full((3,), i, dtype=torch.long)
        return Sample(t, t.clone())


def _ids(batches) -> list[int]:
    return [int(row[0]) for b in batches for row in b.input_ids]


def _global_steps(world: int, steps: int, micro: int, **kw) -> list[list[int]]:
    loaders = [StepLoader(_Indexed(37), 12, micro, r, world, seed=3, **kw) for r in range(world)]
    out = [sum((_ids(ld.next_step()) for ld in loaders), []) for _ in range(steps)]
    for ld in loaders:
        ld.close()
    return out


def test_loader_same_global_batches_at_any_world_size():
    one = _global_steps(1, 8, micro=4)
    assert one == _global_steps(2, 8, micro=3)
    assert one == _global_steps(4, 8, micro=1, prefetch=0)
    # Epoch structure: every dataset index appears once in each full pass.
    flat = sum(one, [])
    assert sorted(flat[:37]) == list(range(37))
    assert flat[:37] != list(range(37))  # shuffled
    assert sorted(flat[37:74]) == list(range(37))
    assert flat[37:74] != flat[:37]  # reshuffled per epoch
    unshuffled = sum(_global_steps(1, 4, micro=4, shuffle=False), [])
    assert unshuffled == [i % 37 for i in range(48)]


def test_loader_microbatches_and_validation():
    ld = StepLoader(_Indexed(40), 8, 2, dp_rank=1, dp_world_size=2, shuffle=False)
    step = ld.next_step()
    assert [b.input_ids.shape[0] for b in step] == [2, 2] and _ids(step) == [4, 5, 6, 7]
    assert ld.steps_per_epoch == 5 and ld.state_dict() == {"samples_consumed": 8, "seed": 0}
    ld.close()
    with pytest.raises(UserError, match="training.global_batch_size.*training.micro_batch_size"):
        StepLoader(_Indexed(40), 10, 4, 0, 2)


def test_loader_resume_exact_with_prefetch():
    ref = StepLoader(_Indexed(37), 6, 2, 0, 1, seed=5, prefetch=3)
    expected = [_ids(ref.next_step()) for _ in range(10)]
    ref.close()

    ld = StepLoader(_Indexed(37), 6, 2, 0, 1, seed=5, prefetch=3)
    got = [_ids(ld.next_step()) for _ in range(4)]
    state = ld.state_dict()  # prefetch thread has already built steps beyond this point
    assert state == {"samples_consumed": 24, "seed": 5}
    ld.close()

    # Resume at world size 2: concatenated rank slices continue the world-size-1 sequence.
    halves = [StepLoader(_Indexed(37), 6, 1, r, 2, prefetch=2) for r in range(2)]
    for h in halves:
        h.load_state_dict(state)
    for _ in range(6):
        got.append(sum((_ids(h.next_step()) for h in halves), []))
    for h in halves:
        h.close()
    assert got == expected


def test_loader_load_state_mid_stream_restarts_prefetch():
    ld = StepLoader(_Indexed(37), 4, 2, 0, 1, seed=1, prefetch=2)
    first = [_ids(ld.next_step()) for _ in range(3)]
    ld.load_state_dict({"samples_consumed": 4, "seed": 1})
    assert _ids(ld.next_step()) == first[1]
    assert _ids(ld.next_step()) == first[2]
    ld.close()


def test_loader_thread_exception_reraises():
    class Broken(_Indexed):
        def __getitem__(self, i):
            if i == 5:
                raise UserError("bad sample 5")
            return super().__getitem__(i)

    ld = StepLoader(Broken(20), 4, 4, 0, 1, shuffle=False, prefetch=2)
    ld.next_step()
    with pytest.raises(UserError, match="bad sample 5"):
        ld.next_step()
    ld.close()


def test_eval_batches_repeatable_and_rank_sliced():
    ds = _Indexed(23)
    first = _ids(eval_batches(ds, 4, 3, 0, 1))
    assert first == _ids(eval_batches(ds, 4, 3, 0, 1)) == list(range(12))
    it = [eval_batches(ds, 4, 3, r, 2) for r in range(2)]
    merged = sum((_ids([a]) + _ids([b]) for a, b in zip(*it)), [])
    assert merged == first
    assert len(list(eval_batches(ds, 4, None, 0, 1))) == 5  # capped to full batches
    with pytest.raises(UserError):
        eval_batches(ds, 3, 1, 0, 2)


def test_packed_dataset_through_loader_is_fast_enough():
    tok = ByteTokenizer()
    ds = PackedTokenDataset(embedded_corpus("validation", 200), tok, seq_len=64)
    ld = StepLoader(ds, 8, 4, 0, 1, seed=0)
    batches = ld.next_step()
    ld.close()
    assert len(batches) == 2 and batches[0].input_ids.shape == (4, 64)
    assert int(batches[0].input_ids.max()) < tok.vocab_size
    assert np.int32 == ds.tokens.dtype
