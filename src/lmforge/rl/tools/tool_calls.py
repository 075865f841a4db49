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

Generated text is untrusted input (a policy early in training writes anything), so every read of it is
bounded before it is done: at most :data:`MAX_CALLS` calls a turn, :data:`MAX_CALL_CHARS` characters a
call, :data:`MAX_DEPTH` levels of JSON nesting and :data:`MAX_INT_DIGITS` digits an integer; tags are
found by one left-to-right scan (thousands of unclosed tags cost one pass, not one pass each). What
exceeds a bound is a tool error the model reads, like a malformed call, and any failure left over is
caught at :func:`parse_tool_calls`: the parser never raises and never takes long, whatever the text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["CallFormat", "ToolCall", "ParsedTurn", "detect_call_format", "parse_tool_calls", "format_tool_call",
           "MAX_CALLS", "MAX_CALL_CHARS", "MAX_DEPTH", "MAX_INT_DIGITS"]

CallFormat = Literal["hermes", "llama3"]
CALL_FORMATS: tuple[str, ...] = ("hermes", "llama3")

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


MAX_CALLS = 16
"""Most tool calls read from one turn; the environment runs fewer (``max_calls_per_turn``)."""
MAX_CALL_CHARS = 4000
"""Longest call body read, in characters (a calculator call is tens)."""
MAX_DEPTH = 16
"""Deepest JSON nesting read in a call (an arguments object is one or two levels)."""
MAX_INT_DIGITS = 100
"""Longest integer literal read in a call (Python refuses over 4300 digits with an exception)."""
MAX_NAME_CHARS = 100
"""Longest function name read."""


class _Unreadable(ValueError):
    """A call body over one of the bounds; its message is what the model is told."""


def _json_depth(text: str, limit: int) -> int:
    """The deepest bracket nesting of ``text`` outside JSON strings, counted up to ``limit + 1`` (one pass)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        elif ch in "]}":
            depth -= 1
    return deepest


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise _Unreadable(f"an integer longer than {MAX_INT_DIGITS} digits")
    return int(digits)


_DECODER = json.JSONDecoder(parse_int=_bounded_int)


def _check_body(body: str) -> None:
    """Refuse a call body over the bounds before any JSON is decoded from it."""
    if len(body) > MAX_CALL_CHARS:
        raise _Unreadable(f"longer than {MAX_CALL_CHARS} characters")
    if _json_depth(body, MAX_DEPTH) > MAX_DEPTH:
        raise _Unreadable(f"JSON nested deeper than {MAX_DEPTH} levels")


def _decode(body: str, at: int = 0) -> tuple[Any, int]:
    """``json.JSONDecoder.raw_decode`` of a checked body (:func:`_check_body`), with bounded integers."""
    try:
        return _DECODER.raw_decode(body, at)
    except RecursionError:  # unreachable after _check_body; kept so no input can escape as a traceback
        raise _Unreadable(f"JSON nested deeper than {MAX_DEPTH} levels") from None


def _loads(body: str) -> Any:
    """A whole checked body as one JSON value (``json.loads``' rules: nothing but spaces after it)."""
    _check_body(body)
    obj, end = _decode(body, len(body) - len(body.lstrip()))
    if body[end:].strip():
        raise json.JSONDecodeError("Extra data", body, end)
    return obj


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
    if len(name) > MAX_NAME_CHARS:
        return f"tool call {k}: function name longer than {MAX_NAME_CHARS} characters"
    args = next((obj[key] for key in argument_keys if key in obj), {})
    if isinstance(args, str):  # arguments as a JSON string, the OpenAI wire format
        try:
            args = _loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return f"tool call {k} ({name}): arguments are not valid JSON ({e.msg})"
        except _Unreadable as e:
            return f"tool call {k} ({name}): arguments not read: {e}"
    if not isinstance(args, dict):
        return f"tool call {k} ({name}): arguments must be a JSON object, got {type(args).__name__}"
    return ToolCall(name, args)


def _hermes(text: str) -> ParsedTurn:
    """One scan for ``<tool_call>...</tool_call>`` pairs, left to right (``str.find``: linear in the text)."""
    turn = ParsedTurn(content="")
    outside: list[str] = []
    at, k = 0, 0
    while (start := text.find(_OPEN, at)) >= 0:
        k += 1
        if k > MAX_CALLS:
            turn.errors.append(f"more than {MAX_CALLS} tool calls in one turn; the rest were not read")
            break
        end = text.find(_CLOSE, start + len(_OPEN))
        if end < 0:  # opened and never closed: cut off, or the model forgot the tag
            turn.errors.append(f"tool call {k}: {_OPEN} without {_CLOSE}")
            break
        outside.append(text[at:start])
        at = end + len(_CLOSE)
        try:
            got = _call(_loads(text[start + len(_OPEN):end]), k, ("arguments", "parameters"))
        except json.JSONDecodeError as e:
            got = f"tool call {k}: invalid JSON ({e.msg} at character {e.pos})"
        except _Unreadable as e:
            got = f"tool call {k}: not read: {e}"
        (turn.calls if isinstance(got, ToolCall) else turn.errors).append(got)
    rest = text[at:]
    if start >= 0:  # the text from the first call not read is not content either
        rest = text[at:start]
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
    try:
        if len(body) > MAX_CALLS * MAX_CALL_CHARS:
            raise _Unreadable(f"tool calls longer than {MAX_CALLS * MAX_CALL_CHARS} characters")
        if _json_depth(body, MAX_DEPTH) > MAX_DEPTH:
            raise _Unreadable(f"JSON nested deeper than {MAX_DEPTH} levels")
    except _Unreadable as e:
        turn.errors.append(f"tool call 1: not read: {e}")
        return turn
    at, k = 0, 1
    while at < len(body):
        if k > MAX_CALLS:
            turn.errors.append(f"more than {MAX_CALLS} tool calls in one turn; the rest were not read")
            break
        try:
            obj, end = _decode(body, at)
        except json.JSONDecodeError as e:
            turn.errors.append(f"tool call {k}: invalid JSON ({e.msg} at character {e.pos})")
            break
        except _Unreadable as e:
            turn.errors.append(f"tool call {k}: not read: {e}")
            break
        got = (_call(obj, k, ("parameters", "arguments")) if end - at <= MAX_CALL_CHARS
               else f"tool call {k}: not read: longer than {MAX_CALL_CHARS} characters")
        (turn.calls if isinstance(got, ToolCall) else turn.errors).append(got)
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
        k += 1
    return turn


def parse_tool_calls(text: str, fmt: CallFormat = "hermes") -> ParsedTurn:
    """The tool calls in one generated turn (the decoded text, without its end-of-turn token). Never
    raises on the text: whatever the bounds above do not foresee becomes the one error the model reads."""
    if fmt not in CALL_FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r} (expected one of {', '.join(CALL_FORMATS)})")
    try:
        return _hermes(text) if fmt == "hermes" else _llama3(text)
    except Exception as e:  # noqa: BLE001 - model output must not end the run; the model is told instead
        return ParsedTurn(content="", errors=[f"tool calls not read ({type(e).__name__})"])


def format_tool_call(call: ToolCall, fmt: CallFormat = "hermes") -> str:
    """The text a model writes for ``call`` in format ``fmt`` (as Qwen2.5's and Llama 3.1's templates render it)."""
    if fmt == "llama3":
        return json.dumps({"name": call.name, "parameters": call.arguments}, ensure_ascii=False)
    return ("<tool_call>\n" + json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
            + "\n</tool_call>")
