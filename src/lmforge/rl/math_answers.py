"""Final answers of math word problems (GSM8K, MATH-style ``\\boxed{}``): extraction and comparison.

A completion's final answer is, in this order:

1. the text after the last ``####`` (GSM8K's solution format) up to the end of that line;
2. else the content of the last ``\\boxed{...}`` (nested braces allowed);
3. else the last number in the text. This fallback is a deliberate choice: an instruct model that
   ends with "... so she earned $10." is right, and a format reward can ask for ``####`` separately.

A reference answer is extracted the same way when it holds ``####`` or ``\\boxed`` (so GSM8K's full
solution works as the reference), and is otherwise taken whole.

Both are normalized (spaces, ``$``, ``\\%``/``%``, LaTeX spacing and ``\\text{}``, thousands
separators ``1,000``, a trailing ``.``, ``\\frac{a}{b}`` -> ``a/b``) and compared as exact rationals
when both parse as numbers, so ``1,000`` == ``1000`` == ``1000.0`` and ``3/4`` == ``0.75``; otherwise
as normalized strings.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["final_answer", "reference_answer", "normalize_answer", "as_number", "answers_match"]

_NUMBER = re.compile(r"(?:(?<![\w.])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+(?:\.\d+)?)?")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def _boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, braces balanced; None if there is none (or it is unclosed)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def _after_hashes(text: str) -> str | None:
    if "####" not in text:
        return None
    segment = text.rsplit("####", 1)[1].strip().split("\n", 1)[0].strip()
    if not segment:
        return None
    if as_number(normalize_answer(segment)) is None:  # "#### 72 apples": the number in it
        numbers = _NUMBER.findall(segment)
        if numbers:
            return numbers[0]
    return segment


def final_answer(text: str) -> str | None:
    """The final answer of a completion (see the module docstring), not yet normalized; None if none."""
    found = _after_hashes(text)
    if found is None:
        found = _boxed(text)
    if found is None:
        numbers = _NUMBER.findall(text.replace("\u2212", "-"))
        found = numbers[-1] if numbers else None
    return found


def reference_answer(answer: str) -> str:
    """The answer a reference stands for: extracted from a full solution, else the whole text."""
    if "####" in answer or "\\boxed{" in answer:
        found = final_answer(answer)
        if found is not None:
            return found
    return answer


def normalize_answer(answer: str) -> str:
    """A canonical spelling: no spaces, currency, percent, LaTeX spacing or thousands separators."""
    s = answer.strip().replace("\u2212", "-")
    s = _TEXT.sub(r"\1", s)
    s = _FRAC.sub(r"\1/\2", s)
    for old, new in (("{,}", ","), ("\\$", ""), ("$", ""), ("\\%", ""), ("%", ""), ("\\!", ""), ("\\,", ""),
                     ("\\ ", "")):
        s = s.replace(old, new)
    s = "".join(s.split())
    while s.endswith("."):
        s = s[:-1]
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    return s


MAX_NUMBER_CHARS = 200
"""Longest answer read as a number; a longer one is compared as text."""
MAX_EXPONENT = 400
"""Largest decimal exponent read (``1e-99999999`` as an exact rational would take minutes to build)."""
_EXPONENT = re.compile(r"[eE]([+-]?\d+)")


def as_number(normalized: str) -> Fraction | None:
    """The exact value of a normalized answer (integers, decimals, ``a/b``), or None. Completions are
    untrusted: an answer over :data:`MAX_NUMBER_CHARS` characters or with an exponent over
    :data:`MAX_EXPONENT` is not a number here, so no answer costs more than microseconds to read."""
    if len(normalized) > MAX_NUMBER_CHARS or any(abs(int(e)) > MAX_EXPONENT for e in _EXPONENT.findall(normalized)):
        return None
    try:
        return Fraction(normalized)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(completion: str, reference: str) -> bool:
    """Whether the completion's final answer is the reference's answer."""
    got = final_answer(completion)
    if got is None:
        return False
    a, b = normalize_answer(got), normalize_answer(reference_answer(reference))
    x, y = as_number(a), as_number(b)
    if x is not None and y is not None:
        return x == y
    return a == b and a != ""
