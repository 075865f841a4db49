"""Tokenizers: a file-free byte tokenizer and a wrapper around Hugging Face ``tokenizer.json``.

Special tokens live here and nowhere else. Encoding plain text with :class:`ByteTokenizer`
never yields a special id; BOS/EOS appear only through ``add_bos``/``add_eos`` (or through a
chat template rendered later), so user text can never smuggle in control tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

from lmforge.errors import UserError

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "byte_tokenizer_json", "load_tokenizer", "generation_eos_ids"]

Offsets = list[tuple[int, int]]
"""Per token, the ``[start, end)`` character range of the text it came from."""


@runtime_checkable
class Tokenizer(Protocol):
    """What trainers, datasets and generation code rely on."""

    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    special_tokens: dict[str, int]
    control_tokens: dict[str, int]
    """The literal strings of the special tokens (``"<|im_end|>"``, ``"</s>"``, ...) and their ids."""
    chat_template: str | None

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]: ...

    def encode_with_offsets(self, text: str) -> tuple[list[int], Offsets]: ...

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str: ...

    def token_id(self, token: str) -> int | None: ...


# Names (keys of ``special_tokens``) and their literal strings, in id order after the 256 bytes.
_BYTE_SPECIALS: tuple[tuple[str, str], ...] = (
    ("bos", "<|bos|>"),
    ("eos", "<|eos|>"),
    ("pad", "<|pad|>"),
    ("system", "<|system|>"),
    ("user", "<|user|>"),
    ("assistant", "<|assistant|>"),
    ("end", "<|end|>"),
)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


class ByteTokenizer:
    """UTF-8 bytes as tokens (ids 0-255), followed by a handful of special tokens.

    Needs no files, so every example and test runs offline. ``vocab_size`` is padded to a
    multiple of 64 because embedding/output matrices with such sizes run faster on GPUs; the
    padding ids are never produced and decode to nothing.
    """

    def __init__(self) -> None:
        self.special_tokens: dict[str, int] = {
            name: 256 + i for i, (name, _) in enumerate(_BYTE_SPECIALS)
        }
        self._literal_to_id = {lit: 256 + i for i, (_, lit) in enumerate(_BYTE_SPECIALS)}
        self._id_to_literal = {i: lit for lit, i in self._literal_to_id.items()}
        self.vocab_size: int = _round_up(256 + len(_BYTE_SPECIALS), 64)
        self.bos_id: int = self.special_tokens["bos"]
        self.eos_id: int = self.special_tokens["eos"]
        self.pad_id: int = self.special_tokens["pad"]
        self.control_tokens: dict[str, int] = dict(self._literal_to_id)
        self.chat_template: str | None = None

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], Offsets]:
        """Byte ids, each with the character range of the character its byte belongs to."""
        ids: list[int] = []
        offsets: Offsets = []
        for i, ch in enumerate(text):
            raw = ch.encode("utf-8")
            ids += raw
            offsets += [(i, i + 1)] * len(raw)
        return ids, offsets

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        # Bytes are gathered in runs so a multi-byte character split across ids still decodes;
        # invalid sequences (a model can emit any byte order) become U+FFFD rather than raising.
        parts: list[str] = []
        run = bytearray()
        for raw in ids:
            i = int(raw)
            if 0 <= i < 256:
                run.append(i)
                continue
            if run:
                parts.append(run.decode("utf-8", errors="replace"))
                run.clear()
            if not skip_special and i in self._id_to_literal:
                parts.append(self._id_to_literal[i])
        if run:
            parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)

    def token_id(self, token: str) -> int | None:
        if token in self._literal_to_id:
            return self._literal_to_id[token]
        raw = token.encode("utf-8")
        return raw[0] if len(raw) == 1 else None

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


def _token_content(value: Any) -> str | None:
    """``tokenizer_config.json`` stores tokens either as strings or as AddedToken dicts."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


# Tried, in order, when tokenizer_config.json does not name an EOS token.
_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")


class HFTokenizer:
    """A ``tokenizers`` tokenizer loaded from a local directory (no network, no transformers).

    ``tokenizer_config.json`` (optional) supplies the bos/eos/pad tokens, the chat template and
    added tokens. A missing pad token falls back to EOS (padding positions carry no loss, so any
    valid id works); a missing BOS also falls back to EOS, as GPT-2-style vocabularies do.
    """

    def __init__(self, path: str | Path) -> None:
        try:
            from tokenizers import Tokenizer as _HFTok
        except ImportError as e:  # pragma: no cover - tokenizers is a core dependency
            raise UserError(f"the 'tokenizers' package is required to load {path}") from e

        path = Path(path)
        tok_file = path if path.is_file() else path / "tokenizer.json"
        if not tok_file.is_file():
            raise UserError(f"tokenizer not found: {tok_file} does not exist")
        try:
            self._tok = _HFTok.from_file(str(tok_file))
        except Exception as e:  # the Rust error is one line already
            raise UserError(f"{tok_file}: cannot load tokenizer ({e})") from e

        config = self._read_config(tok_file.parent / "tokenizer_config.json")
        self.chat_template: str | None = config.get("chat_template") if isinstance(
            config.get("chat_template"), str
        ) else None
        self._add_missing_tokens(config.get("added_tokens_decoder") or {})

        eos = self._resolve(config, "eos_token")
        if eos is None:
            eos = next((self._tok.token_to_id(c) for c in _EOS_CANDIDATES
                        if self._tok.token_to_id(c) is not None), None)
        if eos is None:
            raise UserError(
                f"{tok_file.parent}: no EOS token; set eos_token in tokenizer_config.json"
            )
        bos = self._resolve(config, "bos_token")
        pad = self._resolve(config, "pad_token")
        self.eos_id: int = eos
        self.bos_id: int = bos if bos is not None else eos
        self.pad_id: int = pad if pad is not None else eos
        self.special_tokens: dict[str, int] = {"bos": self.bos_id, "eos": self.eos_id,
                                               "pad": self.pad_id}
        for entry in (config.get("added_tokens_decoder") or {}).values():
            content = _token_content(entry)
            if content and isinstance(entry, dict) and entry.get("special"):
                tid = self._tok.token_to_id(content)
                if tid is not None:
                    self.special_tokens.setdefault(content, tid)
        self.control_tokens: dict[str, int] = {
            t.content: i for i, t in sorted(self._tok.get_added_tokens_decoder().items()) if t.special}
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.path = tok_file.parent
        self.generation_eos_ids: list[int] = generation_eos_ids(self.path, self.vocab_size)
        """``eos_token_id`` of ``generation_config.json`` next to the tokenizer files (the model's stop ids)."""

    @staticmethod
    def _read_config(path: Path) -> dict[str, Any]:
        if not path.is_file():
            return {}
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{path}: invalid JSON ({e})") from e
        if not isinstance(config, dict):
            raise UserError(f"{path}: expected a JSON object at the top level")
        return config

    def _add_missing_tokens(self, decoder: dict[str, Any]) -> None:
        """Register config-only added tokens so that they encode as single ids."""
        from tokenizers import AddedToken

        for entry in decoder.values():
            content = _token_content(entry)
            if content is None or self._tok.token_to_id(content) is not None:
                continue
            special = bool(entry.get("special")) if isinstance(entry, dict) else False
            token = AddedToken(content, special=special)
            if special:
                self._tok.add_special_tokens([token])
            else:
                self._tok.add_tokens([token])

    def _resolve(self, config: dict[str, Any], key: str) -> int | None:
        content = _token_content(config.get(key))
        if content is None:
            return None
        tid = self._tok.token_to_id(content)
        if tid is None:
            raise UserError(
                f"{self.__class__.__name__}: {key} {content!r} from tokenizer_config.json "
                "is not in the vocabulary"
            )
        return tid

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        # The tokenizer's own post-processor is bypassed so that BOS/EOS are added exactly once,
        # here, whatever tokenizer.json says.
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], Offsets]:
        """``encode(text)`` with each token's character range in ``text`` (tokenized in one piece)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, [tuple(o) for o in enc.offsets]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Fast path for datasets: encodes in parallel in Rust, no specials added."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def generation_eos_ids(directory: Path, vocab_size: int) -> list[int]:
    """The ``eos_token_id`` (an int or a list) of ``directory/generation_config.json``; [] without one.

    Models list every token that ends a reply there (Qwen2.5: ``<|im_end|>`` and ``<|endoftext|>``),
    while the tokenizer names only one EOS.
    """
    path = directory / "generation_config.json"
    if not path.is_file():
        return []
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise UserError(f"{path}: invalid JSON object ({e})") from None
    ids = value if isinstance(value, list) else [] if value is None else [value]
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab_size:
            raise UserError(f"{path}: eos_token_id {i!r} is not a token id of this tokenizer "
                            f"(0..{vocab_size - 1})")
    return ids


def load_tokenizer(spec: str) -> Tokenizer:
    """``"byte"`` gives :class:`ByteTokenizer`; anything else is a local directory holding
    ``tokenizer.json`` (or the path of that file itself)."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.exists():
        raise UserError(f"tokenizer {spec!r}: no such file or directory (use 'byte' or a "
                        "directory containing tokenizer.json)")
    return HFTokenizer(path)


def _bytes_to_unicode() -> dict[int, str]:
    """Byte -> printable character table of byte-level BPE tokenizers (what ``ByteLevel`` expects).

    Printable Latin-1 bytes map to themselves; the rest are moved to code points from 256 upward.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def byte_tokenizer_json(tokenizer: ByteTokenizer) -> str:
    """A ``tokenizer.json`` that encodes and decodes exactly like :class:`ByteTokenizer`.

    Byte-level BPE with no merges: every byte is one token with id = byte value, then the special
    tokens at their lmforge ids.
    """
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers

    table = _bytes_to_unicode()
    tok = HFTok(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    literals = sorted(((i, tokenizer.decode([i], skip_special=False)) for i in tokenizer.special_tokens.values()))
    for expected, literal in literals:
        tok.add_special_tokens([AddedToken(literal, special=True, normalized=False)])
        if tok.token_to_id(literal) != expected:
            raise RuntimeError(f"byte tokenizer export: {literal} got id {tok.token_to_id(literal)}, not {expected}")
    return tok.to_str()
