"""GSM8K with a calculator: grade-school word problems, solved in turns that may call :func:`calculate`.

A prompt record is ``{"prompt": question, "answer": reference}`` (the rows of a GSM8K prompt file;
``prompt`` may also be a message list). The reward is 1.0 when the final answer equals the reference
(:func:`lmforge.rl.math_answers.answers_match`: ``####``, ``\\boxed{}`` or the last number, compared as
exact rationals) and 0.0 otherwise, or when the episode ended without an answer.
"""

from __future__ import annotations

from typing import Any, Mapping

from lmforge.data.chat import ChatFormat
from lmforge.data.record_formats import prompt_messages
from lmforge.rl.environments.base import Message, ToolEnvironment, ToolStyle
from lmforge.rl.math_answers import answers_match
from lmforge.rl.tools.calculator import CALCULATOR_TOOL, calculate

__all__ = ["GSM8KCalculatorEnv", "GSM8K_SYSTEM_PROMPT", "calculator_tool"]

GSM8K_SYSTEM_PROMPT = ("Solve the math word problem step by step. Use the calculator tool for arithmetic. "
                       "When you know the answer, end your reply with a line of the form: #### <number>")


def calculator_tool(arguments: dict[str, Any]) -> str:
    """The calculator as a tool: ``{"expression": "..."}`` -> its value or ``error: ...``."""
    extra = sorted(set(arguments) - {"expression"})
    if extra or "expression" not in arguments:
        return "error: calculator takes one argument, \"expression\" (a string)"
    return calculate(arguments["expression"])


class GSM8KCalculatorEnv(ToolEnvironment):
    """GSM8K questions with the ``calculator`` tool; ``prompt_field``/``answer_field`` name the record's columns."""

    def __init__(self, chat: ChatFormat, max_turns: int = 4, system_prompt: str | None = GSM8K_SYSTEM_PROMPT,
                 prompt_field: str = "prompt", answer_field: str = "answer", style: ToolStyle | None = None) -> None:
        super().__init__(chat, {"calculator": (CALCULATOR_TOOL, calculator_tool)}, max_turns, style)
        self.system_prompt = system_prompt
        self.prompt_field = prompt_field
        self.answer_field = answer_field

    def task_messages(self, record: Mapping[str, Any]) -> tuple[str | None, list[Message]]:
        messages = prompt_messages(record[self.prompt_field])
        if messages[0]["role"] == "system":  # the record's own system prompt replaces the default
            return messages[0]["content"], messages[1:]
        return self.system_prompt, messages

    def reward(self, record: Mapping[str, Any], final_text: str | None) -> float:
        reference = record.get(self.answer_field)
        if final_text is None or reference is None:
            return 0.0
        return float(answers_match(final_text, str(reference)))
