"""Chats with tools: rendering against ``transformers``, the loss mask of tool-calling turns, SFT on them.

The conversations are tests/fixtures/data/tool_chats.jsonl (calculator chats in the ``transformers``
layout); the template is Qwen2.5's published one, which writes ``tools`` into the system turn, an
assistant's ``tool_calls`` as ``<tool_call>`` JSON and ``tool`` results as ``<tool_response>`` blocks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _chat_fixtures import REAL_TOKENIZERS
from _helpers import run_lmforge, tiny_run_args
from lmforge.data.chat import ByteChatFormat, chat_format_for, validate_messages, validate_tools
from lmforge.data.sft_data import build_sft_dataset, read_sft_records
from lmforge.metrics.records import read_records
from lmforge.models.tokenizer import ByteTokenizer, load_tokenizer
from lmforge.rl.tools.calculator import CALCULATOR_TOOL

transformers = pytest.importorskip("transformers")

TOOL_CHATS = Path(__file__).resolve().parent / "fixtures" / "data" / "tool_chats.jsonl"
QWEN = REAL_TOKENIZERS / "qwen2.5-instruct"
SMOL = REAL_TOKENIZERS / "smollm2-135m-instruct"


def chats() -> list[dict]:
    return [json.loads(line) for line in TOOL_CHATS.read_text().splitlines()]


@pytest.fixture(scope="module")
def qwen():
    tok = load_tokenizer(str(QWEN))
    return transformers.AutoTokenizer.from_pretrained(str(QWEN)), tok, chat_format_for(tok)


def hf_ids(hf, messages, **kw) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, **kw)
    return out["input_ids"] if not isinstance(out, list) else out


def masked_texts(tok, enc) -> list[str]:
    """The decoded text of each run of masked tokens."""
    runs, prev = [], False
    for i, m in enumerate(enc.assistant_mask):
        if m and not prev:
            runs.append([i, i])
        if m:
            runs[-1][1] = i + 1
        prev = m
    return [tok.decode(enc.ids[a:b], skip_special=False) for a, b in runs]


def test_rendering_and_ids_equal_transformers_with_tools(qwen):
    hf, tok, chat = qwen
    for record in chats():
        messages = validate_messages(record["messages"])
        tools = validate_tools(record["tools"])
        theirs = hf.apply_chat_template(messages, tools=tools, tokenize=False)
        assert chat.render(messages, tools=tools) == theirs
        assert "<tools>" in theirs and '"name": "calculator"' in theirs
        assert chat.encode(messages, tools).ids == hf_ids(hf, messages, tools=tools)
        for i, m in enumerate(messages):  # every prompt the model would be given along the way
            if m["role"] == "assistant":
                assert chat.prompt_ids(messages[:i], tools) == hf_ids(hf, messages[:i], tools=tools,
                                                                      add_generation_prompt=True)


def test_tool_call_turns_are_in_the_mask_exactly(qwen):
    """Hand-checked against the Qwen2.5 template: each assistant turn from the end of the generation prompt
    (``<|im_start|>assistant\\n``) to its ``<|im_end|>``, tool calls included; results and headers out."""
    _, tok, chat = qwen
    record = chats()[0]
    enc = chat.encode(validate_messages(record["messages"]), record["tools"])
    assert masked_texts(tok, enc) == [
        'In May she sold half of 48.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "48 / 2"}}\n'
        '</tool_call><|im_end|>',
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "48 + 24"}}\n</tool_call><|im_end|>',
        "She sold 48 in April and 24 in May, 72 in all.\n#### 72<|im_end|>",
    ]
    two_calls = chats()[2]
    enc = chat.encode(validate_messages(two_calls["messages"]), two_calls["tools"])
    assert masked_texts(tok, enc)[0] == (
        'I will count both sizes at once.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 * 16"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 * 8"}}\n</tool_call>'
        "<|im_end|>")


def test_mask_starts_after_each_generation_prompt(qwen):
    """The same rule checked by formula on every chat: masked runs begin exactly where ``prompt_ids`` of the
    conversation before that turn ends, and end with ``<|im_end|>``; tool results are never masked."""
    _, tok, chat = qwen
    end = tok.token_id("<|im_end|>")
    for record in chats():
        messages = validate_messages(record["messages"])
        enc = chat.encode(messages, record["tools"])
        starts = [i for i, m in enumerate(enc.assistant_mask) if m and not enc.assistant_mask[i - 1]]
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        assert starts == [len(chat.prompt_ids(messages[:i], record["tools"])) for i in turns]
        mask = enc.assistant_mask
        ends = [i for i, m in enumerate(mask) if m and (i + 1 == len(mask) or not mask[i + 1])]
        assert all(enc.ids[i] == end for i in ends)
        masked = tok.decode([t for t, m in zip(enc.ids, enc.assistant_mask) if m], skip_special=False)
        assert "<tool_response>" not in masked and "# Tools" not in masked


def test_sft_examples_from_the_tool_chats(qwen):
    _, tok, chat = qwen
    records = read_sft_records(TOOL_CHATS)
    assert all(r["tools"] == [CALCULATOR_TOOL] for _, r in records)
    dataset, summary = build_sft_dataset(records, "tool_chats", tok, chat, seq_len=512, packing=False)
    expected = sum(sum(chat.encode(validate_messages(r["messages"]), r["tools"]).assistant_mask) for r in chats())
    assert summary.loss_tokens == expected and summary.examples == len(chats())
    labels = dataset.examples[0].labels
    text = tok.decode([int(t) for t in labels if t >= 0], skip_special=False)
    assert text.startswith("In May she sold half of 48.\n<tool_call>") and text.endswith("#### 72<|im_end|>")
    assert "24\n</tool_response>" not in text


def test_sft_cli_on_tool_chats(tmp_path):
    run = tmp_path / "run"
    r = run_lmforge("sft", *tiny_run_args(TOOL_CHATS, data_seq_len=512, training_global_batch_size=2,
                                          training_micro_batch_size=1, training_steps=2, data_prefetch=0,
                                          schedule_warmup_steps=None, model_tokenizer=QWEN, model_dim=32,
                                          model_n_layers=1),
                    f"--run.dir={run}")
    assert r.returncode == 0, r.stderr[-3000:]
    data = [x for x in read_records(run) if x["kind"] == "sft_data"]
    tok = load_tokenizer(str(QWEN))
    chat = chat_format_for(tok)
    expected = sum(sum(chat.encode(validate_messages(c["messages"]), c["tools"]).assistant_mask) for c in chats())
    assert data and data[0]["records"] == len(chats()) and data[0]["loss_tokens"] == expected
    train = read_records(run, "train")
    assert [t["step"] for t in train] == [1, 2] and all(t["loss"] > 0 for t in train)


# ---------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("message, error", [
    ({"role": "assistant", "content": "", "tool_calls": {}}, "message 1: 'tool_calls' must be a non-empty list"),
    ({"role": "assistant", "content": "", "tool_calls": [{"name": "calculator"}]},
     "message 1 tool_calls[0] needs a 'function' object"),
    ({"role": "assistant", "content": "", "tool_calls": [{"type": "code", "function": {"name": "f"}}]},
     "message 1 tool_calls[0] has type 'code'"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": ""}}]},
     "message 1 tool_calls[0] needs a non-empty string function 'name'"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": [1]}}]},
     "message 1 tool_calls[0] 'arguments' must be an object or a JSON string, got list"),
    ({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]},
     "message 1: only assistant messages carry 'tool_calls'"),
    ({"role": "tool", "content": 3}, "message 1 needs string 'role' and 'content'"),
    ({"role": "tool", "content": "3", "name": 1}, "message 1: tool message 'name' must be a string"),
    ({"role": "function", "content": "3"}, "message 1 has role 'function'"),
])
def test_malformed_tool_messages_are_one_line_errors(message, error):
    with pytest.raises(ValueError) as e:
        validate_messages([{"role": "user", "content": "q"}, message])
    assert str(e.value).startswith(error) and "\n" not in str(e.value)


def test_tool_layout_is_normalised():
    out = validate_messages([{"role": "user", "content": "q"},
                             {"role": "assistant", "content": None, "tool_calls": [
                                 {"id": "c1", "function": {"name": "calculator", "arguments": '{"expression": "1"}'}}]},
                             {"role": "tool", "content": "1", "tool_call_id": "c1", "extra": 5}])
    assert out[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1"}'}, "id": "c1"}]}
    assert out[2] == {"role": "tool", "content": "1", "tool_call_id": "c1"}
    with pytest.raises(ValueError, match=r"^tools\[0\] needs"):
        validate_tools([{"type": "function"}])
    with pytest.raises(ValueError, match="'tools' must be a list"):
        validate_tools({"name": "calculator"})


def test_templates_without_tool_support_are_refused_not_silently_dropped():
    """SmolLM2's template writes only ``content``: a tool-calling turn would train an empty answer."""
    chat = chat_format_for(load_tokenizer(str(SMOL)))
    record = chats()[0]
    messages = validate_messages(record["messages"])
    with pytest.raises(ValueError, match="does not write the tool calls of assistant message 2"):
        chat.encode(messages)
    plain = validate_messages(chats()[-1]["messages"])
    with pytest.raises(ValueError, match="the template ignores `tools`"):
        chat.encode(plain, record["tools"])
    byte = ByteChatFormat(ByteTokenizer())
    with pytest.raises(ValueError, match="byte chat format has no tool calls"):
        byte.encode(messages)
    with pytest.raises(ValueError, match="cannot show tool definitions"):
        byte.encode(plain, record["tools"])


def test_continuation_is_the_rendering_after_the_turn_tokenized_in_place(qwen):
    """The template's tokens after a tool-calling turn: ``\\n`` after ``<|im_end|>``, the results as a user
    turn, and the next generation prompt; equal to the whole rendering's ids after the turn."""
    _, tok, chat = qwen
    record = chats()[2]
    messages = validate_messages(record["messages"])
    tools = record["tools"]
    turn, results = messages[:3], messages[3:5]  # system, user, the two-call turn; the two results
    cont = chat.continuation_ids(turn, results, tools)
    assert tok.decode(cont, skip_special=False) == ("\n<|im_start|>user\n<tool_response>\n32\n</tool_response>\n"
                                                   "<tool_response>\n16\n</tool_response><|im_end|>\n"
                                                   "<|im_start|>assistant\n")
    whole = chat.prompt_ids(messages[:5], tools)
    assert whole[-len(cont):] == cont and whole[:-len(cont)] == chat.encode(turn, tools).ids[:-1]  # its "\n"
    with pytest.raises(ValueError, match="must end with an assistant message"):
        chat.continuation_ids(messages[:2], results, tools)


@pytest.mark.parametrize("family", ["qwen2.5-instruct", "smollm2-135m-instruct", "mistral-7b-instruct-v0.1"])
def test_continuation_ids_equal_transformers_tokenization_of_the_whole_chat(family):
    """Against ``apply_chat_template`` of the longer conversation: its ids after the answer's end-of-turn token
    are the continuation (ChatML's ``\n<|im_start|>user...``; Mistral v0.1's `` [INST] ... [/INST]`` on a
    SentencePiece tokenizer)."""
    d = REAL_TOKENIZERS / family
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    tok = load_tokenizer(str(d))
    chat = chat_format_for(tok)
    turn = [{"role": "user", "content": "What is 6 * 7?"},
            {"role": "assistant",
             "content": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'}]
    added = [{"role": "user", "content": "<tool_response>\n42\n</tool_response>"}]
    whole = hf_ids(hf, turn + added, add_generation_prompt=True)
    end = chat.end_of_turn_ids()[0]
    boundary = max(i for i, t in enumerate(whole) if t == end) + 1 if family.startswith("mistral") else \
        [i for i, t in enumerate(whole) if t == end][-2] + 1  # ChatML: the answer's <|im_end|>, not the result's
    cont = chat.continuation_ids(turn, added)
    assert whole[boundary:] == cont and whole[:boundary] == chat.encode(turn).ids[:boundary]
