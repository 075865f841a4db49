"""The code environment (``grpo.environment = "code"``): write a Python function, test it with a sandboxed
``python`` tool, get rewarded by hidden unit tests.

A prompt record is ``{"prompt": ..., "entry_point": name, "tests": JSON list of {"args", "expected"}}``
(the embedded task, :mod:`.code_tasks`, or a file with those columns). The policy may call ``python``
with ``{"code": "..."}`` during the episode; it reads the run's stdout, the error's last line or a
timeout (:func:`lmforge.rl.tools.sandbox.run_python`). Its final answer's last ```python block (or the
whole answer when there is none) is the solution. The reward is the fraction of hidden tests passed.

The hidden tests never enter the sandbox: only their inputs do. The solution runs with a small harness
that calls the function on each input and prints the results as JSON; the trainer compares them with the
expected outputs. So the model's code cannot read the answers, and printing fake results needs the right
outputs, i.e. a solution.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Mapping

from lmforge.data.chat import ChatFormat
from lmforge.data.record_formats import prompt_messages
from lmforge.errors import UserError
from lmforge.rl.environments.base import Message, ToolEnvironment, ToolStyle
from lmforge.rl.environments.code_tasks import code_task_records
from lmforge.rl.tools.sandbox import SandboxLimits, run_python

__all__ = ["CodeEnv", "CODE_SYSTEM_PROMPT", "PYTHON_TOOL", "python_tool", "extract_code", "score_solution"]

CODE_SYSTEM_PROMPT = ("You write Python functions. You may run code with the python tool to test it (it prints "
                      "what your code prints). When done, reply with the complete function in a ```python block.")

PYTHON_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "python",
        "description": ("Run Python code (standard library only, no network, a few seconds) and return what it "
                        "prints, or the error's last line."),
        "parameters": {"type": "object",
                       "properties": {"code": {"type": "string", "description": "The Python code to run."}},
                       "required": ["code"]},
    },
}
"""The tool's definition as an OpenAI-style JSON schema."""

TOOL_LIMITS = SandboxLimits(timeout_s=5.0, cpu_s=5, output_chars=1000)
TEST_LIMITS = SandboxLimits(timeout_s=5.0, cpu_s=5, output_chars=200_000)

_MARK = "__lmforge_results__"
_HARNESS = """

import json as _lmf_json
_lmf_out = []
_lmf_fn = globals().get({name!r})
with open("inputs.json", encoding="utf-8") as _lmf_f:
    _lmf_inputs = _lmf_json.load(_lmf_f)
for _lmf_args in _lmf_inputs:
    try:
        _lmf_out.append({{"value": _lmf_json.loads(_lmf_json.dumps(_lmf_fn(*_lmf_args)))}})
    except BaseException as _lmf_e:
        _lmf_out.append({{"error": type(_lmf_e).__name__}})
print()
print({mark!r} + _lmf_json.dumps(_lmf_out))
"""

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def python_tool(arguments: dict[str, Any]) -> str:
    """The sandbox as a tool: ``{"code": "..."}`` -> stdout, ``error: <last line>`` or ``error: timed out``."""
    code = arguments.get("code")
    if set(arguments) - {"code"} or not isinstance(code, str):
        return "error: python takes one argument, \"code\" (a string)"
    return run_python(code, TOOL_LIMITS).for_model()


def extract_code(text: str) -> str:
    """The last fenced code block of an answer, or the whole answer when it has none."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def _same(got: Any, want: Any) -> bool:
    """JSON values equal with their types (True is not 1), floats within 1e-6 relative."""
    if isinstance(want, bool) or isinstance(got, bool):
        return type(got) is type(want) and got == want
    if isinstance(want, (int, float)) and isinstance(got, (int, float)):
        return math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(want, list) and isinstance(got, list):
        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
    if isinstance(want, dict) and isinstance(got, dict):
        return got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    return type(got) is type(want) and got == want


def score_solution(code: str, entry_point: str, tests: list[dict[str, Any]],
                   limits: SandboxLimits = TEST_LIMITS) -> float:
    """The fraction of ``tests`` the solution passes, run in the sandbox (module docstring)."""
    if not tests:
        return 0.0
    inputs = json.dumps([t["args"] for t in tests])
    result = run_python(code + _HARNESS.format(name=entry_point, mark=_MARK), limits, files={"inputs.json": inputs})
    line = next((ln for ln in reversed(result.stdout.splitlines()) if ln.startswith(_MARK)), None)
    if result.timed_out or line is None:
        return 0.0
    try:
        got = json.loads(line[len(_MARK):])
    except json.JSONDecodeError:
        return 0.0
    if not isinstance(got, list) or len(got) != len(tests):
        return 0.0
    passed = sum(isinstance(g, dict) and "value" in g and _same(g["value"], t["expected"]) for g, t in zip(got, tests))
    return passed / len(tests)


class CodeEnv(ToolEnvironment):
    """Function-writing tasks with the ``python`` tool; the reward is the hidden tests' pass fraction."""

    def __init__(self, chat: ChatFormat, max_turns: int = 4, system_prompt: str | None = CODE_SYSTEM_PROMPT,
                 prompt_field: str = "prompt", answer_field: str = "answer", style: ToolStyle | None = None) -> None:
        super().__init__(chat, {"python": (PYTHON_TOOL, python_tool)}, max_turns, style)
        self.system_prompt = system_prompt
        self.prompt_field = prompt_field

    @staticmethod
    def embedded_records(split: str) -> list[dict[str, Any]]:
        """The embedded code task (:mod:`.code_tasks`), used when ``data.train`` is ``embedded``."""
        return code_task_records(split)

    @staticmethod
    def check_records(records: list[dict[str, Any]]) -> None:
        """Refuse, before the run starts, a record the reward could not score: it needs ``entry_point`` (a
        function name) and ``tests`` (a JSON list of ``{"args": [...], "expected": ...}``)."""
        for k, r in enumerate(records, start=1):
            name, tests = r.get("entry_point"), r.get("tests")
            why = ""
            if not isinstance(name, str) or not name.isidentifier():
                why = "no `entry_point` column naming the function"
            else:
                try:
                    tests = json.loads(tests) if isinstance(tests, str) else tests
                except json.JSONDecodeError as e:
                    tests, why = None, f"`tests` is not JSON ({e.msg})"
                if not why and (not isinstance(tests, list) or not tests or not all(
                        isinstance(t, dict) and isinstance(t.get("args"), list) and "expected" in t for t in tests)):
                    why = "`tests` is not a non-empty list of {\"args\": [...], \"expected\": ...}"
            if why:
                raise UserError(f"grpo.environment=code: prompt record {k}: {why}")

    def task_messages(self, record: Mapping[str, Any]) -> tuple[str | None, list[Message]]:
        messages = prompt_messages(record[self.prompt_field])
        if messages[0]["role"] == "system":
            return messages[0]["content"], messages[1:]
        return self.system_prompt, messages

    def reward(self, record: Mapping[str, Any], final_text: str | None) -> float:
        if final_text is None:
            return 0.0
        tests = record.get("tests")
        tests = json.loads(tests) if isinstance(tests, str) else tests
        return score_solution(extract_code(final_text), str(record["entry_point"]), list(tests or []))
