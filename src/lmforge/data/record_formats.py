"""The common SFT record formats, mapped to the shapes the tokenizer trains on.

Every format has one function here that takes a raw record (a JSON line or parquet row) and returns
an *SFT record* of one of three shapes:

* ``{"messages": [{"role": ..., "content": ...}, ...]}`` - a conversation, rendered with the chat
  template; this is what every chat-shaped format becomes (``messages``, conversational
  ``prompt``/``completion``, Alpaca, ShareGPT);
* ``{"prompt": str, "completion": str}`` - plain text without a template (loss on the completion);
* ``{"text": str}`` - plain text with loss on every token.

The formats are a registry (:data:`RECORD_FORMATS`, :func:`register_format`): a project adds its own
with a mapping function and the keys that show it. ``data.format`` names the format of every record,
or ``auto`` (default) detects it from each record's keys; a record whose keys fit several formats takes its file's format (the format of the
file's first record, which must itself be unambiguous). Problems raise ``ValueError`` with a short
reason; the reader prefixes the record's ``file:line``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from lmforge.data.chat import validate_messages, validate_tools
from lmforge.data.images import IMAGES_KEY
from lmforge.errors import UserError

PROMPT_TURNS = "prompt_turns"
"""Key of a mapped record: how many leading messages are prompt (context without loss, even the
assistant turns among them)."""

__all__ = ["RecordFormat", "RECORD_FORMATS", "register_format", "check_format", "ACCEPTED_SHAPES", "detect_format",
           "to_sft_record", "prompt_messages", "messages_record", "prompt_completion_record", "alpaca_record",
           "sharegpt_record", "text_record"]

Message = dict[str, str]

ACCEPTED_SHAPES = ("messages (list of role/content), prompt/completion (strings or message lists), "
                   "instruction/input/output (alpaca), conversations of from/value (sharegpt), text")
"""The shapes ``auto`` recognises, as named in error messages."""

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}


def _keys(record: dict[str, Any]) -> str:
    return ", ".join(sorted(record)) or "none"


def _string(record: dict[str, Any], key: str, fmt: str, optional: bool = False) -> str | None:
    if key not in record or (optional and record[key] is None):
        if optional:
            return None
        raise ValueError(f"missing key {key!r} (format {fmt}; keys: {_keys(record)})")
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f"{key!r} must be a string, got {type(value).__name__}")
    return value


def _with_tools(out: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """``out`` with the record's ``tools`` (function schemas the template shows the model), if it has any."""
    tools = validate_tools(record.get("tools"))
    out = {**out, "tools": tools} if tools else out
    return {**out, IMAGES_KEY: record[IMAGES_KEY]} if record.get(IMAGES_KEY) is not None else out


def messages_record(record: dict[str, Any]) -> dict[str, Any]:
    """``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...], "tools": [...]}``
    (assistant messages may carry ``tool_calls``; ``tools`` is optional)."""
    if "messages" not in record:
        raise ValueError(f"missing key 'messages' (format messages; keys: {_keys(record)})")
    return _with_tools({"messages": validate_messages(record["messages"], images=True)}, record)


def prompt_completion_record(record: dict[str, Any]) -> dict[str, Any]:
    """``{"prompt": "...", "completion": "..."}`` (plain text, no template; loss on the completion), or
    TRL's conversational form ``{"prompt": [messages], "completion": [messages]}``, which becomes
    one conversation whose loss is on the completion's assistant turns only (as in TRL: assistant
    turns inside the prompt are context)."""
    for key in ("prompt", "completion"):
        if key not in record:
            raise ValueError(f"missing key {key!r} (format prompt_completion; keys: {_keys(record)})")
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return {"prompt": prompt, "completion": completion}
    if isinstance(prompt, list) and isinstance(completion, list):
        if not completion:
            raise ValueError("'completion' is an empty message list")
        messages = validate_messages(prompt + completion, images=True)
        return _with_tools({"messages": messages, PROMPT_TURNS: len(prompt)}, record)
    raise ValueError(f"'prompt' and 'completion' must both be strings or both message lists "
                     f"(got {type(prompt).__name__} and {type(completion).__name__})")


def alpaca_record(record: dict[str, Any]) -> dict[str, Any]:
    """``{"instruction": "...", "input": "...", "output": "...", "system": "..."}`` (``input`` and
    ``system`` optional). The user turn is the instruction, then a blank line and the input when the
    input is not empty; the output is the assistant turn."""
    instruction = _string(record, "instruction", "alpaca")
    output = _string(record, "output", "alpaca")
    extra = _string(record, "input", "alpaca", optional=True)
    system = _string(record, "system", "alpaca", optional=True)
    user = f"{instruction}\n\n{extra}" if extra and extra.strip() else instruction
    messages = [{"role": "system", "content": system}] if system else []
    return {"messages": messages + [{"role": "user", "content": user}, {"role": "assistant", "content": output}]}


def sharegpt_record(record: dict[str, Any]) -> dict[str, Any]:
    """``{"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...]}``; ``user`` and
    ``assistant`` are accepted as ``from`` values too."""
    if "conversations" not in record:
        raise ValueError(f"missing key 'conversations' (format sharegpt; keys: {_keys(record)})")
    turns = record["conversations"]
    if not isinstance(turns, list):
        raise ValueError(f"'conversations' must be a list, got {type(turns).__name__}")
    if not turns:
        raise ValueError("'conversations' is empty")
    messages: list[Message] = []
    for i, turn in enumerate(turns):
        if not (isinstance(turn, dict) and isinstance(turn.get("from"), str) and isinstance(turn.get("value"), str)):
            raise ValueError(f"conversations[{i}] needs string 'from' and 'value'")
        role = SHAREGPT_ROLES.get(turn["from"])
        if role is None:
            raise ValueError(f"conversations[{i}] has unknown role {turn['from']!r} "
                             f"(expected one of {', '.join(SHAREGPT_ROLES)})")
        messages.append({"role": role, "content": turn["value"]})
    return {"messages": messages}


def text_record(record: dict[str, Any]) -> dict[str, Any]:
    """``{"text": "..."}``: plain text, loss on every token."""
    return {"text": _string(record, "text", "text")}


@dataclass(frozen=True)
class RecordFormat:
    """A record format: how to map a record to an SFT record, and the keys that show a record is in it
    (none: chosen only by name, or as ``text`` when no other format's keys are present)."""

    name: str
    to_sft: Callable[[dict[str, Any]], dict[str, Any]]
    markers: tuple[str, ...] = ()


RECORD_FORMATS: dict[str, RecordFormat] = {}
"""Every record format by name, in the order ``auto`` tries their markers."""


def register_format(fmt: RecordFormat) -> RecordFormat:
    """Add ``fmt`` (its name must be new)."""
    if fmt.name in RECORD_FORMATS or fmt.name == "auto":
        raise ValueError(f"a record format called {fmt.name!r} exists already")
    RECORD_FORMATS[fmt.name] = fmt
    return fmt


for _fmt in (RecordFormat("messages", messages_record, ("messages",)),
             RecordFormat("prompt_completion", prompt_completion_record, ("prompt", "completion")),
             RecordFormat("alpaca", alpaca_record, ("instruction", "output")),
             RecordFormat("sharegpt", sharegpt_record, ("conversations",)),
             # chosen only when no other format's keys are present: datasets such as Alpaca carry an
             # already-rendered ``text`` column next to their fields
             RecordFormat("text", text_record)):
    register_format(_fmt)


def check_format(name: str) -> None:
    """One line naming ``data.format`` unless ``name`` is ``auto`` or a registered format."""
    if name != "auto" and name not in RECORD_FORMATS:
        raise UserError(f"data.format={name!r}: unknown record format; known: auto, {', '.join(RECORD_FORMATS)}")


def _matches(record: dict[str, Any]) -> list[str]:
    found = [f.name for f in RECORD_FORMATS.values() if any(k in record for k in f.markers)]
    return found or (["text"] if "text" in record else [])


def detect_format(record: dict[str, Any], prefer: str | None = None) -> str:
    """The format a record's keys show; ``prefer`` (its file's format) settles a record that shows
    several. ``ValueError`` when they show none, or several and not ``prefer``."""
    found = _matches(record)
    if len(found) > 1 and prefer in found:
        return prefer
    if len(found) > 1:
        raise ValueError(f"record matches several formats ({', '.join(found)}; keys: {_keys(record)}): "
                         "set data.format")
    if not found:
        raise ValueError(f"record has none of the known shapes (keys: {_keys(record)}); accepted: "
                         f"{ACCEPTED_SHAPES}")
    return found[0]


def to_sft_record(record: dict[str, Any], fmt: str) -> dict[str, Any]:
    """``record``, in format ``fmt``, as an SFT record."""
    if fmt not in RECORD_FORMATS:
        raise ValueError(f"unknown record format {fmt!r} (expected one of {', '.join(RECORD_FORMATS)})")
    return RECORD_FORMATS[fmt].to_sft(record)


def prompt_messages(prompt: Any) -> list[Message]:
    """A GRPO prompt as chat messages: a string is one user turn; a message list is checked and kept."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return validate_messages(prompt)
