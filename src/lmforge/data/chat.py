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
from typing import Any, Mapping, Protocol, Sequence

from lmforge.data.chat_template import ChatTemplate, Span, Tools
from lmforge.errors import UserError
from lmforge.models.tokenizer import ByteTokenizer, Tokenizer

__all__ = ["ChatFormat", "ByteChatFormat", "JinjaChatFormat", "EncodedChat", "chat_format_for",
           "stop_token_ids", "BYTE_CHAT_TEMPLATE", "validate_messages", "validate_tools"]

ROLES = ("system", "user", "assistant", "tool")
BYTE_ROLES = ("system", "user", "assistant")

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
    def encode(self, messages: Sequence[Mapping[str, Any]], tools: Tools = None) -> EncodedChat:
        """A whole conversation, with the assistant mask."""
        ...

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]], tools: Tools = None) -> list[int]:
        """The conversation followed by the generation prompt (the assistant speaks next)."""
        ...

    def end_of_turn_ids(self) -> list[int]:
        """The token(s) that end an assistant turn: generation stops there."""
        ...

    def continuation_ids(self, messages: Sequence[Mapping[str, Any]], added: Sequence[Mapping[str, Any]],
                         tools: Tools = None) -> list[int]:
        """The tokens the template writes after the last message (an assistant turn) ends: what follows its
        end-of-turn token, then ``added`` (tool results, a user turn) and the next generation prompt."""
        ...


def _tool_calls(value: Any, i: int) -> list[dict[str, Any]]:
    """``tool_calls`` of assistant message ``i``, each ``{"type": "function", "function": {"name", "arguments"}}``
    (``type`` defaults to ``function``; an ``id`` is kept). ``arguments`` stay as given, an object or a
    JSON string, because templates write them as given (Qwen2.5's ``tojson``), as ``transformers`` does."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"message {i}: 'tool_calls' must be a non-empty list")
    out = []
    for j, call in enumerate(value):
        where = f"message {i} tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise ValueError(f"{where} needs a 'function' object ({{\"type\": \"function\", \"function\": "
                             "{\"name\": ..., \"arguments\": {...}}}})")
        if call.get("type", "function") != "function":
            raise ValueError(f"{where} has type {call.get('type')!r} (expected 'function')")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{where} needs a non-empty string function 'name'")
        args = fn.get("arguments", {})
        if not isinstance(args, (dict, str)):
            raise ValueError(f"{where} 'arguments' must be an object or a JSON string, got {type(args).__name__}")
        entry: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def _content_parts(content: list[Any], i: int, images: bool) -> str | list[dict[str, Any]]:
    """A list content: text parts joined into one string; with ``images``, a list holding the image parts
    (:mod:`lmforge.data.images`) among the joined text runs."""
    out: list[dict[str, Any]] = []
    for p in content:
        if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
            if out and out[-1]["type"] == "text":
                out[-1] = {"type": "text", "text": out[-1]["text"] + p["text"]}
            else:
                out.append({"type": "text", "text": p["text"]})
        elif images and isinstance(p, dict) and p.get("type") == "image":
            out.append(dict(p))
        else:
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            hint = ("" if images or kind != "image" else
                    " in this data (images train in SFT, DPO and GRPO with a vision-language model)")
            raise ValueError(f"message {i}: content part {kind!r} is not supported{hint}; parts are "
                             "{'type': 'text', 'text': ...}" + (" or {'type': 'image', ...}" if images else ""))
    if not any(p["type"] == "image" for p in out):
        return "".join(p["text"] for p in out)
    return out


def validate_messages(messages: Any, images: bool = False) -> list[dict[str, Any]]:
    """Check the ``messages`` shape; raises ValueError with a short reason (callers add file:line).

    ``content`` is a string, or a list of ``{"type": "text", "text": ...}`` parts (the multimodal
    layout Gemma 3 and others use), joined into one string. With ``images`` (SFT records) a list content
    may hold ``{"type": "image", ...}`` parts too, and stays a list of text and image parts.

    Tool use, in the layout of ``transformers``' chat templates: an assistant message may carry
    ``tool_calls`` (its ``content`` may then be empty, missing or null), and ``tool`` messages hold the
    results (their ``name`` and ``tool_call_id`` are kept for the templates that write them).
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if content is None and isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls"):
            content = ""
        if isinstance(content, list):
            content = _content_parts(content, i, images)
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, (str, list)):
            raise ValueError(f"message {i} needs string 'role' and 'content'")
        if m["role"] not in ROLES:
            raise ValueError(f"message {i} has role {m['role']!r} (expected one of {', '.join(ROLES)})")
        message: dict[str, Any] = {"role": m["role"], "content": content}
        if m.get("tool_calls") is not None:
            if m["role"] != "assistant":
                raise ValueError(f"message {i}: only assistant messages carry 'tool_calls' (role {m['role']!r})")
            message["tool_calls"] = _tool_calls(m["tool_calls"], i)
        if m["role"] == "tool":
            for key in ("name", "tool_call_id"):
                if m.get(key) is not None:
                    if not isinstance(m[key], str):
                        raise ValueError(f"message {i}: tool message {key!r} must be a string")
                    message[key] = m[key]
        out.append(message)
    return out


def validate_tools(tools: Any) -> list[dict[str, Any]] | None:
    """A record's ``tools``: None, or a list of ``{"type": "function", "function": {"name", "description",
    "parameters"}}`` JSON schemas (as ``apply_chat_template(tools=...)`` takes them); ValueError otherwise."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ValueError(f"'tools' must be a list of function schemas, got {type(tools).__name__}")
    for j, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{j}] needs {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                             "\"parameters\": {...}}}}")
        if tool.get("type", "function") != "function":
            raise ValueError(f"tools[{j}] has type {tool.get('type')!r} (expected 'function')")
        if not isinstance(fn.get("parameters", {}), dict):
            raise ValueError(f"tools[{j}] 'parameters' must be a JSON-schema object")
    return tools


class ByteChatFormat:
    """The built-in chat format of :class:`~lmforge.models.tokenizer.ByteTokenizer`."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self.tok = tokenizer
        sp = tokenizer.special_tokens
        self.role_ids = {r: sp[r] for r in BYTE_ROLES}
        self.end_id = sp["end"]

    def _append(self, ids: list[int], mask: list[bool], message: Mapping[str, Any]) -> None:
        role = message["role"]
        if role not in self.role_ids or message.get("tool_calls"):
            raise ValueError("the byte chat format has no tool calls or tool messages; use a tokenizer whose "
                             "chat template supports tools (e.g. Qwen2.5's)")
        body = self.tok.encode(message["content"])
        ids.append(self.role_ids[role])
        mask.append(False)
        if role == "assistant":
            ids += body + [self.tok.eos_id]
            mask += [True] * (len(body) + 1)
        else:
            ids += body + [self.end_id]
            mask += [False] * (len(body) + 1)

    @staticmethod
    def _no_tools(tools: Tools) -> None:
        if tools:
            raise ValueError("the byte chat format cannot show tool definitions; use a tokenizer whose chat "
                             "template supports tools")

    def encode(self, messages: Sequence[Mapping[str, Any]], tools: Tools = None) -> EncodedChat:
        self._no_tools(tools)
        ids, mask = [self.tok.bos_id], [False]
        for m in messages:
            self._append(ids, mask, m)
        return EncodedChat(ids, mask)

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]], tools: Tools = None) -> list[int]:
        return self.encode(messages, tools).ids + [self.role_ids["assistant"]]

    def end_of_turn_ids(self) -> list[int]:
        return [self.tok.eos_id]

    def continuation_ids(self, messages: Sequence[Mapping[str, Any]], added: Sequence[Mapping[str, Any]],
                         tools: Tools = None) -> list[int]:
        """Nothing follows EOS in this format: the added messages' ids, then the assistant role token."""
        self._no_tools(tools)
        ids: list[int] = []
        for m in added:
            self._append(ids, [], m)
        return ids + [self.role_ids["assistant"]]


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

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
               tools: Tools = None) -> str:
        return self.template.render(messages, add_generation_prompt, tools)

    def encode(self, messages: Sequence[Mapping[str, Any]], tools: Tools = None) -> EncodedChat:
        text, spans = self.template.answer_spans(messages, self.control_tokens, tools)
        if tools and self.render(messages) == text:
            raise ValueError(f"{self.source}: the template ignores `tools` (renders the same without them); "
                             "describe the tools in the system message or use a template with tool support")
        ids, offsets = self.tok.encode_with_offsets(text)
        return EncodedChat(ids, _mask_from_spans(offsets, spans))

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]], tools: Tools = None) -> list[int]:
        text = self.render(messages, add_generation_prompt=True, tools=tools)
        return self.tok.encode(text) if text else []

    def end_of_turn_ids(self) -> list[int]:
        """The special token that ends an assistant turn in this template (``[]`` if it writes none)."""
        token = self.template.end_of_turn(self.control_tokens)
        tid = self.tok.token_id(token) if token else None
        return [tid] if tid is not None else []

    def continuation_ids(self, messages: Sequence[Mapping[str, Any]], added: Sequence[Mapping[str, Any]],
                         tools: Tools = None) -> list[int]:
        """The text after the last answer's span (its end-of-turn token included) in the rendering of
        ``messages + added`` with the generation prompt, tokenized *in that rendering*: the whole text is
        tokenized and the tokens from the span's end taken, so a tokenizer that treats the start of a
        string specially (SentencePiece's prefix space) gives the ids training would. Where a token
        straddles the span's end (no template tested does this: spans end with a special token), the
        rest is tokenized alone."""
        if not messages or messages[-1]["role"] != "assistant":
            raise ValueError("continuation_ids: the conversation must end with an assistant message")
        text, spans = self.template.answer_spans(messages, self.control_tokens, tools)
        if not spans:
            raise ValueError(f"{self.source}: the template does not write the last assistant message")
        end = spans[-1][1]
        full = self.render([*messages, *added], add_generation_prompt=True, tools=tools)
        if not full.startswith(text[:end]):
            raise ValueError(f"{self.source}: the template renders the conversation differently once messages "
                             "follow it, so the next turn's tokens cannot be appended")
        ids, offsets = self.tok.encode_with_offsets(full)
        first = next((t for t, (start, stop) in enumerate(offsets) if stop > end), len(ids))
        if first < len(ids) and offsets[first][0] < end:
            return self.tok.encode(full[end:])  # a token straddles the answer's end: tokenize the rest alone
        return ids[first:]


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
