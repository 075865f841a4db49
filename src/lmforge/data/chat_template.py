"""A Hugging Face ``chat_template`` rendered as ``transformers`` renders it, and where each answer lies in it.

Training needs the character span of every assistant answer in the rendered conversation, so that the
whole rendering can be tokenized once (as ``transformers`` and inference do) and tokens marked by the
characters they cover. :meth:`ChatTemplate.answer_spans` finds them for any template:

* With ``{% generation %}...{% endgeneration %}`` markers, the spans are what the markers enclose,
  recorded while rendering, exactly as ``transformers`` records them for ``return_assistant_tokens_mask``.
* Otherwise the conversation is rendered a second time with a unique sentinel in place of each assistant
  message's content. The text between sentinels is the template's own; the real rendering must be that
  text with each content put back (verbatim, or with its surrounding whitespace trimmed, as many
  templates ``trim`` it). That check is exact, so an answer that also occurs in a user message, or a
  template that is not prefix-stable (a system prompt folded into a later turn), cannot misplace a span.
  A template that rewrites answers any other way is refused, naming the template.
* An assistant message with ``tool_calls`` has no content to stand a sentinel in for: the template writes
  the calls itself (``<tool_call>{"name": ...}</tool_call>``, Llama 3.1's bare JSON). Its span is what
  follows the generation prompt, i.e. exactly what a model given that prompt generates: the end of
  ``render(messages[:i], add_generation_prompt=True)`` up to the end-of-turn token that closes the turn.

``tools`` (JSON-schema tool definitions) reach the template as ``transformers`` passes them.

An answer's span is its content as rendered plus the end-of-turn token: the one special token the template
writes immediately after the content (``<|im_end|>``, ``</s>``, ``<|eot_id|>``), if there is one. What
follows (a newline, the next role header, Mistral's trailing space) belongs to the template, not to the
answer: the model stops generating at the end-of-turn token and never produces that text.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping, Optional, Sequence

from lmforge.errors import UserError

__all__ = ["ChatTemplate", "Span", "SENTINEL", "Tools"]

Span = tuple[int, int]
"""A ``[start, end)`` character range of a rendered conversation."""

Tools = Optional[Sequence[Mapping[str, Any]]]
"""JSON-schema tool definitions (``{"type": "function", "function": {...}}``) as a template receives them."""

SENTINEL = "\ue000{}\ue001"
"""Stands in for the k-th assistant content: private-use code points around digits, which case and
whitespace filters leave alone."""
_SENTINEL_RE = re.compile("\ue000(\\d+)\ue001")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _environment():
    """A jinja2 environment configured like the one ``transformers`` renders chat templates in."""
    try:
        import jinja2
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 is a core dependency
        raise UserError("chat templates need the 'jinja2' package") from e

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body and, while tracking, records where."""

        tags = {"generation"}

        def __init__(self, environment) -> None:
            super().__init__(environment)
            self.tracking: tuple[list[str], list[Span]] | None = None

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

        def _generation(self, caller) -> str:
            text = caller()
            if self.tracking is not None:
                blocks, spans = self.tracking
                start = sum(len(b) for b in blocks)
                spans.append((start, start + len(text)))
            return text

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


@lru_cache(maxsize=16)
def _compile(text: str):
    """The compiled template and its generation-block extension; cached, as compiling a real template
    costs tens of milliseconds and every prompt of a rollout or evaluation is formatted with it."""
    env = _environment()
    generation = next(e for e in env.extensions.values() if hasattr(e, "tracking"))
    return env.from_string(text), generation


class ChatTemplate:
    """One compiled template; ``variables`` are its special-token strings (``bos_token``, ``eos_token``...)."""

    def __init__(self, text: str, variables: Mapping[str, str], source: str = "chat_template") -> None:
        import jinja2

        self.source = source
        self.text = text
        self.variables = dict(variables)
        self.has_generation_markers = bool(_GENERATION_TAG.search(text))
        self._end_of_turn: dict[tuple[str, ...], str | None] = {}
        try:
            self._template, self._generation = _compile(text)
        except jinja2.TemplateSyntaxError as e:
            raise UserError(f"{source}: invalid chat template (line {e.lineno}: {e.message})") from None

    def _context(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                 tools: Tools = None) -> dict[str, Any]:
        return dict(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                    tools=None if tools is None else list(tools), documents=None, **self.variables)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
               tools: Tools = None) -> str:
        """The conversation as text; a template's ``raise_exception`` becomes a one-line ValueError.

        ``tools`` are JSON-schema tool definitions, passed to the template as ``transformers``'
        ``apply_chat_template(tools=...)`` passes them (None when there are none)."""
        import jinja2

        try:
            return self._template.render(**self._context(messages, add_generation_prompt, tools))
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from None
        except Exception as e:  # noqa: BLE001 - a template is code: any failure of it is the template's
            raise ValueError(f"chat template error: {type(e).__name__}: {e}") from None

    def _render_tracked(self, messages: Sequence[Mapping[str, Any]], tools: Tools) -> tuple[str, list[Span]]:
        """The rendering and the spans its ``{% generation %}`` blocks produced (as transformers tracks them)."""
        import jinja2

        blocks: list[str] = []
        spans: list[Span] = []
        self._generation.tracking = (blocks, spans)
        try:
            for block in self._template.generate(**self._context(messages, False, tools)):
                blocks.append(block)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from None
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"chat template error: {type(e).__name__}: {e}") from None
        finally:
            self._generation.tracking = None
        return "".join(blocks), spans

    def answer_spans(self, messages: Sequence[Mapping[str, Any]], control_tokens: Sequence[str],
                     tools: Tools = None) -> tuple[str, list[Span]]:
        """The rendering of ``messages`` and the span of each assistant answer that appears in it.

        An assistant message with ``tool_calls`` is located by :meth:`_tool_call_spans`: its text is
        rendered by the template from the calls (not a content string that could be replaced by a
        sentinel), so it is found as what follows the generation prompt."""
        if self.has_generation_markers:
            return self._render_tracked(messages, tools)
        text = self.render(messages, tools=tools)
        spans = [(start, _end_of_turn(text, end, control_tokens))
                 for start, end in self._content_spans(messages, text, tools)]
        spans += self._tool_call_spans(messages, text, tools, control_tokens)
        return text, sorted(spans)

    def _content_spans(self, messages: Sequence[Mapping[str, Any]], text: str, tools: Tools) -> list[Span]:
        answers = [i for i, m in enumerate(messages) if m["role"] == "assistant" and not m.get("tool_calls")]
        if not answers:
            return []
        if any("\ue000" in json.dumps(m, ensure_ascii=False) for m in messages):
            raise ValueError(f"{self.source}: a message contains U+E000, which marks answers while masking")
        marked = list(messages)
        for k, i in enumerate(answers):
            marked[i] = {**messages[i], "content": SENTINEL.format(k)}
        pieces = _SENTINEL_RE.split(self.render(marked, tools=tools))
        literals, order = pieces[0::2], [int(k) for k in pieces[1::2]]
        if len(set(order)) != len(order):
            k = next(k for k in order if order.count(k) > 1)
            raise ValueError(f"{self.source}: the template writes assistant message {answers[k]} more than "
                             "once, so its loss tokens are ambiguous")
        spans: list[Span] = []
        if not text.startswith(literals[0]):
            raise ValueError(f"{self.source}: the template renders differently when assistant contents change, "
                             "so answers cannot be located for the loss mask")
        pos = len(literals[0])
        for k, after in zip(order, literals[1:]):
            content = messages[answers[k]]["content"]
            for rendered in dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip())):
                if text.startswith(rendered, pos) and text.startswith(after, pos + len(rendered)):
                    break
            else:
                raise ValueError(f"{self.source}: the template rewrites assistant message {answers[k]} (not "
                                 "just trimming whitespace), so its tokens cannot be masked")
            spans.append((pos, pos + len(rendered)))
            pos += len(rendered) + len(after)
        if pos != len(text):
            raise ValueError(f"{self.source}: the template renders differently when assistant contents change, "
                             "so answers cannot be located for the loss mask")
        return spans

    def _tool_call_spans(self, messages: Sequence[Mapping[str, Any]], text: str, tools: Tools,
                         control_tokens: Sequence[str]) -> list[Span]:
        """The span of each assistant message with ``tool_calls``: from the end of the generation prompt
        (what the model is given before it writes the calls) to the end-of-turn token after the calls.

        Both ends come from renders of the conversation's prefixes, which must be prefixes of the whole
        rendering (checked): ``messages[:i]`` with the generation prompt gives the start, and the last
        end-of-turn token of ``messages[:i+1]`` the end. The span must contain every call's name, so a
        template that drops ``tool_calls`` (one written before tools existed) is refused rather than
        training the model to answer with an empty turn."""
        spans: list[Span] = []
        eot = None
        for i, m in enumerate(messages):
            if m["role"] != "assistant" or not m.get("tool_calls"):
                continue
            eot = eot or self.end_of_turn(control_tokens) or ""
            prompt = self.render(messages[:i], add_generation_prompt=True, tools=tools)
            upto = self.render(messages[: i + 1], tools=tools)
            start = len(prompt)
            end = upto.rfind(eot, start) + len(eot) if eot and eot in upto[start:] else len(upto.rstrip())
            if not (text.startswith(prompt) and text.startswith(upto[:end]) and end > start):
                raise ValueError(f"{self.source}: the template renders the conversation before assistant message "
                                 f"{i} differently on its own, so its tool calls cannot be located for the loss mask")
            for call in m["tool_calls"]:
                name = (call.get("function") or call).get("name", "")
                if name not in text[start:end]:
                    raise ValueError(f"{self.source}: the template does not write the tool calls of assistant "
                                     f"message {i} (no `{name}` in its turn); use a template with tool support")
            spans.append((start, end))
        return spans

    def end_of_turn(self, control_tokens: Sequence[str]) -> str | None:
        """The special token this template writes right after an assistant answer, if any."""
        key = tuple(control_tokens)
        if key not in self._end_of_turn:
            self._end_of_turn[key] = self._find_end_of_turn(control_tokens)
        return self._end_of_turn[key]

    def _find_end_of_turn(self, control_tokens: Sequence[str]) -> str | None:
        answer = {"role": "assistant", "content": SENTINEL.format(0)}
        for probe in ([{"role": "user", "content": "hi"}, answer],  # templates differ in what they accept:
                      [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}, answer]):
            try:
                text = self.render(probe)
            except Exception:  # noqa: BLE001 - raise_exception, or a template that needs another shape
                continue
            at = text.find(SENTINEL.format(0))
            if at >= 0:
                end = at + len(SENTINEL.format(0))
                return text[end:_end_of_turn(text, end, control_tokens)] or None
        return None


def _end_of_turn(text: str, end: int, control_tokens: Sequence[str]) -> int:
    """``end`` moved past the one special token written at ``end`` (the longest one that matches)."""
    match = max((t for t in control_tokens if t and text.startswith(t, end)), key=len, default="")
    return end + len(match)
