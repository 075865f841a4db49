"""Multi-turn rollouts for GRPO (``grpo.environment``): groups of episodes laid out like completions.

Each prompt record starts ``num_generations`` episodes (:func:`lmforge.rl.multi_turn.run_episodes`); an
episode's completion is everything after its prompt: the policy's turns and, between them, the tool results
and template text the environment added. Only the policy's tokens carry loss (``completion_masks``). The
reward is the environment's, plus any ``grpo.rewards`` named explicitly, scored on the episode's answer.
"""

from __future__ import annotations

import importlib
import time
from typing import Any, Sequence

from lmforge.data.chat import ChatFormat
from lmforge.errors import UserError
from lmforge.models.tokenizer import Tokenizer
from lmforge.rl.engines.base import RolloutEngine, SamplingSettings
from lmforge.rl.environments import CodeEnv, Environment, GSM8KCalculatorEnv
from lmforge.rl.multi_turn import episode_metrics, run_episodes
from lmforge.rl.rewards import WeightedReward, score_completions
from lmforge.rl.rollout import RolloutSettings, SampledGroups

BUILTIN_ENVIRONMENTS = {"gsm8k_calculator": GSM8KCalculatorEnv, "code": CodeEnv}


ENVIRONMENT_METHODS = ("start", "step", "reward")
"""What :class:`~lmforge.rl.environments.Environment` asks of a class, checked before the run starts."""


def environment_class(name: str) -> Any:
    """``grpo.environment``: a built-in environment's class by name, or ``module:Class`` imported and
    checked to be a class with the environment's methods (anything else is one line, before any work)."""
    if name in BUILTIN_ENVIRONMENTS:
        return BUILTIN_ENVIRONMENTS[name]
    if name.startswith("verifiers:"):  # a verifiers taskset (imported only when named: verifiers is optional)
        from lmforge.rl.environments.verifiers_env import verifiers_environment_class

        return verifiers_environment_class(name)
    if name.startswith("openenv:"):
        from lmforge.rl.environments.openenv_env import openenv_environment_class

        return openenv_environment_class(name)
    module, _, attr = name.partition(":")
    if not attr or not module:
        raise UserError(f"grpo.environment={name!r}: not a built-in ({', '.join(BUILTIN_ENVIRONMENTS)}), "
                        "module:Class, verifiers:ID nor openenv:module:Class")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except Exception as e:  # noqa: BLE001 - a user's module may fail however it likes on import
        raise UserError(f"grpo.environment={name!r}: cannot load it ({type(e).__name__}: {e})") from None
    missing = [m for m in ENVIRONMENT_METHODS if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        what = f"a {type(cls).__name__}" if not isinstance(cls, type) else f"a class without {', '.join(missing)}"
        raise UserError(f"grpo.environment={name!r}: {what}, not an environment (a class with "
                        f"{', '.join(ENVIRONMENT_METHODS)}: lmforge.rl.environments.Environment)")
    return cls


def load_environment(name: str, chat: ChatFormat, *, max_turns: int, prompt_field: str, answer_field: str) -> Environment:
    """The environment ``name`` names (:func:`environment_class`); a ``module:Class`` is called with the chat
    format and ``max_turns``, a built-in or an adapter (``verifiers:``, ``openenv:``) also with the prompt
    records' column names."""
    cls = environment_class(name)
    if name in BUILTIN_ENVIRONMENTS or name.startswith(("verifiers:", "openenv:")):
        return cls(chat, max_turns=max_turns, prompt_field=prompt_field, answer_field=answer_field)
    try:
        return cls(chat, max_turns=max_turns)
    except TypeError as e:  # its constructor does not take (chat, max_turns=...)
        raise UserError(f"grpo.environment={name!r}: cannot construct it as {_constructor(name)} ({e})") from None


def _constructor(name: str) -> str:
    """How a ``module:Class`` environment is constructed, for the error line."""
    return f"{name.partition(':')[2]}(chat, max_turns=N)"


def sample_episode_groups(
    engine: RolloutEngine, env: Environment, records: Sequence[dict[str, Any]], rewards: Sequence[WeightedReward],
    s: RolloutSettings, *, chat: ChatFormat, tokenizer: Tokenizer, stop_ids: Sequence[int], seed: int,
    prompt_field: str, engine_logprobs: bool, max_total_tokens: int = 0,
) -> SampledGroups:
    G = s.num_generations
    rows = [r for r in records for _ in range(G)]
    sampling = SamplingSettings(s.max_new_tokens, s.temperature, s.top_p, tuple(stop_ids))
    t0 = time.perf_counter()
    episodes = run_episodes(engine, env, rows, chat, tokenizer, sampling, seed,
                            max_total_tokens=max_total_tokens or None, logprobs=engine_logprobs)
    gen_seconds = time.perf_counter() - t0
    prompts = [r[prompt_field] for r in rows]
    total = [e.reward for e in episodes]
    per_function = {"environment": list(total)}
    metrics = episode_metrics(episodes)
    if rewards:
        fields = {k: [r.get(k) for r in rows] for k in records[0] if k != prompt_field}
        fields["completion_length"] = [len(e.completion_ids) for e in episodes]
        scores = score_completions(rewards, prompts, [e.final_text or "" for e in episodes], fields)
        total = [a + b for a, b in zip(total, scores.total)]
        per_function |= scores.per_function
        metrics |= scores.metrics
    return SampledGroups(
        G, list(records), [episodes[i * G].prompt_ids for i in range(len(records))],
        [e.completion_ids for e in episodes], prompts, [tokenizer.decode(e.completion_ids) for e in episodes],
        [e.truncated for e in episodes], total, per_function, gen_seconds,
        logprobs=[list(e.logprobs or []) for e in episodes] if engine_logprobs else None,
        completion_masks=[list(e.loss_mask) for e in episodes], metrics=metrics)
