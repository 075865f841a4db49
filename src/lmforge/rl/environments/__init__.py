"""Multi-turn RL environments (see :mod:`.base`): :class:`GSM8KCalculatorEnv` is GSM8K with a calculator,
:class:`CodeEnv` function writing with a sandboxed ``python`` tool and hidden unit tests."""

from lmforge.rl.environments.base import (
    Conversation, Environment, Tool, ToolEnvironment, ToolStyle, TurnOutcome, tool_style_for,
)
from lmforge.rl.environments.code import CodeEnv
from lmforge.rl.environments.gsm8k import GSM8KCalculatorEnv, calculator_tool

__all__ = ["Conversation", "Environment", "Tool", "ToolEnvironment", "ToolStyle", "TurnOutcome", "tool_style_for",
           "GSM8KCalculatorEnv", "calculator_tool", "CodeEnv"]
