"""Tools a model can call during an RL episode (:mod:`lmforge.rl.environments`), and parsing its calls.

* :mod:`.calculator` - a sandboxed arithmetic evaluator and its JSON-schema definition;
* :mod:`.tool_calls` - tool calls in generated text (``<tool_call>`` JSON, Llama 3.1's bare JSON).
* :mod:`.sandbox` - model-written Python run in a separate, limited process (the ``code`` environment's tool).
"""

from lmforge.rl.tools.calculator import CALCULATOR_TOOL, calculate
from lmforge.rl.tools.tool_calls import (
    CallFormat, ParsedTurn, ToolCall, detect_call_format, format_tool_call, parse_tool_calls,
)

__all__ = ["CALCULATOR_TOOL", "calculate", "CallFormat", "ParsedTurn", "ToolCall", "detect_call_format",
           "format_tool_call", "parse_tool_calls"]
