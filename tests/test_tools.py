"""The calculator tool (values against Python's own arithmetic, refusals, bounds) and tool-call parsing."""

from __future__ import annotations

import json
import math
import time

import pytest

from lmforge.rl.tools.calculator import CALCULATOR_TOOL, MAX_INT_BITS, calculate
from lmforge.rl.tools.tool_calls import ToolCall, detect_call_format, format_tool_call, parse_tool_calls
from _chat_fixtures import REAL_TOKENIZERS

ARITHMETIC = ["12 * (7 + 5) / 4", "48 / 2", "10 / 3", "-7 // 2", "-7 % 3", "2 ** 10", "2 ** -2", "1.5e3 - 0.25",
              "(3 + 4) * (5 - 9) ** 2", "17 % 5 * 3", "-(-(4))", "+3", "0.1 + 0.2", "123456789 * 987654321",
              "1_000 * 3", "0x10 + 1", "3 < 4 < 5", "3 < 4 > 5", "2 == 2.0", "1 != 1"]


def expected(expr: str) -> str:
    """Python's value of a safe expression, in the calculator's spelling (integral floats without .0)."""
    value = eval(expr, {"__builtins__": {}})  # noqa: S307 - the fixed, trusted expressions above
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:.12g}"
    return str(value)


@pytest.mark.parametrize("expr", ARITHMETIC)
def test_calculator_agrees_with_python(expr):
    assert calculate(expr) == expected(expr)


def test_calculator_functions_and_spellings():
    assert calculate("sqrt(16) + abs(-2) + floor(2.7) + ceil(2.1)") == expected("4.0 + 2 + 2 + 3")
    assert calculate("round(2.675, 2)") == str(round(2.675, 2))
    assert calculate("max(3, 9, 4) - min(3, 9, 4)") == "6"
    assert calculate("log(8, 2)") == "3" and calculate("exp(0)") == "1"
    assert calculate("2 * pi") == f"{2 * math.pi:.12g}"
    assert calculate("2^10") == "1024"  # what models write for a power
    assert calculate("6 \u00d7 7 \u00f7 2") == "21"


@pytest.mark.parametrize("expr, reason", [
    ("__import__('os').system('true')", "unknown function"),
    ("().__class__.__bases__", "Attribute is not allowed"),
    ("[1, 2][0]", "not allowed"),
    ("'a' * 3", "only numbers"),
    ("[x for x in (1, 2)]", "not allowed"),
    ("lambda: 1", "not allowed"),
    ("x + 1", "unknown name 'x'"),
    ("True + 1", "only numbers"),
    ("1j * 2", "only numbers"),
    ("max(*(1, 2))", "positional arguments only"),
    ("round(x=1)", "positional arguments only"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("sqrt(-1)", "math domain error"),
    ("(-8) ** 0.5", "complex result"),
    ("1e308 * 10", "not a finite number"),
    ("exp(1000)", "too large"),
    ("2 +", "invalid expression"),
    ("", "empty expression"),
    ("round(5, 10**9)", "between -100 and 100"),
    ("sqrt(1, 2)", "takes 1 argument"),
])
def test_calculator_refusals_are_error_strings(expr, reason):
    out = calculate(expr)
    assert out.startswith("error: ") and reason in out, out


@pytest.mark.parametrize("expr", ["10**10**10", "9**9**9", "2**2**2**2**2", f"2**{MAX_INT_BITS}",
                                  "(2**1000) * (2**1000)", "(10**300) * (10**300) * (10**300)",
                                  "99999999999**99999999999"])
def test_huge_integers_are_refused_before_they_are_built(expr):
    t = time.perf_counter()
    out = calculate(expr)
    assert time.perf_counter() - t < 0.05
    assert out.startswith("error: result too large"), out


def test_size_limits():
    assert calculate(f"2**{MAX_INT_BITS - 1}") == str(2 ** (MAX_INT_BITS - 1))  # the largest power allowed
    assert "longer than" in calculate("1+" * 200 + "1")
    assert "more than" in calculate("-" * 250 + "1")
    assert calculate(None).startswith("error: the expression must be a string")


def test_calculator_schema_is_an_openai_function():
    fn = CALCULATOR_TOOL["function"]
    assert CALCULATOR_TOOL["type"] == "function" and fn["name"] == "calculator"
    assert fn["parameters"]["required"] == ["expression"]
    assert fn["parameters"]["properties"]["expression"]["type"] == "string"
    json.dumps(CALCULATOR_TOOL)  # what a template's tojson writes


# ---------------------------------------------------------------------------------------- tool calls
def test_hermes_calls_content_and_errors():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>\n'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2*3\\"}"}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "3"</tool_call>'
            '<tool_call>{"arguments": {}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call> trailing')
    turn = parse_tool_calls(text, "hermes")
    assert turn.calls == [ToolCall("calculator", {"expression": "1+1"}), ToolCall("calculator", {"expression": "2*3"})]
    assert len(turn.errors) == 3 and turn.wants_tools
    assert turn.errors[0].startswith("tool call 3: invalid JSON")
    assert turn.errors[1] == 'tool call 4: missing the function "name"'
    assert "arguments must be a JSON object, got list" in turn.errors[2]
    assert turn.content == "Let me compute.\n\n trailing"


def test_hermes_unclosed_call_and_plain_answers():
    turn = parse_tool_calls('First.<tool_call>\n{"name": "calculator", "arguments": {"expr', "hermes")
    assert not turn.calls and turn.errors == ["tool call 1: <tool_call> without </tool_call>"]
    assert turn.content == "First."
    plain = parse_tool_calls("The answer is 4.\n#### 4", "hermes")
    assert not plain.wants_tools and plain.content == "The answer is 4.\n#### 4"


def test_llama3_bare_json():
    turn = parse_tool_calls('<|python_tag|>{"name": "calculator", "parameters": {"expression": "2+2"}}; '
                            '{"name": "calculator", "parameters": {"expression": "3"}}', "llama3")
    assert turn.calls == [ToolCall("calculator", {"expression": "2+2"}), ToolCall("calculator", {"expression": "3"})]
    assert not turn.errors
    bad = parse_tool_calls('{"name": "calculator", "parameters": {"expression": ', "llama3")
    assert not bad.calls and bad.errors[0].startswith("tool call 1: invalid JSON")
    assert not parse_tool_calls("It is 4.", "llama3").wants_tools


def test_formatted_calls_parse_back_and_match_qwen_rendering():
    call = ToolCall("calculator", {"expression": "48 / 2"})
    for fmt in ("hermes", "llama3"):
        assert parse_tool_calls(format_tool_call(call, fmt), fmt).calls == [call]
    qwen = json.loads((REAL_TOKENIZERS / "qwen2.5-instruct" / "tokenizer_config.json").read_text())["chat_template"]
    assert detect_call_format(qwen) == "hermes"
    llama = '{{- "Respond in the format {\\"name\\": function name, \\"parameters\\": ..." }}{{ "<|python_tag|>" }}'
    assert detect_call_format(llama) == "llama3" and detect_call_format(None) == "hermes"
    with pytest.raises(ValueError, match="unknown tool-call format"):
        parse_tool_calls("x", "xml")


# ------------------------------------------------------------------- degenerate model output is bounded
def _degenerate_turns(fmt: str) -> dict[str, str]:
    """Generated turns a policy can write, each over one of the parser's bounds (or Python's own)."""
    from lmforge.rl.tools.tool_calls import MAX_CALL_CHARS, MAX_DEPTH

    def call(args: str) -> str:
        body = '{"name": "calculator", "%s": %s}' % ("arguments" if fmt == "hermes" else "parameters", args)
        return f"<tool_call>{body}</tool_call>" if fmt == "hermes" else body

    return {
        "deep nesting": call("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1)),
        "deep nesting, unclosed": call("[" * 3000),
        "recursion-deep": call("[" * 200_000),
        "huge integer": call('{"expression": %s}' % ("9" * 5000)),
        "long integer": call('{"expression": %s}' % ("9" * 200)),
        "nested string arguments": call(json.dumps("[" * 3000)),
        "long name": call("{}").replace("calculator", "c" * 500),
        "long call": call('{"expression": "%s"}' % ("1+" * MAX_CALL_CHARS)),
        "unclosed tags": "<tool_call>" * 20_000 + "{",
        "many calls": (call('{"expression": "1"}') + ";") * 100,
    }


@pytest.mark.parametrize("fmt", ["hermes", "llama3"])
def test_degenerate_model_output_is_a_tool_error_read_fast(fmt):
    for what, text in _degenerate_turns(fmt).items():
        t = time.perf_counter()
        turn = parse_tool_calls(text, fmt)
        assert time.perf_counter() - t < 0.25, what
        if what == "many calls":  # the first calls are read, the rest refused in one error
            assert len(turn.calls) == 16 and "more than 16 tool calls" in turn.errors[-1], what
        elif what != "unclosed tags" or fmt == "hermes":
            assert not turn.calls and turn.errors and turn.wants_tools, (what, turn.errors)


def test_degenerate_output_reaches_the_model_as_error_results():
    """Through the environment the GRPO rollout drives: the run goes on and the model reads why."""
    from lmforge.rl.environments.base import ToolStyle
    from lmforge.rl.environments.gsm8k import GSM8KCalculatorEnv

    env = GSM8KCalculatorEnv(None, style=ToolStyle(native=False))
    for what, text in _degenerate_turns("hermes").items():
        out = env.step({}, [], text)
        assert not out.done and out.tool_errors >= 1, what
        assert all(m["content"].count("error:") >= 1 for m in out.results), what


def test_answers_from_model_output_are_read_in_bounded_time():
    from lmforge.rl.math_answers import answers_match

    for text in ("#### 1e-99999999", "#### 1e999999", "\\boxed{1e99999999}", "#### " + "9" * 5000, "7" * 100_000):
        t = time.perf_counter()
        assert not answers_match(text, "5")
        assert time.perf_counter() - t < 0.05, text[:20]
    assert answers_match("#### 1e3", "1000") and answers_match("#### 2.5e-1", "1/4")
