"""Reward functions: plain Python callables scored on decoded completions.

A reward function has the signature ``f(prompts, completions, **fields) -> list[float | None]``:
``prompts`` and ``completions`` are lists of strings of equal length (each prompt repeated once per
completion of its group), and ``fields`` holds the dataset's other columns, aligned the same way
(for the embedded tasks: ``task`` and ``answer``) and ``completion_length``, each completion's length
in tokens (its stop token included). A function returns one value per completion, or
``None`` where it does not apply (e.g. a math checker asked about a word task); such entries count
as 0 in the weighted total and are left out of that function's logged mean.

Functions are named in the config either from the built-in registry (:data:`BUILTIN_REWARDS`), as
``rm:PATH`` (a trained reward model's score, :mod:`lmforge.rl.reward_model`), as ``judge:URL`` (an LLM
judge behind an OpenAI-compatible endpoint, :mod:`lmforge.rl.judge`) or as ``module:function``,
imported from the Python path plus the current directory. A function may have a ``batch_metrics()``
method; what it returns after each batch is logged with the step (the judge's failure counts).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import numbers
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from lmforge.errors import UserError

RewardFn = Callable[..., "list[float | None]"]


def _field(fields: dict[str, Any], name: str, reward: str) -> list[Any]:
    if name not in fields:
        raise UserError(f"reward `{reward}` needs an `{name}` column in the prompt data "
                        f"(columns present: {', '.join(sorted(fields)) or 'none'})")
    return fields[name]


def exact_answer(prompts: list[str], completions: list[str], **fields: Any) -> list[float | None]:
    """1.0 when the completion's extracted answer equals the reference ``answer``, else 0.0."""
    from lmforge.data.tasks import is_correct

    answers = _field(fields, "answer", "exact_answer")
    return [None if a is None else float(is_correct(c, str(a))) for c, a in zip(completions, answers)]


def answer_format(prompts: list[str], completions: list[str], **fields: Any) -> list[float | None]:
    """1.0 when the completion has the answer format the embedded tasks expect, else 0.0."""
    from lmforge.data.tasks import format_ok

    return [float(format_ok(c)) for c in completions]


def math_answer(prompts: list[str], completions: list[str], **fields: Any) -> list[float | None]:
    """1.0 when the completion's final answer equals the reference ``answer`` (numerically where both are
    numbers), else 0.0; ``None`` where a record has no answer. See :mod:`lmforge.rl.math_answers`."""
    from lmforge.rl.math_answers import answers_match

    answers = _field(fields, "answer", "math_answer")
    return [None if a is None else float(answers_match(c, str(a))) for c, a in zip(completions, answers)]


def overlong_penalty(prompts: list[str], completions: list[str], *, completion_length: list[int],
                     max_new_tokens: int, overlong_buffer: int, **fields: Any) -> list[float | None]:
    """DAPO's soft overlong penalty: 0 up to ``max_new_tokens - overlong_buffer`` tokens, then falling
    linearly to -1 at ``max_new_tokens``: (max_new_tokens - overlong_buffer - length) / overlong_buffer.

    A hard cut at the limit punishes a long but sound answer as much as rambling; the ramp says
    "shorter is better" only near the limit. ``max_new_tokens`` and ``overlong_buffer`` are bound from
    the ``[grpo]`` section by :func:`load_rewards`.
    """
    free = max_new_tokens - overlong_buffer
    return [0.0 if n <= free else max(free - n, -overlong_buffer) / overlong_buffer for n in completion_length]


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_answer": exact_answer,
    "format": answer_format,
    "math_answer": math_answer,
    "overlong_penalty": overlong_penalty,
}
"""Rewards available by bare name."""


def resolve_reward(name: str, judge: Any = None) -> RewardFn:
    """A built-in reward by name, ``rm:PATH`` (a trained reward model, :mod:`lmforge.rl.reward_model`),
    ``judge:URL`` (:mod:`lmforge.rl.judge`, with ``judge``, its :class:`~lmforge.rl.judge.JudgeSettings`), or
    ``module:function`` imported from the path or the current directory."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if name.startswith("judge:"):
        from lmforge.rl.judge import JudgeReward, JudgeSettings

        return JudgeReward(name[len("judge:"):], judge or JudgeSettings())
    if name.startswith("rm:"):
        from lmforge.rl.reward_model import RewardModelReward

        return RewardModelReward(name[3:])
    if ":" not in name:
        raise UserError(f"unknown reward `{name}`: use a built-in ({', '.join(BUILTIN_REWARDS)}), "
                        "rm:PATH, judge:URL or module:function")
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise UserError(f"reward `{name}`: expected module:function")
    if os.getcwd() not in sys.path and "" not in sys.path:  # the `lmforge` script does not put it there
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise UserError(f"reward `{name}`: module `{module_name}` not found "
                            "(run from its directory or put it on PYTHONPATH)") from None
        raise UserError(f"reward `{name}`: importing `{module_name}` failed: {_one_line(e)}") from None
    except Exception as e:  # noqa: BLE001 - a user's module failing at import (SyntaxError, ...)
        raise UserError(f"reward `{name}`: importing `{module_name}` failed: {_one_line(e)}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise UserError(f"reward `{name}`: module `{module_name}` has no attribute `{attr}`")
    if not callable(fn):
        raise UserError(f"reward `{name}`: `{attr}` is not callable")
    return fn


@dataclass(frozen=True)
class WeightedReward:
    name: str
    fn: RewardFn
    weight: float


def load_rewards(names: Sequence[str], weights: Sequence[float] = (), *, max_new_tokens: int = 0,
                 overlong_buffer: int = 0, judge: Any = None) -> list[WeightedReward]:
    """Resolve every name; ``weights`` is empty (all 1.0) or one weight per name. ``overlong_penalty``
    gets ``max_new_tokens`` and ``overlong_buffer`` (the ``[grpo]`` keys) bound here, ``judge:URL`` the
    ``grpo.judge_*`` settings (``judge``)."""
    if not names:
        raise UserError("grpo.rewards is empty: name at least one reward function")
    if weights and len(weights) != len(names):
        raise UserError(f"grpo.rewards_weights has {len(weights)} values for {len(names)} rewards "
                        f"({', '.join(names)})")
    if len(set(names)) != len(names):
        raise UserError(f"grpo.rewards names a function twice: {', '.join(names)}")
    ws = list(weights) if weights else [1.0] * len(names)
    if "overlong_penalty" in names and not 0 < overlong_buffer <= max_new_tokens:
        raise UserError(f"reward `overlong_penalty` needs 0 < grpo.overlong_buffer <= grpo.max_new_tokens "
                        f"(got {overlong_buffer} and {max_new_tokens})")
    bound = {"overlong_penalty": functools.partial(overlong_penalty, max_new_tokens=max_new_tokens,
                                                   overlong_buffer=overlong_buffer)}
    return [WeightedReward(n, bound.get(n) or resolve_reward(n, judge), float(w)) for n, w in zip(names, ws)]


MAX_REWARD = 1e6
"""Largest reward magnitude accepted: advantages are computed in float32, where the spread of rewards
far beyond this overflows and would surface later as a non-finite loss that names no reward."""


def _reward_value(name: str, v: Any, i: int) -> float:
    """One reward value as a float: a real number (bools count as 0/1) or None ("does not apply"),
    never a string or NaN."""
    if v is None:
        return math.nan
    if not isinstance(v, numbers.Real):
        raise UserError(f"reward `{name}` returned {type(v).__name__} {str(v)[:40]!r} for completion {i}; "
                        f"expected a number or None")
    x = float(v)
    if math.isnan(x):
        raise UserError(f"reward `{name}` returned NaN for completion {i}; return None when a reward does not apply")
    if not abs(x) <= MAX_REWARD:
        raise UserError(f"reward `{name}` returned {x:g} for completion {i}; rewards must be finite and within "
                        f"+-{MAX_REWARD:g} (scale the reward down)")
    return x


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1]}" if text else type(e).__name__


def probe_rewards(rewards: Sequence[WeightedReward], record: dict[str, Any], prompt_field: str = "prompt") -> None:
    """Call every reward once on a real prompt record with an empty completion, before the run writes
    anything: a reward that cannot be imported, called or return numbers fails the start, not step 1."""
    fields = {k: [v] for k, v in record.items() if k != prompt_field} | {"completion_length": [0]}
    try:
        score_completions(rewards, [record.get(prompt_field)], [""], fields)
    except UserError as e:
        raise UserError(f"{e} [start-up check: the first prompt with an empty completion, which a model "
                        f"can generate]") from None


@dataclass
class RewardScores:
    total: list[float]
    """Weighted sum per completion (``None`` entries count as 0)."""
    per_function: dict[str, list[float]]
    """Raw values per function; ``None`` becomes NaN."""
    metrics: dict[str, float] = field(default_factory=dict)
    """What the functions' ``batch_metrics()`` reported for this batch."""


def score_completions(rewards: Sequence[WeightedReward], prompts: list[str], completions: list[str],
                      fields: dict[str, list[Any]]) -> RewardScores:
    """Call each reward function once on the whole batch and combine with the weights."""
    total = [0.0] * len(completions)
    per_fn: dict[str, list[float]] = {}
    metrics: dict[str, float] = {}
    for r in rewards:
        try:
            values = r.fn(prompts, completions, **fields)
            if inspect.isgenerator(values):
                values = list(values)
        except UserError:  # already one line (a judge that failed too often)
            raise
        except Exception as e:  # noqa: BLE001 - the user's function: report it in one line
            raise UserError(f"reward `{r.name}` raised {_one_line(e)} (a reward is "
                            f"fn(prompts, completions, **fields) -> one number or None per completion)") from None
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
            raise UserError(f"reward `{r.name}` returned {got} for {len(completions)} completions "
                            f"(expected a list of one number or None per completion)")
        clean = [_reward_value(r.name, v, i) for i, v in enumerate(values)]
        per_fn[r.name] = clean
        total = [t + (0.0 if math.isnan(x) else r.weight * x) for t, x in zip(total, clean)]
        report = getattr(r.fn, "batch_metrics", None)
        if callable(report):
            metrics |= report()
    return RewardScores(total, per_fn, metrics)
