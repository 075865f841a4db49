"""Chat templates: conversations to token ids plus a per-token mask of what the assistant wrote.

Two formats share one interface (:class:`ChatFormat`):

* :class:`ByteChatFormat` - the built-in format of the byte tokenizer, built from ids directly::

      <|bos|><|system|>...<|end|><|user|>...<|end|><|assistant|>...<|eos|><|user|>...

  Assistant turns end with EOS, so "stop generating" is the same token in chat and plain text.
  Message text is encoded as bytes, so it can never produce a control token.
* :class:`JinjaChatFormat` - a Hugging Face ``chat_template`` rendered with jinja2 the way
  ``transformers`` renders it (sandboxed, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``,
  ``tojson``, special tokens as variables), then tokenized.

A Jinja conversation is rendered once and tokenized once, whole, exactly as
``apply_chat_template(tokenize=True)`` does; the assistant mask marks the tokens that overlap an
answer's characters: its content and the end-of-turn token right after it (see
:mod:`lmforge.data.chat_template` for how the spans are found). Inference renders with the generation
prompt and tokenizes that the same way, so training and inference see the same tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

from lmforge.data.chat_template import ChatTemplate, Span
from lmforge.errors import UserError
from lmforge.models.tokenizer import ByteTokenizer, Tokenizer

__all__ = ["ChatFormat", "ByteChatFormat", "JinjaChatFormat", "EncodedChat", "chat_format_for",
           "stop_token_ids", "BYTE_CHAT_TEMPLATE", "validate_messages"]

ROLES = ("system", "user", "assistant")

BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<|assistant|>' + message['content'] + eos_token }}"
    "{% else %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
"""The byte chat format written as a Hugging Face chat template (used when exporting)."""


@dataclass
class EncodedChat:
    ids: list[int]
    assistant_mask: list[bool]
    """True for tokens the assistant produced (its content and end-of-turn token)."""


class ChatFormat(Protocol):
    def encode(self, messages: Sequence[dict[str, str]]) -> EncodedChat:
        """A whole conversation, with the assistant mask."""
        ...

    def prompt_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The conversation followed by the generation prompt (the assistant speaks next)."""
        ...

    def end_of_turn_ids(self) -> list[int]:
        """The token(s) that end an assistant turn: generation stops there."""
        ...


def validate_messages(messages: Any) -> list[dict[str, str]]:
    """Check the ``messages`` shape; raises ValueError with a short reason (callers add file:line).

    ``content`` is a string, or a list of ``{"type": "text", "text": ...}`` parts (the multimodal
    layout Gemma 3 and others use), joined into one string: lmforge trains on text only.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError(f"message {i}: content parts other than {{'type': 'text', 'text': ...}} "
                                 "are not supported (text only)")
            content = "".join(p["text"] for p in content)
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
            raise ValueError(f"message {i} needs string 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ValueError(f"message {i} has role {m['role']!r} (expected one of {', '.join(ROLES)})")
        out.append({"role": m["role"], "content": content})
    return out


class ByteChatFormat:
    """The built-in chat format of :class:`~lmforge.models.tokenizer.ByteTokenizer`."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self.tok = tokenizer
        sp = tokenizer.special_tokens
        self.role_ids = {r: sp[r] for r in ROLES}
        self.end_id = sp["end"]

    def _append(self, ids: list[int], mask: list[bool], message: dict[str, str]) -> None:
        role = message["role"]
        body = self.tok.encode(message["content"])
        ids.append(self.role_ids[role])
        mask.append(False)
        if role == "assistant":
            ids += body + [self.tok.eos_id]
            mask += [True] * (len(body) + 1)
        else:
            ids += body + [self.end_id]
            mask += [False] * (len(body) + 1)

    def encode(self, messages: Sequence[dict[str, str]]) -> EncodedChat:
        ids, mask = [self.tok.bos_id], [False]
        for m in messages:
            self._append(ids, mask, m)
        return EncodedChat(ids, mask)

    def prompt_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return self.encode(messages).ids + [self.role_ids["assistant"]]

    def end_of_turn_ids(self) -> list[int]:
        return [self.tok.eos_id]


def _token_string(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _mask_from_spans(offsets: Sequence[tuple[int, int]], spans: Sequence[Span]) -> list[bool]:
    """True for each token whose characters overlap a span (the rule of transformers' assistant mask)."""
    spans = sorted(spans)
    mask = [False] * len(offsets)
    k = 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        mask[t] = end > spans[k][0]
    return mask


class JinjaChatFormat:
    """A Hugging Face chat template, rendered and tokenized as ``transformers`` does.

    ``special_strings`` are the template variables (``bos_token``, ``eos_token``, ...). The rendered
    text is tokenized once, whole, without adding specials (templates write BOS themselves where they
    want it); tokens are assistant tokens when they overlap an answer span (see
    :mod:`lmforge.data.chat_template`). Inference tokenizes the rendering with the generation prompt the
    same way, so a prompt's ids are the training ids up to the answer.
    """

    def __init__(self, template: str, tokenizer: Tokenizer, special_strings: dict[str, str],
                 source: str = "chat_template") -> None:
        self.tok = tokenizer
        self.source = source
        self.template = ChatTemplate(template, special_strings, source)
        self.control_tokens = list(getattr(tokenizer, "control_tokens", {}))

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return self.template.render(messages, add_generation_prompt)

    def encode(self, messages: Sequence[dict[str, str]]) -> EncodedChat:
        text, spans = self.template.answer_spans(messages, self.control_tokens)
        ids, offsets = self.tok.encode_with_offsets(text)
        return EncodedChat(ids, _mask_from_spans(offsets, spans))

    def prompt_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        text = self.render(messages, add_generation_prompt=True)
        return self.tok.encode(text) if text else []

    def end_of_turn_ids(self) -> list[int]:
        """The special token that ends an assistant turn in this template (``[]`` if it writes none)."""
        token = self.template.end_of_turn(self.control_tokens)
        tid = self.tok.token_id(token) if token else None
        return [tid] if tid is not None else []


def _tokenizer_config(tokenizer: Tokenizer) -> dict[str, Any]:
    path = getattr(tokenizer, "path", None)
    f = Path(path) / "tokenizer_config.json" if path else None
    if f is None or not f.is_file():
        return {}
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}


def _special_strings(tokenizer: Tokenizer, config: dict[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
        s = _token_string(config.get(key))
        if s is not None:
            out[key] = s
    out.setdefault("bos_token", tokenizer.decode([tokenizer.bos_id], skip_special=False))
    out.setdefault("eos_token", tokenizer.decode([tokenizer.eos_id], skip_special=False))
    return out


def _template_text(tokenizer: Tokenizer, override: str | None) -> tuple[str | None, str]:
    if override:
        p = Path(override).expanduser()
        if not p.is_file():
            raise UserError(f"chat template file not found: {p}")
        return p.read_text(encoding="utf-8"), str(p)
    if tokenizer.chat_template:
        return tokenizer.chat_template, f"{getattr(tokenizer, 'path', 'tokenizer')}/tokenizer_config.json"
    path = getattr(tokenizer, "path", None)
    if path and (Path(path) / "chat_template.jinja").is_file():
        f = Path(path) / "chat_template.jinja"
        return f.read_text(encoding="utf-8"), str(f)
    return None, ""


def chat_format_for(tokenizer: Tokenizer, template_file: str | None = None) -> ChatFormat:
    """The chat format of ``tokenizer``: a template file if given, else its own chat template.

    The byte tokenizer has a built-in format; a Hugging Face tokenizer without a chat template
    (and no ``template_file``) cannot format conversations.
    """
    if isinstance(tokenizer, ByteTokenizer) and not template_file:
        return ByteChatFormat(tokenizer)
    text, source = _template_text(tokenizer, template_file)
    if text is None:
        raise UserError(f"{tokenizer!r} has no chat_template (tokenizer_config.json or chat_template.jinja); "
                        "give one with sft.chat_template=FILE.jinja")
    return JinjaChatFormat(text, tokenizer, _special_strings(tokenizer, _tokenizer_config(tokenizer)), source)


def training_chat_format(tokenizer: Tokenizer, vocab_size: int, template_file: str | None = None) -> ChatFormat | None:
    """The chat format a fine-tuning run renders conversations with (``template_file`` or the
    tokenizer's own), or None when the tokenizer has none (only conversational records need one).

    The template's special tokens must exist in the model. Checked on the tokenizer's control tokens
    the template can write (named in its text, or its special-token variables), not by rendering a
    sample chat: a template may rightly refuse any given sample (e.g. one that requires a system
    message), and the data's own chats are rendered and checked line by line. Control tokens the
    template never writes may lie past the model's rows (Gemma 3's tokenizers add an image token
    after the 262,144 text tokens).
    """
    try:
        chat: ChatFormat | None = chat_format_for(tokenizer, template_file)
    except UserError:
        if template_file:
            raise
        return None
    template = getattr(chat, "template", None)
    written = (lambda t: t in template.text or t in template.variables.values()) if template else (lambda t: True)
    bad = sorted((i, t) for t, i in tokenizer.control_tokens.items() if i >= vocab_size and written(t))
    if bad:
        raise UserError(f"chat token {bad[0][1]!r} (id {bad[0][0]}) is outside the model's vocabulary "
                        f"({vocab_size}): model.tokenizer does not match the model")
    return chat


def stop_token_ids(tokenizer: Tokenizer, template_file: str | None = None) -> list[int]:
    """Every token that ends a reply: generation stops at any of them.

    The union, in this order, of the tokenizer's EOS, the ``eos_token_id`` list of the
    ``generation_config.json`` next to its files, and the token the chat template writes after an
    assistant answer. They differ in real models: Llama-3 ends turns with ``<|eot_id|>`` while its EOS
    is ``<|end_of_text|>``; Qwen2.5 lists ``<|im_end|>`` and ``<|endoftext|>``. Stopping at EOS alone
    would run every chat reply to the token limit.
    """
    ids = [tokenizer.eos_id, *getattr(tokenizer, "generation_eos_ids", [])]
    try:
        fmt = chat_format_for(tokenizer, template_file)
    except UserError:  # no chat template: plain text ends at EOS
        fmt = None
    if fmt is not None:
        ids += fmt.end_of_turn_ids()
    return list(dict.fromkeys(ids))
