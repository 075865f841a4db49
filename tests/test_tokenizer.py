import json

import pytest

from lmforge.errors import UserError
from lmforge.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer


def test_byte_roundtrip_unicode():
    tok = ByteTokenizer()
    text = "héllo wörld — 你好 🙂\nnew line\ttab"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_specials():
    tok = ByteTokenizer()
    assert tok.vocab_size % 64 == 0 and tok.vocab_size == 320
    assert set(tok.special_tokens) == {"bos", "eos", "pad", "system", "user", "assistant", "end"}
    assert len(set(tok.special_tokens.values())) == 7
    assert all(256 <= i < tok.vocab_size for i in tok.special_tokens.values())
    assert tok.token_id("<|eos|>") == tok.eos_id == tok.special_tokens["eos"]
    assert tok.token_id("<|assistant|>") == tok.special_tokens["assistant"]
    assert tok.token_id("<|nope|>") is None
    assert tok.token_id("a") == ord("a")
    assert tok.chat_template is None
    assert isinstance(tok, Tokenizer)

    # Plain text that spells a special token stays plain bytes.
    ids = tok.encode("<|eos|>hi", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.eos_id not in ids[1:-1]
    assert tok.decode(ids) == "<|eos|>hi"
    assert tok.decode(ids, skip_special=False) == "<|bos|><|eos|>hi<|eos|>"


def test_byte_decode_tolerates_invalid_bytes():
    tok = ByteTokenizer()
    ids = tok.encode("é")
    assert tok.decode(ids[:1] + [ord("x")]) == "\ufffdx"
    assert tok.decode([300]) == ""  # padding id beyond the specials


def _build_hf_dir(tmp_path, with_config=True):
    from tokenizers import Tokenizer as HFTok
    from tokenizers import models, pre_tokenizers, trainers

    hf = HFTok(models.WordLevel(unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "</s>", "<pad>"])
    hf.train_from_iterator(["the cat sat on the mat", "a dog ran to the cat"], trainer)
    hf.save(str(tmp_path / "tokenizer.json"))
    if with_config:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({
            "bos_token": "<s>",
            "eos_token": {"content": "</s>", "special": True},
            "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}",
            "added_tokens_decoder": {
                "99": {"content": "<|im_start|>", "special": True},
            },
        }))
    return tmp_path


def test_hf_tokenizer_from_dir(tmp_path):
    d = _build_hf_dir(tmp_path)
    tok = load_tokenizer(str(d))
    assert isinstance(tok, HFTokenizer)
    assert tok.bos_id == tok.token_id("<s>")
    assert tok.eos_id == tok.token_id("</s>")
    assert tok.pad_id == tok.eos_id  # no pad_token in the config -> falls back to EOS
    assert tok.chat_template.startswith("{% for")
    # added_tokens_decoder entries missing from tokenizer.json are registered.
    im = tok.token_id("<|im_start|>")
    assert im is not None and tok.special_tokens["<|im_start|>"] == im
    assert tok.vocab_size == 9 + 4 + 1  # words + specials + the added token

    ids = tok.encode("the cat sat", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and len(ids) == 5
    assert tok.decode(ids) == "the cat sat"
    assert "<s>" in tok.decode(ids, skip_special=False)
    assert tok.encode_batch(["the cat", "a dog"]) == [tok.encode("the cat"), tok.encode("a dog")]


def test_hf_tokenizer_file_path_and_no_config(tmp_path):
    d = _build_hf_dir(tmp_path, with_config=False)
    tok = load_tokenizer(str(d / "tokenizer.json"))
    assert tok.eos_id == tok.token_id("</s>")  # found among common EOS spellings
    assert tok.chat_template is None


def test_load_tokenizer_errors(tmp_path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(UserError, match="no such file"):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(UserError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))  # exists, but holds no tokenizer.json
    d = _build_hf_dir(tmp_path)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(UserError, match="not in the vocabulary"):
        load_tokenizer(str(d))


def test_offsets_are_transformers_offsets():
    """One encoding of a whole text, with each token's characters (what chat masks are built from)."""
    from pathlib import Path

    transformers = pytest.importorskip("transformers")
    d = Path(__file__).resolve().parent / "fixtures" / "tokenizers" / "mistral-7b-instruct-v0.1"
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    tok = load_tokenizer(str(d))
    text = "<s>[INST] Héllo  wörld 你好 [/INST]no</s> "
    ids, offsets = tok.encode_with_offsets(text)
    theirs = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    assert ids == theirs["input_ids"] == tok.encode(text)
    assert offsets == [tuple(o) for o in theirs["offset_mapping"]]
    assert {"<s>", "</s>", "<unk>"} <= set(tok.control_tokens)
    byte = ByteTokenizer()
    ids, offsets = byte.encode_with_offsets("aé")
    assert ids == byte.encode("aé") and offsets == [(0, 1), (1, 2), (1, 2)]


def test_generation_config_stop_ids(tmp_path):
    d = _build_hf_dir(tmp_path)
    assert load_tokenizer(str(d)).generation_eos_ids == []
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    assert load_tokenizer(str(d)).generation_eos_ids == [2, 3]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert load_tokenizer(str(d)).generation_eos_ids == [2]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5000]}))
    with pytest.raises(UserError, match=r"generation_config.json: eos_token_id 5000"):
        load_tokenizer(str(d))
    (d / "generation_config.json").write_text("{oops")
    with pytest.raises(UserError, match=r"generation_config.json: invalid JSON"):
        load_tokenizer(str(d))
