"""The common SFT record formats: what each maps to, equal tokenization, file:line errors, and a CLI run."""

from __future__ import annotations

import json
import re

import pytest

from _helpers import run_lmforge, tiny_run_args
from lmforge.config import load_config
from lmforge.data.chat import ByteChatFormat
from lmforge.data.sft_data import read_sft_records, tokenize_records
from lmforge.errors import UserError
from lmforge.metrics.records import read_records
from lmforge.models.tokenizer import ByteTokenizer
from lmforge.recipes.sft import SFTConfig

SYSTEM, Q, A = "You are terse.", "Name a prime.", "Seven."


def _msgs(*turns: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": r, "content": c} for r, c in turns]


# Each format's record and the conversation it means.
CASES = {
    "messages": ({"messages": _msgs(("system", SYSTEM), ("user", Q), ("assistant", A))},
                 _msgs(("system", SYSTEM), ("user", Q), ("assistant", A))),
    "prompt_completion": ({"prompt": _msgs(("system", SYSTEM), ("user", Q)), "completion": _msgs(("assistant", A))},
                          _msgs(("system", SYSTEM), ("user", Q), ("assistant", A))),
    "alpaca": ({"instruction": Q, "input": "", "output": A, "system": SYSTEM},
               _msgs(("system", SYSTEM), ("user", Q), ("assistant", A))),
    "alpaca_input": ({"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
                     _msgs(("user", "Add the numbers.\n\n2 and 3"), ("assistant", "5"))),
    "alpaca_rendered_text": ({"instruction": Q, "output": A, "text": "### Instruction: ..."},
                             _msgs(("user", Q), ("assistant", A))),
    "sharegpt": ({"conversations": [{"from": "system", "value": SYSTEM}, {"from": "human", "value": Q},
                                    {"from": "gpt", "value": A}, {"from": "user", "value": "Another?"},
                                    {"from": "assistant", "value": "Eleven."}]},
                 _msgs(("system", SYSTEM), ("user", Q), ("assistant", A), ("user", "Another?"),
                       ("assistant", "Eleven."))),
}


def _write(path, *records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("name", list(CASES))
def test_format_maps_to_its_conversation_and_tokenizes_like_messages(tmp_path, name):
    record, conversation = CASES[name]
    tok = ByteTokenizer()
    chat = ByteChatFormat(tok)
    [(where, mapped)] = read_sft_records(_write(tmp_path / "d.jsonl", record))
    assert where.endswith("d.jsonl:1")
    assert mapped["messages"] == conversation
    reference = [("m:1", {"messages": conversation})]
    assert tokenize_records([(where, mapped)], tok, chat) == tokenize_records(reference, tok, chat)
    explicit = name.split("_input")[0].split("_rendered")[0]
    assert read_sft_records(tmp_path / "d.jsonl", explicit)[0][1] == mapped  # data.format given


def test_plain_formats_keep_their_meaning(tmp_path):
    """String prompt/completion is plain text (no template, loss on the completion); text trains on all."""
    tok = ByteTokenizer()
    f = _write(tmp_path / "p.jsonl", {"prompt": "Say hi:", "completion": " hi"}, {"text": "all of it"})
    recs = read_sft_records(f)
    assert [r for _, r in recs] == [{"prompt": "Say hi:", "completion": " hi"}, {"text": "all of it"}]
    (ids, mask), (text_ids, text_mask) = tokenize_records(recs, tok, None)
    assert ids == tok.encode("Say hi:") + tok.encode(" hi", add_eos=True)
    assert mask == [False] * 7 + [True] * 4 and all(text_mask) and text_ids == tok.encode("all of it", add_eos=True)


def test_mixed_file_and_ambiguity(tmp_path):
    f = _write(tmp_path / "mixed.jsonl", CASES["alpaca"][0], CASES["sharegpt"][0], {"text": "t"})
    assert [next(iter(r)) for _, r in read_sft_records(f)] == ["messages", "messages", "text"]
    # a record fitting two formats takes its file's format, set by an unambiguous first record
    both = {"instruction": Q, "output": A, "prompt": "p", "completion": "c"}
    f = _write(tmp_path / "file_format.jsonl", {"prompt": "x", "completion": "y"}, both)
    assert read_sft_records(f)[1][1] == {"prompt": "p", "completion": "c"}
    f = _write(tmp_path / "ambiguous.jsonl", both)
    with pytest.raises(UserError, match=r"ambiguous\.jsonl:1: record matches several formats "
                                        r"\(prompt_completion, alpaca; .*set data\.format"):
        read_sft_records(f)
    assert read_sft_records(f, "alpaca")[0][1] == {"messages": _msgs(("user", Q), ("assistant", A))}


BAD = [  # (format, record line, error after "file:line: ")
    ("auto", '{"question": "q", "answer": "a"}',
     "record has none of the known shapes (keys: answer, question); accepted: messages"),
    ("auto", '{"messages": []}', "'messages' must be a non-empty list"),
    ("auto", '{"messages": [{"role": "robot", "content": "x"}]}', "message 0 has role 'robot'"),
    ("auto", '{"prompt": "q"}', "missing key 'completion'"),
    ("auto", '{"prompt": "q", "completion": [{"role": "assistant", "content": "a"}]}',
     "'prompt' and 'completion' must both be strings or both message lists (got str and list)"),
    ("auto", '{"instruction": "q", "input": 3, "output": "a"}', "'input' must be a string, got int"),
    ("auto", '{"instruction": "q"}', "missing key 'output' (format alpaca; keys: instruction)"),
    ("auto", '{"conversations": []}', "'conversations' is empty"),
    ("auto", '{"conversations": "hi"}', "'conversations' must be a list, got str"),
    ("auto", '{"conversations": [{"from": "human"}]}', "conversations[0] needs string 'from' and 'value'"),
    ("auto", '{"conversations": [{"from": "bot", "value": "x"}]}', "conversations[0] has unknown role 'bot'"),
    ("auto", '{"text": 5}', "'text' must be a string, got int"),
    ("alpaca", '{"messages": [{"role": "user", "content": "q"}]}', "missing key 'instruction'"),
    ("sharegpt", '{"instruction": "q", "output": "a"}', "missing key 'conversations'"),
]


@pytest.mark.parametrize("fmt,line,message", BAD)
def test_malformed_record_is_one_line_naming_file_and_line(tmp_path, fmt, line, message):
    good = {"alpaca": CASES["alpaca"][0], "sharegpt": CASES["sharegpt"][0]}.get(fmt, CASES["messages"][0])
    f = _write(tmp_path / "bad.jsonl", good, line)
    with pytest.raises(UserError) as e:
        read_sft_records(f, fmt)  # type: ignore[arg-type]
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith(f"{f}:2: {message}"), text


def test_parquet_row_errors_name_the_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"instruction": Q, "input": None, "output": A}, {"instruction": Q, "input": None, "output": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    with pytest.raises(UserError, match=re.escape(f"{tmp_path / 'a.parquet'}: row 1: 'output' must be a string")):
        read_sft_records(tmp_path)
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "a.parquet")  # a null input is no input
    assert read_sft_records(tmp_path)[0][1] == {"messages": _msgs(("user", Q), ("assistant", A))}


def test_data_format_option():
    assert load_config(SFTConfig, None, []).data.format == "auto"
    assert load_config(SFTConfig, None, ["--data.format=sharegpt"]).data.format == "sharegpt"
    with pytest.raises(UserError, match="data.format='csv': unknown record format; known: auto, messages"):
        read_sft_records("unused.jsonl", load_config(SFTConfig, None, ["--data.format=csv"]).data.format)


def test_a_registered_record_format_is_read_by_name_and_detected(tmp_path):
    from lmforge.data.record_formats import RECORD_FORMATS, RecordFormat, register_format

    fmt = register_format(RecordFormat("qa", lambda r: {"prompt": r["question"], "completion": r["answer"]},
                                       ("question",)))
    try:
        (tmp_path / "d.jsonl").write_text('{"question": "2+2?", "answer": "4"}\n')
        for name in ("qa", "auto"):
            assert read_sft_records(tmp_path / "d.jsonl", name)[0][1] == {"prompt": "2+2?", "completion": "4"}
        with pytest.raises(ValueError, match="exists already"):
            register_format(fmt)
    finally:
        del RECORD_FORMATS["qa"]


def test_sft_cli_on_an_alpaca_file(tmp_path):
    rows = [{"instruction": f"Add {a} and {b}.", "input": "" if a % 2 else "Answer with a number.",
             "output": str(a + b)} for a, b in zip(range(24), range(5, 29))]
    data = tmp_path / "sft_alpaca.jsonl"
    _write(data, *rows)
    run = tmp_path / "run"
    r = run_lmforge("sft", *tiny_run_args(data, data_seq_len=64, training_global_batch_size=4,
                                          training_micro_batch_size=4, training_steps=2,
                                          data_prefetch=0, data_format="alpaca"), f"--run.dir={run}")
    assert r.returncode == 0, r.stderr[-3000:]
    data_events = [x for x in read_records(run) if x["kind"] == "sft_data" and x["split"] == "train"]
    assert data_events[0]["records"] == 24 and data_events[0]["examples"] == 24
    train = read_records(run, "train")
    assert [x["step"] for x in train] == [1, 2] and all(x["total_weights"] > 0 for x in train)


def test_conversational_prompt_completion_trains_only_on_the_completion():
    """TRL's conversational prompt/completion: an assistant turn inside the prompt is context."""
    from lmforge.data.chat import chat_format_for
    from lmforge.data.record_formats import to_sft_record
    from lmforge.data.sft_data import tokenize_records
    from lmforge.models.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    prompt = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "EARLIER"},
              {"role": "user", "content": "and now?"}]
    record = to_sft_record({"prompt": prompt, "completion": [{"role": "assistant", "content": "LATER"}]},
                           "prompt_completion")
    [(ids, mask)] = tokenize_records([("x.jsonl:1", record)], tok, chat_format_for(tok))
    targets = tok.decode([i for i, m in zip(ids, mask) if m])
    assert "LATER" in targets and "EARLIER" not in targets
    as_messages = tokenize_records([("x.jsonl:1", {"messages": prompt + record["messages"][-1:]})], tok,
                                   chat_format_for(tok))
    assert as_messages[0][0] == ids  # same tokens as the plain conversation; only the mask differs
