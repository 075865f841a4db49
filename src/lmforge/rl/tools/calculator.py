"""A calculator tool: arithmetic expressions evaluated over a whitelisted Python AST, in bounded time and memory.

The model writes ``calculator({"expression": "12 * (7 + 5) / 4"})``; the expression is parsed with
:func:`ast.parse` and evaluated node by node, allowing only:

* int and float literals (no strings, bytes, complex or booleans);
* ``+ - * / // % **``, unary ``+``/``-``, parentheses, and chained comparisons (``< <= > >= == !=``);
* the functions in :data:`FUNCTIONS` (``sqrt``, ``abs``, ``round``, ``min``, ``max``, ``floor``, ``ceil``,
  ``log``, ``exp``) called by bare name with positional arguments, and the constants ``pi`` and ``e``.

Nothing else is accepted: no other names, attributes, subscripts, comprehensions, lambdas, keyword
arguments or starred arguments, so an expression can neither reach Python's objects nor import.

Work is bounded before it is done, not by a timer: the expression is at most :data:`MAX_CHARS` characters
and :data:`MAX_NODES` AST nodes, and every integer operation whose result could exceed
:data:`MAX_INT_BITS` bits (``**``, ``*``, ``round`` with many digits) is refused from the operands' bit
lengths before it is computed. ``10**10**10`` is therefore refused in microseconds instead of allocating
gigabytes. Every failure (syntax, a refused construct, division by zero, overflow, a complex result)
comes back as a string starting with ``error:``, which the environment gives the model as the tool's
result: the tool never raises.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Callable

__all__ = ["calculate", "CALCULATOR_TOOL", "FUNCTIONS", "MAX_CHARS", "MAX_NODES", "MAX_INT_BITS"]

MAX_CHARS = 300
"""Longest expression accepted, in characters."""
MAX_NODES = 200
"""Most AST nodes accepted (bounds the number of operations, and the recursion depth)."""
MAX_INT_BITS = 1024
"""Largest integer a result may be (about 308 decimal digits); floats are bounded by their own range."""

Number = int | float


class CalculatorError(Exception):
    """A refused or failed expression; its message is what the model reads after ``error:``."""


def _check_int(x: Number) -> Number:
    if isinstance(x, int) and x.bit_length() > MAX_INT_BITS:
        raise CalculatorError(f"result too large (over {MAX_INT_BITS} bits)")
    return x


def _number(x: Any) -> Number:
    if isinstance(x, bool):  # a comparison's result used as a number
        return int(x)
    if isinstance(x, complex):
        raise CalculatorError("complex result")
    if isinstance(x, float) and not math.isfinite(x):
        raise CalculatorError("result is not a finite number")
    return _check_int(x)


def _power(a: Number, b: Number) -> Number:
    """Integer powers are refused when ``|a|**b`` has at least ``MAX_INT_BITS`` bits (``2**(bits-1)`` is a lower
    bound of ``|a|``), so the result computed is never more than twice that. Powers with a float are
    computed in floating point, which overflows (an error) rather than grows; a negative base with a
    fractional exponent gives a complex number, refused by the caller."""
    if isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1:
        if (abs(a).bit_length() - 1) * b >= MAX_INT_BITS:
            raise CalculatorError(f"result too large (over {MAX_INT_BITS} bits)")
    return pow(a, b)


def _multiply(a: Number, b: Number) -> Number:
    if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > MAX_INT_BITS + 1:
        raise CalculatorError(f"result too large (over {MAX_INT_BITS} bits)")
    return a * b


def _round(x: Number, ndigits: Number | None = None) -> Number:
    if ndigits is None:
        return round(x)
    if not isinstance(ndigits, int) or abs(ndigits) > 100:
        raise CalculatorError("round(x, n) needs an integer n between -100 and 100")
    return round(x, ndigits)


BINARY: dict[type, Callable[[Number, Number], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: _multiply, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: _power,
}
COMPARE: dict[type, Callable[[Number, Number], bool]] = {
    ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
    ast.Eq: operator.eq, ast.NotEq: operator.ne,
}
FUNCTIONS: dict[str, tuple[Callable[..., Number], int, int]] = {
    "sqrt": (math.sqrt, 1, 1), "abs": (abs, 1, 1), "round": (_round, 1, 2), "min": (min, 2, 32),
    "max": (max, 2, 32), "floor": (math.floor, 1, 1), "ceil": (math.ceil, 1, 1), "log": (math.log, 1, 2),
    "exp": (math.exp, 1, 1),
}
"""name -> (function, fewest arguments, most arguments)."""
CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if type(node.value) not in (int, float):
            raise CalculatorError(f"only numbers are allowed, not {type(node.value).__name__} {node.value!r}"[:120])
        return _number(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        return _number(BINARY[type(node.op)](_eval(node.left), _eval(node.right)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        x = _eval(node.operand)
        return -x if isinstance(node.op, ast.USub) else +x
    if isinstance(node, ast.Compare) and all(type(op) in COMPARE for op in node.ops):
        left = _eval(node.left)
        result = True
        for op, right_node in zip(node.ops, node.comparators):
            right = _eval(right_node)
            result = result and COMPARE[type(op)](left, right)
            left = right
        return result  # a bool, shown as True/False
    if isinstance(node, ast.Name):
        if node.id in CONSTANTS:
            return CONSTANTS[node.id]
        raise CalculatorError(f"unknown name {node.id!r} (functions: {', '.join(FUNCTIONS)}; constants: pi, e)")
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            raise CalculatorError(f"unknown function (allowed: {', '.join(FUNCTIONS)})")
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise CalculatorError("functions take positional arguments only")
        fn, lo, hi = FUNCTIONS[node.func.id]
        if not lo <= len(node.args) <= hi:
            raise CalculatorError(f"{node.func.id}() takes {lo}{'' if lo == hi else f' to {hi}'} argument(s)")
        return _number(fn(*[_eval(a) for a in node.args]))
    raise CalculatorError(f"{type(node).__name__} is not allowed (numbers, + - * / // % **, comparisons and "
                          f"{', '.join(FUNCTIONS)} only)")


def _format(x: Number) -> str:
    """Integers in full; floats with 12 significant digits, integral ones without ``.0`` (``84/4`` -> ``21``)."""
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, float):
        if x.is_integer() and abs(x) < 1e15:
            return str(int(x))
        return f"{x:.12g}"
    return str(x)


def calculate(expression: Any) -> str:
    """The value of ``expression`` as text, or ``"error: ..."``; never raises (see the module docstring)."""
    if not isinstance(expression, str):
        return f"error: the expression must be a string, got {type(expression).__name__}"
    text = expression.strip()
    if not text:
        return "error: empty expression"
    if len(text) > MAX_CHARS:
        return f"error: expression longer than {MAX_CHARS} characters"
    try:
        # ^ is what models write for powers (Python's XOR is not allowed anyway); x and the division sign too
        tree = ast.parse(text.replace("^", "**").replace("\u00d7", "*").replace("\u00f7", "/"), mode="eval")
    except (SyntaxError, ValueError) as e:  # ValueError: null bytes
        return f"error: invalid expression ({getattr(e, 'msg', None) or e})"
    except (RecursionError, MemoryError):
        return "error: expression too deeply nested"
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        return f"error: expression has more than {MAX_NODES} parts"
    try:
        return _format(_eval(tree))
    except CalculatorError as e:
        return f"error: {e}"
    except ZeroDivisionError:
        return "error: division by zero"
    except OverflowError:
        return "error: result too large"
    except (ValueError, TypeError, ArithmeticError) as e:  # math domain errors, min() of mixed types
        return f"error: {e}"
    except RecursionError:
        return "error: expression too deeply nested"


CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": ("Evaluate an arithmetic expression and return its value. Supports numbers, + - * / // % ** "
                        "and parentheses, comparisons, and the functions sqrt, abs, round, min, max, floor, ceil, "
                        "log, exp."),
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string",
                                          "description": "The expression to evaluate, e.g. \"12 * (7 + 5) / 4\"."}},
            "required": ["expression"],
        },
    },
}
"""The calculator's definition as an OpenAI-style JSON schema, as ``apply_chat_template(tools=...)`` takes it."""
