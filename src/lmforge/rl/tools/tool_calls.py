"""Tool calls in a model's generated text, in the format its chat template teaches.

Two formats, the ones open chat templates use:

* ``hermes`` (Qwen2.5, Hermes, and most templates that write ``<tool_call>``)::

      Some text.
      <tool_call>
      {"name": "calculator", "arguments": {"expression": "12*7"}}
      </tool_call>

  any number of calls, anywhere in the turn; the text outside them is the turn's content.
* ``llama3`` (Llama 3.1/3.2): the whole turn is a bare JSON object
  ``{"name": "calculator", "parameters": {"expression": "12*7"}}`` (optionally after ``<|python_tag|>``;
  several separated by ``;``). A turn that does not start with ``{`` is a plain answer.

:func:`detect_call_format` reads which one from the template's text (hermes when it cannot tell).
A malformed call (bad JSON, no name, arguments that are not an object, an unclosed tag) does not raise:
:func:`parse_tool_calls` returns it as an error string, which the environment gives the model as the
call's result, so it can correct itself on the next turn.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["CallFormat", "ToolCall", "ParsedTurn", "detect_call_format", "parse_tool_calls", "format_tool_call"]

CallFormat = Literal["hermes", "llama3"]
CALL_FORMATS: tuple[str, ...] = ("hermes", "llama3")

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def message_entry(self) -> dict[str, Any]:
        """The call as an entry of an assistant message's ``tool_calls`` (the ``transformers`` layout)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedTurn:
    content: str
    """The turn's text outside its tool calls, stripped."""
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """One message per malformed call, e.g. ``tool call 2: invalid JSON (...)``."""

    @property
    def wants_tools(self) -> bool:
        """The turn tried to call a tool (well-formed or not): the episode continues with the results."""
        return bool(self.calls or self.errors)


def detect_call_format(template_text: str | None) -> CallFormat:
    """``llama3`` for a template that asks for bare ``{"name": ..., "parameters": ...}`` JSON (Llama 3.1's
    ``<|python_tag|>``/``ipython`` templates), else ``hermes``."""
    text = (template_text or "").replace('\\"', '"')  # a quote escaped inside a Jinja string literal
    if "<tool_call>" in text:
        return "hermes"
    if '"parameters"' in text and (_PYTHON_TAG in text or "ipython" in text):
        return "llama3"
    return "hermes"


def _call(obj: Any, k: int, argument_keys: tuple[str, ...]) -> ToolCall | str:
    """A decoded call object as a :class:`ToolCall`, or the error the model is told."""
    if not isinstance(obj, dict):
        return f"tool call {k}: expected a JSON object with \"name\" and \"arguments\", got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f"tool call {k}: missing the function \"name\""
    args = next((obj[key] for key in argument_keys if key in obj), {})
    if isinstance(args, str):  # arguments as a JSON string, the OpenAI wire format
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return f"tool call {k} ({name}): arguments are not valid JSON ({e.msg})"
    if not isinstance(args, dict):
        return f"tool call {k} ({name}): arguments must be a JSON object, got {type(args).__name__}"
    return ToolCall(name, args)


def _hermes(text: str) -> ParsedTurn:
    turn = ParsedTurn(content="")
    outside: list[str] = []
    at = 0
    for k, m in enumerate(_HERMES.finditer(text), start=1):
        outside.append(text[at:m.start()])
        at = m.end()
        body = m.group(1).strip()
        try:
            got = _call(json.loads(body), k, ("arguments", "parameters"))
        except json.JSONDecodeError as e:
            got = f"tool call {k}: invalid JSON ({e.msg} at character {e.pos})"
        (turn.calls if isinstance(got, ToolCall) else turn.errors).append(got)
    rest = text[at:]
    if "<tool_call>" in rest:  # opened and never closed: cut off, or the model forgot the tag
        turn.errors.append(f"tool call {len(turn.calls) + len(turn.errors) + 1}: <tool_call> without </tool_call>")
        rest = rest[:rest.index("<tool_call>")]
    outside.append(rest)
    turn.content = "".join(outside).strip()
    return turn


def _llama3(text: str) -> ParsedTurn:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return ParsedTurn(content=text.strip())
    turn = ParsedTurn(content="")
    decoder = json.JSONDecoder()
    at, k = 0, 1
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError as e:
            turn.errors.append(f"tool call {k}: invalid JSON ({e.msg} at character {e.pos})")
            break
        got = _call(obj, k, ("parameters", "arguments"))
        (turn.calls if isinstance(got, ToolCall) else turn.errors).append(got)
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
        k += 1
    return turn


def parse_tool_calls(text: str, fmt: CallFormat = "hermes") -> ParsedTurn:
    """The tool calls in one generated turn (the decoded text, without its end-of-turn token)."""
    if fmt == "hermes":
        return _hermes(text)
    if fmt == "llama3":
        return _llama3(text)
    raise ValueError(f"unknown tool-call format {fmt!r} (expected one of {', '.join(CALL_FORMATS)})")


def format_tool_call(call: ToolCall, fmt: CallFormat = "hermes") -> str:
    """The text a model writes for ``call`` in format ``fmt`` (as Qwen2.5's and Llama 3.1's templates render it)."""
    if fmt == "llama3":
        return json.dumps({"name": call.name, "parameters": call.arguments}, ensure_ascii=False)
    return ("<tool_call>\n" + json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
            + "\n</tool_call>")
