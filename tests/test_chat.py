"""Chat formats: the byte format, HF chat templates rendered like transformers, assistant masks."""

from __future__ import annotations

import pytest

from _chat_fixtures import CHATML_TEMPLATE, CONVERSATIONS, INDENTED_TEMPLATE, make_tokenizer_dir
from lmforge.data.chat import BYTE_CHAT_TEMPLATE, ByteChatFormat, JinjaChatFormat, chat_format_for
from lmforge.data.sft_data import tokenize_records
from lmforge.errors import UserError
from lmforge.exporters import byte_tokenizer_json
from lmforge.inference import chat_prompt_ids
from lmforge.models.tokenizer import ByteTokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")


def masked_text(tok, enc) -> str:
    return tok.decode([i for i, m in zip(enc.ids, enc.assistant_mask) if m], skip_special=False)


def test_byte_format_layout_and_mask():
    tok = ByteTokenizer()
    sp = tok.special_tokens
    enc = ByteChatFormat(tok).encode(CONVERSATIONS[1])
    expect = [sp["bos"], sp["system"], *b"you are helpful.", sp["end"], sp["user"], *b"reverse the word dog",
              sp["end"], sp["assistant"], *b"god", sp["eos"], sp["user"], *b"and fox?", sp["end"],
              sp["assistant"], *b" xof ", sp["eos"]]
    assert enc.ids == expect
    # Loss tokens: the assistant contents and the EOS that ends each of its turns, nothing else.
    assert masked_text(tok, enc) == "god<|eos|> xof <|eos|>"
    assert sum(enc.assistant_mask) == len("god") + 1 + len(" xof ") + 1
    # Message text never becomes a control token.
    smuggle = ByteChatFormat(tok).encode([{"role": "user", "content": "<|eos|>"}])
    assert sp["eos"] not in smuggle.ids
    assert chat_prompt_ids(tok, "hi") == [sp["bos"], sp["user"], *b"hi", sp["end"], sp["assistant"]]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, INDENTED_TEMPLATE], ids=["prefix-stable", "indented"])
def test_template_matches_transformers(tok_dir, template):
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    hf.chat_template = template
    tok = load_tokenizer(str(tok_dir))
    fmt = JinjaChatFormat(template, tok, {"bos_token": "<s>", "eos_token": "<|im_end|>"})
    for conv in CONVERSATIONS:
        assert fmt.render(conv) == hf.apply_chat_template(conv, tokenize=False)
        ours = fmt.encode(conv)
        theirs = hf.apply_chat_template(conv, tokenize=True)
        theirs = theirs["input_ids"] if not isinstance(theirs, list) else theirs
        assert ours.ids == theirs
        # The assistant tokens are exactly the answers and their end-of-turn token.
        answers = [m["content"].strip() for m in conv if m["role"] == "assistant"]
        text = masked_text(tok, ours)
        for a in answers:
            assert f"{a}<|im_end|>" in text
        assert "user" not in text and "what is" not in text and "<|im_start|>" not in text
    prompt = fmt.prompt_ids(CONVERSATIONS[0][:1])
    hf_prompt = hf.apply_chat_template(CONVERSATIONS[0][:1], tokenize=True, add_generation_prompt=True)
    assert prompt == (hf_prompt["input_ids"] if not isinstance(hf_prompt, list) else hf_prompt)


GENERATION_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] | trim + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_generation_markers_give_transformers_assistant_mask(tok_dir):
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    hf.chat_template = GENERATION_TEMPLATE
    tok = load_tokenizer(str(tok_dir))
    fmt = JinjaChatFormat(GENERATION_TEMPLATE, tok, {"bos_token": "<s>", "eos_token": "<|im_end|>"})
    for conv in CONVERSATIONS:
        out = hf.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        enc = fmt.encode(conv)
        assert enc.ids == out["input_ids"]
        assert enc.assistant_mask == [bool(m) for m in out["assistant_masks"]]
    assert masked_text(tok, fmt.encode(CONVERSATIONS[1])) == "god<|im_end|>xof<|im_end|>"


def test_tokenizer_dir_template_and_errors(tok_dir):
    tok = load_tokenizer(str(tok_dir))
    fmt = chat_format_for(tok)  # reads chat_template and the special token strings from tokenizer_config.json
    assert isinstance(fmt, JinjaChatFormat)
    enc = fmt.encode(CONVERSATIONS[0])
    # The answer and its end-of-turn token; the newline after it is template text, never generated.
    assert masked_text(tok, enc) == "it is four.<|im_end|>"
    # raise_exception inside the template becomes a one-line error naming the record.
    bad = [("chats.jsonl:3", {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})]
    bad[0][1]["messages"][0]["role"] = "tool"
    with pytest.raises(UserError, match=r"chats.jsonl:3: .*role"):
        tokenize_records(bad, tok, fmt)
    with pytest.raises(UserError, match="invalid chat template"):
        JinjaChatFormat("{% for m in messages %}", tok, {})


def test_exported_byte_tokenizer_is_equivalent(tmp_path):
    """The byte tokenizer written as tokenizer.json + BYTE_CHAT_TEMPLATE behaves identically in transformers."""
    tok = ByteTokenizer()
    (tmp_path / "tokenizer.json").write_text(byte_tokenizer_json(tok))
    import json

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
        "pad_token": "<|pad|>", "chat_template": BYTE_CHAT_TEMPLATE, "clean_up_tokenization_spaces": False}))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    text = "Héllo wörld ✓ 12 + 30 =\n\ttabs  and  spaces"
    assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert hf.decode(tok.encode(text)) == text
    for conv in CONVERSATIONS:
        theirs = hf.apply_chat_template(conv, tokenize=True)
        theirs = theirs["input_ids"] if not isinstance(theirs, list) else theirs
        assert theirs == ByteChatFormat(tok).encode(conv).ids
    # lmforge reading the exported directory back gets the same ids and the same masks.
    back = chat_format_for(load_tokenizer(str(tmp_path)))
    for conv in CONVERSATIONS:
        a, b = back.encode(conv), ByteChatFormat(tok).encode(conv)
        assert (a.ids, a.assistant_mask) == (b.ids, b.assistant_mask)


def test_templates_that_need_a_system_message_or_fail_give_file_line_errors(tmp_path):
    """A template that insists on a system message still trains on chats that have one (and finds its
    end-of-turn token); a template that fails on a record names the record, in one line."""
    from lmforge.data.chat import JinjaChatFormat, chat_format_for, stop_token_ids
    from lmforge.data.sft_data import tokenize_records
    from lmforge.errors import UserError

    needs_system = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message is required') }}"
                    "{% endif %}" + CHATML_TEMPLATE)
    tok = load_tokenizer(str(make_tokenizer_dir(tmp_path / "tok", needs_system)))
    chat = chat_format_for(tok)
    assert isinstance(chat, JinjaChatFormat) and tok.token_id("<|im_end|>") in stop_token_ids(tok)
    good = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q"},
                         {"role": "assistant", "content": "a"}]}
    bad = {"messages": good["messages"][1:]}
    [(ids, mask)] = tokenize_records([("d.jsonl:1", good)], tok, chat)
    assert any(mask)
    with pytest.raises(UserError, match=r"^d\.jsonl:2: chat template error: a system message is required$"):
        tokenize_records([("d.jsonl:1", good), ("d.jsonl:2", bad)], tok, chat)
    broken = load_tokenizer(str(make_tokenizer_dir(tmp_path / "tok2", "{{ messages[0]['content'] + 1 }}")))
    with pytest.raises(UserError, match=r"^d\.jsonl:1: chat template error: TypeError"):
        tokenize_records([("d.jsonl:1", good)], broken, chat_format_for(broken))
