"""Chat templates of real model families (Qwen2.5, SmolLM2, Mistral v0.1) against ``transformers``.

The tokenizer files are the published ones (tests/fixtures/tokenizers). For each family: token ids equal
``apply_chat_template(tokenize=True)``, the assistant mask is exactly each answer plus its end-of-turn
token, inference prompts are the training prefix, and generation stops at the end-of-turn token.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _chat_fixtures import make_end_of_turn_tokenizer_dir
from lmforge.data.chat import JinjaChatFormat, chat_format_for, stop_token_ids
from lmforge.errors import UserError
from lmforge.inference import chat_prompt_ids, sample_texts
from lmforge.models.model import ModelArgs, Transformer
from lmforge.models.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FAMILIES = {  # folder -> the token that ends an assistant turn
    "qwen2.5-instruct": "<|im_end|>",
    "smollm2-135m-instruct": "<|im_end|>",
    "mistral-7b-instruct-v0.1": "</s>",
}
SYSTEM = {"role": "system", "content": "You are terse. Answer in one word."}
CHAT = [
    {"role": "user", "content": "Is grass red? Say no if not."},
    {"role": "assistant", "content": "no"},
    {"role": "user", "content": "What colour is the sky, then?"},
    {"role": "assistant", "content": "Blue, mostly.\nAt night: black."},
    {"role": "user", "content": "  spaces around  "},
    {"role": "assistant", "content": " ok "},
]


def identity_chats() -> list[list[dict[str, str]]]:
    lines = (FIXTURES / "data" / "fastchat_identity_multiturn.jsonl").read_text().splitlines()
    return [json.loads(line)["messages"] for line in lines]


def accepts_system(family: str) -> bool:
    return not family.startswith("mistral")  # Mistral v0.1's template allows user/assistant alternation only


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    d = FIXTURES / "tokenizers" / request.param
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    tok = load_tokenizer(str(d))
    return request.param, hf, tok, chat_format_for(tok)


def hf_ids(hf, messages, **kw) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, **kw)
    return out["input_ids"] if not isinstance(out, list) else out


def answer_runs(enc) -> list[tuple[int, int]]:
    """(start, end) of each run of consecutive masked positions."""
    runs: list[tuple[int, int]] = []
    for i, m in enumerate(enc.assistant_mask):
        if m and (i == 0 or not enc.assistant_mask[i - 1]):
            runs.append((i, i))
        if m:
            runs[-1] = (runs[-1][0], i + 1)
    return runs


def answer_texts(tok, enc) -> list[str]:
    """The text of each masked run, decoded after the token before it: a SentencePiece decoder drops the
    leading space of a text's first token, so a run decoded alone would hide a masked stray space."""
    texts = []
    for start, end in answer_runs(enc):
        before = tok.decode(enc.ids[start - 1:start], skip_special=False)
        texts.append(tok.decode(enc.ids[start - 1:end], skip_special=False)[len(before):])
    return texts


def test_ids_and_mask_match_transformers(family):
    name, hf, tok, fmt = family
    chats = [CHAT, CHAT[:2]] + ([[SYSTEM, *CHAT], [SYSTEM, *CHAT[:4]]] if accepts_system(name) else [])
    end = FAMILIES[name]
    for messages in chats:
        enc = fmt.encode(messages)
        assert enc.ids == hf_ids(hf, messages)
        # Masked: each answer as the template writes it, then its end-of-turn token; nothing else.
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        assert answer_texts(tok, enc) == [a + end for a in answers]


def test_bulk_identity_chats_match_transformers(family):
    name, hf, tok, fmt = family
    for messages in identity_chats():
        enc = fmt.encode(messages)
        assert enc.ids == hf_ids(hf, messages)
        assert len(answer_runs(enc)) == sum(m["role"] == "assistant" for m in messages)


def test_prompt_ids_are_the_training_prefix(family):
    name, hf, tok, fmt = family
    chats = identity_chats()[:6] + [CHAT] + ([[SYSTEM, *CHAT]] if accepts_system(name) else [])
    for messages in chats:
        enc = fmt.encode(messages)
        last = max(i for i, m in enumerate(enc.assistant_mask) if m and not enc.assistant_mask[i - 1])
        prompt = fmt.prompt_ids(messages[:-1])
        assert prompt == enc.ids[:last]
        assert prompt == hf_ids(hf, messages[:-1], add_generation_prompt=True)


def test_stop_ids_contain_the_end_of_turn_token(family):
    name, hf, tok, fmt = family
    stops = stop_token_ids(tok)
    assert tok.token_id(FAMILIES[name]) in stops and tok.eos_id in stops
    gen_cfg = json.loads((FIXTURES / "tokenizers" / name / "generation_config.json").read_text())["eos_token_id"]
    assert set(gen_cfg if isinstance(gen_cfg, list) else [gen_cfg]) <= set(stops)
    if name == "qwen2.5-instruct":
        assert stops == [tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")]


def test_mistral_refuses_a_system_message_like_transformers():
    d = FIXTURES / "tokenizers" / "mistral-7b-instruct-v0.1"
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    tok = load_tokenizer(str(d))
    messages = [SYSTEM, *CHAT[:2]]
    with pytest.raises(Exception) as theirs:
        hf.apply_chat_template(messages, tokenize=True)
    with pytest.raises(ValueError) as ours:
        chat_format_for(tok).encode(messages)
    assert str(theirs.value) in str(ours.value) and "\n" not in str(ours.value)
    with pytest.raises(UserError, match="roles must alternate"):
        chat_prompt_ids(tok, "hi", system="be brief")


# Mistral-v0.3 style: the system prompt is folded into the LAST user turn, so renderings of a prefix of
# the conversation are not prefixes of the whole rendering.
FOLDED_SYSTEM_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- ' ' + message['content'] + eos_token }}"
    "{%- endif %}{%- endfor %}"
)


def mistral_with(template: str):
    d = FIXTURES / "tokenizers" / "mistral-7b-instruct-v0.1"
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    hf.chat_template = template
    tok = load_tokenizer(str(d))
    return hf, tok, JinjaChatFormat(template, tok, {"bos_token": "<s>", "eos_token": "</s>"}, "folded.jinja")


def test_answer_text_repeated_in_a_user_turn_is_not_masked():
    hf, tok, fmt = mistral_with(FOLDED_SYSTEM_TEMPLATE)
    messages = [SYSTEM, *CHAT[:4]]
    enc = fmt.encode(messages)
    assert enc.ids == hf_ids(hf, messages)
    # The template writes " " + content and SentencePiece merges that space into the answer's first token
    # ("▁no"), so that token is the answer's; the "no" of the user turn is not.
    assert answer_texts(tok, enc) == [" no</s>", " Blue, mostly.\nAt night: black.</s>"]
    # The same template with generation markers: the mask is transformers' assistant mask exactly.
    marked = FOLDED_SYSTEM_TEMPLATE.replace("{{- ' ' + message['content'] + eos_token }}",
                                            "{% generation %}{{- ' ' + message['content'] + eos_token }}"
                                            "{% endgeneration %}")
    hf, tok, fmt = mistral_with(marked)
    out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    enc = fmt.encode(messages)
    assert enc.ids == out["input_ids"]
    assert enc.assistant_mask == [bool(m) for m in out["assistant_masks"]]
    assert sum(enc.assistant_mask) > 0


def test_a_template_that_rewrites_answers_is_refused_naming_it():
    upper = FOLDED_SYSTEM_TEMPLATE.replace("' ' + message['content'] + eos_token",
                                           "' ' + message['content'] | upper + eos_token")
    _, _, fmt = mistral_with(upper)
    with pytest.raises(ValueError, match=r"^folded.jinja: .*assistant message 1"):
        fmt.encode(CHAT[:2])
    # A template that trims answers still works: the mask covers the trimmed text.
    _, tok, fmt = mistral_with(FOLDED_SYSTEM_TEMPLATE.replace("message['content'] + eos_token",
                                                              "message['content'] | trim + eos_token"))
    enc = fmt.encode(CHAT[4:6])
    assert answer_texts(tok, enc) == [" ok</s>"]


def forced_model(vocab_size: int, token: int) -> Transformer:
    """A tiny model whose every next token is ``token`` (a large bias on its logit)."""
    m = Transformer(ModelArgs(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=vocab_size, max_seq_len=256))
    m.init_weights(seed=0)
    bias = torch.zeros(vocab_size)
    bias[token] = 1e4
    m.output_calls = 0

    def force(_mod, _inp, out):
        m.output_calls += 1
        return out + bias

    m.output.register_forward_hook(force)
    return m.eval()


@pytest.mark.parametrize("family_name, stop", [("qwen2.5-instruct", "<|endoftext|>"),
                                               ("smollm2-135m-instruct", "<|im_end|>")])
def test_generation_stops_at_any_stop_token(family_name, stop):
    tok = load_tokenizer(str(FIXTURES / "tokenizers" / family_name))
    model = forced_model(tok.vocab_size, tok.token_id(stop))
    from lmforge.models.generate import generate

    prompt = chat_prompt_ids(tok, "hello")
    assert generate(model, [prompt], 20, stop_ids=stop_token_ids(tok), pad_id=tok.pad_id, temperature=0.0) == [
        [tok.token_id(stop)]]
    model.output_calls = 0
    assert sample_texts(model, tok, ["hello"], max_new_tokens=20, chat=True) == [""]
    assert model.output_calls == 1  # the prompt's forward only: the row stopped at its first token


def test_end_of_turn_that_is_not_eos_comes_from_the_template(tmp_path):
    """Llama-3 style: eos is an end-of-text token, turns end with another one; no generation_config.json."""
    tok = load_tokenizer(str(make_end_of_turn_tokenizer_dir(tmp_path)))
    assert tok.eos_id == tok.token_id("<|endoftext|>")
    assert stop_token_ids(tok) == [tok.eos_id, tok.token_id("<|im_end|>")]
    model = forced_model(tok.vocab_size, tok.token_id("<|im_end|>"))
    assert sample_texts(model, tok, ["hello"], max_new_tokens=30, chat=True) == [""]
    assert model.output_calls == 1
