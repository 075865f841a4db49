"""A tokenizer as GGUF metadata (``tokenizer.ggml.*``, ``tokenizer.chat_template``), for llama.cpp.

A GGUF file carries no ``tokenizer.json``: llama.cpp rebuilds the tokenizer from a token list, token
types, merges and the *name* of a pre-tokenizer it implements in C++. Two kinds of Hugging Face
``tokenizer.json`` BPE are written:

* byte-level BPE (GPT-2 style: SmolLM2, Qwen2.5, Llama 3, lmforge's byte tokenizer) becomes
  ``tokenizer.ggml.model = "gpt2"`` with the merges and the pre-tokenizer's llama.cpp name. That name
  must be one llama.cpp splits text with exactly as ``tokenizer.json`` does, so it is recognised
  from the pre-tokenizer's own definition (:data:`PRE_TOKENIZERS`); any other split is refused
  rather than guessed, since a wrong one tokenizes differently without any error.
* sentencepiece-style BPE with byte fallback (Mistral, Gemma: ``▁`` for spaces, ``<0xNN>`` byte
  tokens) becomes ``"llama"``. llama.cpp's sentencepiece tokenizer merges by *score*, so each token
  scores minus the rank of the merge that makes it: the highest-scoring adjacent pair is then the
  pair BPE merges first.

Token types follow llama.cpp's converter: added special tokens are CONTROL, other added tokens
USER_DEFINED, ``<0xNN>`` BYTE, rows of the embedding beyond the tokenizer UNUSED ``[PADn]``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmforge.errors import UserError
from lmforge.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = ["PRE_TOKENIZERS", "add_tokenizer"]

_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, tuple[tuple[str, Any], ...]] = {
    "gpt-2": (("ByteLevel", True),),
    "smollm": (("Digits", True), ("ByteLevel", True)),
    "qwen2": (("Split", _QWEN2_SPLIT), ("ByteLevel", False)),
    "llama-bpe": (("Split", _LLAMA3_SPLIT), ("ByteLevel", False)),
}
"""llama.cpp pre-tokenizer name -> the ``tokenizer.json`` pre-tokenizer it reproduces, as a sequence of
(type, setting): ByteLevel's ``use_regex`` (GPT-2's split), Digits' ``individual_digits``, Split's regex."""

# gguf.TokenType values (written as plain ints so this module imports without the gguf package).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def _steps(pre: dict[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    if pre is None:
        return ()
    if pre.get("type") == "Sequence":
        return tuple(s for p in pre.get("pretokenizers", []) for s in _steps(p))
    kind = pre.get("type")
    setting = {"ByteLevel": pre.get("use_regex", True), "Digits": pre.get("individual_digits", False),
               "Split": (pre.get("pattern") or {}).get("Regex")}.get(kind)
    return ((kind, setting),)


def _pre_name(data: dict[str, Any], where: str) -> str:
    steps = _steps(data.get("pre_tokenizer"))
    for name, known in PRE_TOKENIZERS.items():
        if steps == known:
            return name
    if steps == (("ByteLevel", False),) and not data["model"].get("merges"):
        return "gpt-2"  # no merges (lmforge's byte tokenizer): every byte is a token whatever the split
    raise UserError(f"{where}: its pre_tokenizer {json.dumps(data.get('pre_tokenizer'))[:120]} has no llama.cpp "
                    f"equivalent known to lmforge (known: {', '.join(PRE_TOKENIZERS)})")


def _merges(model: dict[str, Any]) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges") or []]


def _is_sentencepiece_style(data: dict[str, Any]) -> bool:
    text = json.dumps(data.get("normalizer"), ensure_ascii=False) + json.dumps(data.get("pre_tokenizer"), ensure_ascii=False)
    return bool(data["model"].get("byte_fallback")) and "\u2581" in text


def _backend(tokenizer: HFTokenizer) -> Any:
    """The ``tokenizers.Tokenizer`` with the config-only added tokens lmforge registered on load."""
    return tokenizer._tok  # noqa: SLF001 - the same object lmforge encodes with


def _chat_template(tokenizer: Tokenizer) -> str | None:
    from lmforge.data.chat import BYTE_CHAT_TEMPLATE

    if isinstance(tokenizer, ByteTokenizer):
        return BYTE_CHAT_TEMPLATE
    if tokenizer.chat_template:
        return tokenizer.chat_template
    jinja = Path(tokenizer.path) / "chat_template.jinja"
    return jinja.read_text(encoding="utf-8") if jinja.is_file() else None


def _tokenizer_json(tokenizer: Tokenizer) -> tuple[Any, dict[str, Any], str]:
    """The ``tokenizers`` backend, its parsed ``tokenizer.json`` and a name for error messages."""
    from tokenizers import Tokenizer as HFTok

    if isinstance(tokenizer, ByteTokenizer):
        from lmforge.models.tokenizer import byte_tokenizer_json

        text = byte_tokenizer_json(tokenizer)
        return HFTok.from_str(text), json.loads(text), "the byte tokenizer"
    if not isinstance(tokenizer, HFTokenizer):
        raise UserError(f"cannot write tokenizer {tokenizer!r} to GGUF: only byte and tokenizer.json tokenizers")
    path = Path(tokenizer.path) / "tokenizer.json"
    return _backend(tokenizer), json.loads(path.read_text(encoding="utf-8")), str(path)


def add_tokenizer(writer: Any, tokenizer: Tokenizer, n_vocab: int) -> None:
    """Write ``tokenizer`` into ``writer`` (a ``gguf.GGUFWriter``) for a model with ``n_vocab`` rows."""
    backend, data, where = _tokenizer_json(tokenizer)
    model = data["model"]
    if model.get("type", "BPE") != "BPE":
        raise UserError(f"{where}: a {model.get('type')} tokenizer cannot be written to GGUF (only BPE)")
    size = backend.get_vocab_size(with_added_tokens=True)
    if size > n_vocab:
        raise UserError(f"{where}: {size} tokens for a model of {n_vocab} embedding rows")
    added = backend.get_added_tokens_decoder()
    spm = _is_sentencepiece_style(data)
    merges = _merges(model)
    rank = {a + b: r for r, (a, b) in reversed(list(enumerate(merges)))}  # the first merge making a token
    tokens, types, scores = [], [], []
    for i in range(n_vocab):
        text = backend.id_to_token(i) if i < size else None
        if text is None:
            tokens.append(f"[PAD{i}]"), types.append(UNUSED), scores.append(-1000.0)
            continue
        tokens.append(text)
        if i in added:
            types.append(CONTROL if added[i].special else USER_DEFINED)
        elif text == model.get("unk_token"):
            types.append(UNKNOWN)
        elif spm and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            types.append(BYTE)
        else:
            types.append(NORMAL)
        scores.append(-1000.0 if i in added else -float(rank.get(text, -1) + 1))
    writer.add_tokenizer_model("llama" if spm else "gpt2")
    writer.add_tokenizer_pre("default" if spm else _pre_name(data, where))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if spm:
        writer.add_token_scores(scores)
        writer.add_add_space_prefix("Prepend" in json.dumps(data.get("normalizer")))
    if merges and not any(" " in a or " " in b for a, b in merges):  # "a b" cannot hold a token with a space
        writer.add_token_merges([f"{a} {b}" for a, b in merges])
    _add_special_ids(writer, tokenizer, backend, model)
    template = _chat_template(tokenizer)
    if template:
        writer.add_chat_template(template)


def _add_special_ids(writer: Any, tokenizer: Tokenizer, backend: Any, model: dict[str, Any]) -> None:
    """BOS/EOS/PAD/UNK ids, the end-of-turn token, and whether encoding adds BOS/EOS (what
    ``tokenizer.json``'s post-processor does; llama.cpp adds them when these flags say so)."""
    from lmforge.data.chat import stop_token_ids

    writer.add_bos_token_id(tokenizer.bos_id)
    writer.add_eos_token_id(tokenizer.eos_id)
    writer.add_pad_token_id(tokenizer.pad_id)
    unk = model.get("unk_token")
    if unk is not None and backend.token_to_id(unk) is not None:
        writer.add_unk_token_id(backend.token_to_id(unk))
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    writer.add_add_bos_token(len(full) > len(plain) and full[0] == tokenizer.bos_id)
    writer.add_add_eos_token(len(full) > len(plain) and full[-1] == tokenizer.eos_id)
    others = [i for i in stop_token_ids(tokenizer) if i != tokenizer.eos_id]
    if others:  # the chat template's end of turn when it is not EOS (llama.cpp stops at both)
        writer.add_eot_token_id(others[-1])
