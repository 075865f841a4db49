"""Chat templates: conversations to token ids plus a per-token mask of what the assistant wrote.

Two formats share one interface (:class:`ChatFormat`):

* :class:`ByteChatFormat` - the built-in format of the byte tokenizer, built from ids directly::

      <|bos|><|system|>...<|end|><|user|>...<|end|><|assistant|>...<|eos|><|user|>...

  Assistant turns end with EOS, so "stop generating" is the same token in chat and plain text.
  Message text is encoded as bytes, so it can never produce a control token.
* :class:`JinjaChatFormat` - a Hugging Face ``chat_template`` rendered with jinja2 the way
  ``transformers`` renders it (sandboxed, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``,
  ``tojson``, special tokens as variables), then tokenized.

The assistant mask of a Jinja template is found by rendering prefixes of the conversation: the text
between "everything before turn i plus the generation prompt" and "everything up to and including
turn i" is what the assistant produced, including its end-of-turn token. Each piece is tokenized on
its own, which is also how the model meets it at inference time: the prompt is tokenized alone and
the answer is generated token by token after it. A template whose renderings are not prefixes of each
other falls back to locating each assistant message's content in the full rendering.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, Sequence

from lmforge.errors import UserError
from lmforge.models.tokenizer import ByteTokenizer, Tokenizer

__all__ = ["ChatFormat", "ByteChatFormat", "JinjaChatFormat", "EncodedChat", "chat_format_for",
           "BYTE_CHAT_TEMPLATE", "validate_messages"]

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


def validate_messages(messages: Any) -> list[dict[str, str]]:
    """Check the ``messages`` shape; raises ValueError with a short reason (callers add file:line)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} needs string 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ValueError(f"message {i} has role {m['role']!r} (expected one of {', '.join(ROLES)})")
        out.append({"role": m["role"], "content": m["content"]})
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


def _token_string(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _jinja_environment():
    """A jinja2 environment configured like the one ``transformers`` renders chat templates in."""
    try:
        import jinja2
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 is a core dependency
        raise UserError("chat templates need the 'jinja2' package") from e

    class GenerationBlock(Extension):
        """Accept ``{% generation %}...{% endgeneration %}`` (a marker some templates use); render the body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class JinjaChatFormat:
    """A Hugging Face chat template, rendered and tokenized as ``transformers`` does.

    ``special_strings`` are the template variables (``bos_token``, ``eos_token``, ...). The rendered
    text is tokenized without adding specials: templates write BOS themselves where they want it.
    """

    def __init__(self, template: str, tokenizer: Tokenizer, special_strings: dict[str, str],
                 source: str = "chat_template") -> None:
        import jinja2

        self.tok = tokenizer
        self.source = source
        self.variables = dict(special_strings)
        try:
            self.template = _jinja_environment().from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise UserError(f"{source}: invalid chat template (line {e.lineno}: {e.message})") from None

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = False) -> str:
        import jinja2

        try:
            return self.template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                        tools=None, documents=None, **self.variables)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from None

    def _encode_text(self, text: str) -> list[int]:
        return self.tok.encode(text) if text else []

    def _pieces(self, spans: list[tuple[str, bool]]) -> EncodedChat:
        ids: list[int] = []
        mask: list[bool] = []
        for text, is_answer in spans:
            piece = self._encode_text(text)
            ids += piece
            mask += [is_answer] * len(piece)
        return EncodedChat(ids, mask)

    def _spans_by_prefix(self, messages: Sequence[dict[str, str]]) -> list[tuple[str, bool]] | None:
        """(text, is_answer) pieces from prefix renderings; None if the template is not prefix-stable."""
        spans: list[tuple[str, bool]] = []
        done = ""  # the text already split into pieces
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[: i + 1])
            if not (before.startswith(done) and through.startswith(before)):
                return None
            spans += [(before[len(done):], False), (through[len(before):], True)]
            done = through
        full = self.render(messages)
        if not full.startswith(done):
            return None
        return spans + [(full[len(done):], False)]

    def _spans_by_search(self, messages: Sequence[dict[str, str]]) -> list[tuple[str, bool]]:
        """Fallback: find each assistant message's content in the full rendering, in order.

        The answer span is the content (as written, or stripped, as many templates ``trim`` it) plus
        the EOS string when it follows immediately.
        """
        full = self.render(messages)
        eos = self.variables.get("eos_token", "")
        spans: list[tuple[str, bool]] = []
        cursor = 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            for content in (m["content"], m["content"].strip()):
                at = full.find(content, cursor) if content else -1
                if at >= 0:
                    break
            else:
                raise ValueError(f"{self.source}: cannot locate assistant message {i} in the rendered "
                                 "conversation, so its tokens cannot be masked")
            end = at + len(content)
            if eos and full.startswith(eos, end):
                end += len(eos)
            spans += [(full[cursor:at], False), (full[at:end], True)]
            cursor = end
        return spans + [(full[cursor:], False)]

    def encode(self, messages: Sequence[dict[str, str]]) -> EncodedChat:
        spans = self._spans_by_prefix(messages)
        return self._pieces(spans if spans is not None else self._spans_by_search(messages))

    def prompt_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return self._encode_text(self.render(messages, add_generation_prompt=True))


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
