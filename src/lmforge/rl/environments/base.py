"""Multi-turn episodes with tools: the :class:`Environment` protocol and :class:`ToolEnvironment`.

An episode is a conversation between the policy and an environment. The environment gives the first
messages (and the tool definitions the template shows), then reads each generated turn: a turn without
tool calls is the final answer and ends the episode; a turn with calls gets the tools' results as new
messages and the policy speaks again, up to ``max_turns`` turns. The reward is scored on the final
answer. :func:`lmforge.rl.multi_turn.run_episodes` drives the turns through a rollout engine.

How tools reach the model depends on the chat template (:func:`tool_style_for`):

* *native*: the template renders ``tools``, assistant ``tool_calls`` and ``tool`` messages (Qwen2.5,
  Llama 3.1). The definitions go to the template, an answer's calls become ``tool_calls`` and results
  ``tool`` messages, exactly the layout a tool-calling chat dataset has (:mod:`lmforge.data.sft_data`).
* *in text*: the template knows nothing of tools (SmolLM2, Mistral v0.1, the byte format). The
  definitions and the ``<tool_call>`` format are described in the system message (in the first user
  message where the template refuses a system message), the model's calls stay in its answer's text and
  the results come back as a user message of ``<tool_response>`` blocks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

from lmforge.data.chat import ChatFormat
from lmforge.rl.tools.tool_calls import CallFormat, ParsedTurn, ToolCall, detect_call_format, parse_tool_calls

__all__ = ["Conversation", "TurnOutcome", "Environment", "ToolStyle", "tool_style_for", "ToolEnvironment",
           "Tool", "TEXT_TOOLS_PROMPT"]

Message = dict[str, Any]


@dataclass
class Conversation:
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    """Tool definitions for the template's ``tools`` (None when the tools are described in text)."""


@dataclass
class TurnOutcome:
    assistant: Message
    """The turn as the conversation records it (content, and ``tool_calls`` in the native style)."""
    results: list[Message] = field(default_factory=list)
    """The messages that answer it (tool results); empty when ``done``."""
    done: bool = False
    """The turn is the final answer."""
    tool_calls: int = 0
    """Results given: one per call attempted, malformed ones included."""
    tool_errors: int = 0
    """Results that are errors: malformed calls, unknown tools, failed evaluations, calls over the limit."""


class Environment(Protocol):
    max_turns: int
    """Most policy turns in an episode (its first answer included)."""

    def start(self, record: Mapping[str, Any]) -> Conversation:
        """The conversation an episode on ``record`` (a prompt record) starts from."""
        ...

    def step(self, record: Mapping[str, Any], messages: Sequence[Message], text: str,
             execute: bool = True) -> TurnOutcome:
        """Read one generated turn (decoded, without its end-of-turn token). ``execute=False`` on the last
        allowed turn: the calls are recorded but not run, as no turn would read their results."""
        ...

    def reward(self, record: Mapping[str, Any], final_text: str | None) -> float:
        """The episode's reward; ``final_text`` is None when it ended without an answer (limits hit)."""
        ...

    # Optional: ``for_episode() -> Environment``. An environment whose episodes keep state of their own (a
    # Gym-style instance per episode: OpenEnv) has each episode played, and its reward asked, on what
    # ``for_episode()`` returns; the others play every episode on themselves.


@dataclass(frozen=True)
class ToolStyle:
    native: bool
    """The template renders tools, tool calls and tool messages itself."""
    call_format: CallFormat = "hermes"
    system_message: bool = True
    """The template accepts a system message (Mistral v0.1's refuses one)."""


_PROBE_TOOL = {"type": "function", "function": {"name": "lmforge_probe_tool", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}
_PROBE_CALL = {"role": "assistant", "content": "",
               "tool_calls": [{"type": "function", "function": {"name": "lmforge_probe_call", "arguments": {}}}]}


def _renders(chat: ChatFormat, messages: list[Message], tools: Any, *needles: str) -> bool:
    render = getattr(chat, "render", None)
    if render is None:  # the byte format: no template, no tools
        return False
    try:
        text = render(messages, add_generation_prompt=True, tools=tools)
    except ValueError:
        return False
    return all(n in text for n in needles)


def tool_style_for(chat: ChatFormat) -> ToolStyle:
    """How tools reach the model with this chat format, found by rendering probes (a template that shows a
    probe tool's name, a probe call's name and a probe result is native)."""
    user = {"role": "user", "content": "hi"}
    result = {"role": "tool", "name": "lmforge_probe_call", "content": "lmforge_probe_result"}
    native = _renders(chat, [user, _PROBE_CALL, result], [_PROBE_TOOL], "lmforge_probe_tool", "lmforge_probe_call",
                      "lmforge_probe_result")
    template = getattr(chat, "template", None)
    fmt = detect_call_format(template.text) if native and template is not None else "hermes"
    system = getattr(chat, "render", None) is None or _renders(
        chat, [{"role": "system", "content": "lmforge_probe_system"}, user], None, "lmforge_probe_system")
    return ToolStyle(native, fmt, system)


TEXT_TOOLS_PROMPT = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>\n\nThe results come back within <tool_response></tool_response> XML tags."
)
"""The tool instructions for templates without tool support: Qwen2.5's own wording, so a model trained on
either style reads the same text."""


Tool = Callable[[dict[str, Any]], str]
"""A tool: the call's arguments -> the result text the model reads (``error: ...`` on failure; never raises)."""


class ToolEnvironment:
    """An environment whose turns are answers or tool calls, in the chat format's :class:`ToolStyle`.

    Subclasses give the first messages (:meth:`task_messages`) and the reward; this class adds the tool
    definitions, parses the calls, runs them and writes the results. A turn may call at most
    ``max_calls_per_turn`` tools; results are cut to ``max_result_chars`` characters."""

    max_calls_per_turn = 8
    max_result_chars = 1000

    def __init__(self, chat: ChatFormat, tools: Mapping[str, tuple[dict[str, Any], Tool]], max_turns: int = 4,
                 style: ToolStyle | None = None) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        self.chat = chat
        self.max_turns = max_turns
        self.schemas = [schema for schema, _ in tools.values()]
        self.tools = {name: fn for name, (_, fn) in tools.items()}
        self.style = style or tool_style_for(chat)

    # ------------------------------------------------------------------ what subclasses give
    def task_messages(self, record: Mapping[str, Any]) -> tuple[str | None, list[Message]]:
        """The task's system prompt (or None) and its first messages."""
        raise NotImplementedError

    def reward(self, record: Mapping[str, Any], final_text: str | None) -> float:
        raise NotImplementedError

    # ------------------------------------------------------------------ the episode
    def start(self, record: Mapping[str, Any]) -> Conversation:
        system, messages = self.task_messages(record)
        if self.style.native:
            head = [{"role": "system", "content": system}] if system else []
            return Conversation(head + messages, list(self.schemas))
        described = TEXT_TOOLS_PROMPT.format(tools="\n".join(json.dumps(s, ensure_ascii=False) for s in self.schemas))
        system = f"{system}\n\n{described}" if system else described
        if self.style.system_message:
            return Conversation([{"role": "system", "content": system}, *messages])
        first = next(i for i, m in enumerate(messages) if m["role"] == "user")
        messages = list(messages)
        messages[first] = {**messages[first], "content": f"{system}\n\n{messages[first]['content']}"}
        return Conversation(messages)

    def parse(self, text: str) -> ParsedTurn:
        return parse_tool_calls(text, self.style.call_format)

    def run_tool(self, call: ToolCall) -> str:
        """One call of a known tool (:meth:`step` answers unknown names itself)."""
        try:
            result = self.tools[call.name](call.arguments)
        except Exception as e:  # noqa: BLE001 - a tool's failure is the model's to read, not the run's
            result = f"error: {type(e).__name__}: {e}"
        result = str(result)
        return result if len(result) <= self.max_result_chars else result[: self.max_result_chars] + " ...(cut)"

    def step(self, record: Mapping[str, Any], messages: Sequence[Message], text: str,
             execute: bool = True) -> TurnOutcome:
        parsed = self.parse(text)
        if not parsed.wants_tools:
            return TurnOutcome({"role": "assistant", "content": text}, done=True)
        known = [c for c in parsed.calls if c.name in self.tools]
        calls = known[: self.max_calls_per_turn]
        # Unknown names are answered with an error and kept out of ``tool_calls``: a template given a name
        # it cannot write (quotes, control characters of a policy early in training) could not render the turn.
        errors = [f"error: unknown tool {c.name[:60]!r} (available: {', '.join(self.tools)})"
                  for c in parsed.calls if c.name not in self.tools] + list(parsed.errors)
        if len(known) > self.max_calls_per_turn:
            errors.append(f"error: at most {self.max_calls_per_turn} tool calls per turn; the rest were not run")
        if self.style.native and calls:
            assistant = {"role": "assistant", "content": parsed.content,
                         "tool_calls": [c.message_entry() for c in calls]}
        else:  # in text, or only malformed calls: the turn as written
            assistant = {"role": "assistant", "content": text}
        if not execute:
            return TurnOutcome(assistant)
        results = [(c.name, self.run_tool(c)) for c in calls] + [(None, e if e.startswith("error:") else f"error: {e}")
                                                               for e in errors]
        n_errors = sum(r.startswith("error:") for _, r in results)
        return TurnOutcome(assistant, self._result_messages(results), tool_calls=len(results), tool_errors=n_errors)

    def _result_messages(self, results: list[tuple[str | None, str]]) -> list[Message]:
        if self.style.native:
            return [{"role": "tool", "content": r, **({"name": n} if n else {})} for n, r in results]
        return [{"role": "user", "content": "\n".join(f"<tool_response>\n{r}\n</tool_response>" for _, r in results)}]
