"""Multi-turn episodes through a rollout engine: generate, run the tools, append their tokens, repeat.

:func:`run_episodes` plays one episode per prompt record against an :class:`~lmforge.rl.environments.Environment`.
Each turn, the sequences of every episode still running are sent to the engine in one ``generate`` call;
each completion is decoded and read by the environment, which ends the episode (a final answer) or answers
with tool results. The tokens the chat template writes next (what follows the end-of-turn token, the result
messages, the next generation prompt) are appended, and the next turn generates from there.

Token ids, not text, carry the episode: the model's sampled ids are kept exactly as sampled (never decoded
and re-tokenized, which could change them and so the log-probabilities the loss is computed on), and only
the template's tokens between turns are computed, by :meth:`ChatFormat.continuation_ids`: the text the
template renders after the last answer's end-of-turn token, tokenized where it lies in the whole
rendering. ChatML's newline after ``<|im_end|>``, which the model never generates, is therefore part of the
template's tokens. Where the model writes exactly what the template would, the episode's ids equal the
template's rendering of the whole conversation, tokenized.

An episode ends with an answer, or is *truncated*: a turn cut off at ``max_new_tokens`` (no stop token),
the ``max_turns`` limit reached with tools still being called, the episode's token budget
(``max_total_tokens``, model and template tokens of the completion together) spent, or a turn the chat
template cannot render (a sampled U+E000, which marks answers while masking; a template's own refusal),
which ends that episode rather than the run.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from lmforge.data.chat import ChatFormat
from lmforge.models.tokenizer import Tokenizer
from lmforge.rl.engines.base import RolloutEngine, SamplingSettings
from lmforge.rl.environments.base import Environment

__all__ = ["Episode", "run_episodes", "turn_seed", "episode_metrics"]


@dataclass
class Episode:
    record: Mapping[str, Any]
    messages: list[dict[str, Any]]
    """The conversation so far, as the template renders it (the model's turns as the environment read them)."""
    tools: list[dict[str, Any]] | None
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    """Everything after the prompt: the model's tokens and the template's tokens between turns."""
    loss_mask: list[int] = field(default_factory=list)
    """1 on the model's tokens, 0 on the template's (tool results, role headers)."""
    logprobs: list[float] | None = field(default_factory=list)
    """The engine's log p of each model token, 0.0 on template tokens; None when not asked for or not reported."""
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    """Tool results the episode received (one per call attempted, malformed ones included)."""
    tool_errors: int = 0
    """Of those, the errors (see :class:`~lmforge.rl.environments.TurnOutcome`)."""
    truncated: bool = False
    end: str = ""
    """Why it ended: ``answer``, ``max_new_tokens`` (a turn cut off), ``max_turns``, ``token_budget``, or
    ``template_error`` (the chat template refused the conversation so far; see :attr:`template_error`)."""
    final_text: str | None = None
    """The last turn's text when it is the answer; None when the episode was truncated."""
    last_text: str = ""
    """The last turn's text, answer or not (for logs)."""
    template_error: str = ""
    """Why the template could not render the conversation on (``end == "template_error"``)."""
    env: Any = field(default=None, repr=False, compare=False)
    """What plays this episode: the environment, or its ``for_episode()`` (an environment with state per episode)."""

    @property
    def done(self) -> bool:
        return bool(self.end)

    def _append(self, ids: Sequence[int], model: bool, logprobs: Sequence[float] | None = None) -> None:
        self.completion_ids += ids
        self.loss_mask += [int(model)] * len(ids)
        if self.logprobs is not None:
            if model and logprobs is None:
                self.logprobs = None
            else:
                self.logprobs += list(logprobs) if model else [0.0] * len(ids)

    def _finish(self, end: str, final_text: str | None = None) -> None:
        self.end = end
        self.truncated = end != "answer"
        self.final_text = final_text


def turn_seed(seed: int, turn: int) -> int:
    """The engine seed of turn ``turn``: ``seed`` itself for the first (so a one-turn episode samples as a
    plain rollout with that seed would), then a 63-bit hash of both, so turns never share a stream."""
    if turn == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def run_episodes(engine: RolloutEngine, env: Environment, records: Sequence[Mapping[str, Any]], chat: ChatFormat,
                 tokenizer: Tokenizer, sampling: SamplingSettings, seed: int, *,
                 max_total_tokens: int | None = None, logprobs: bool = False) -> list[Episode]:
    """One episode per record (repeat a record for a group), played turn by turn; see the module docstring.

    ``sampling.max_new_tokens`` bounds each turn and ``sampling.stop_ids`` ends one (include the template's
    end-of-turn token, :func:`lmforge.data.chat.stop_token_ids`); ``max_total_tokens`` bounds the whole
    completion (default ``max_new_tokens * env.max_turns``). ``logprobs`` asks the engine for the sampled
    tokens' log-probs (``Episode.logprobs`` is None otherwise). Rewards are the environment's, on the answer.
    An environment with a ``for_episode()`` method plays each episode on the object it returns (state per
    episode: an OpenEnv instance), which is asked for the episode's reward too.
    """
    if not sampling.stop_ids:
        raise ValueError("run_episodes needs sampling.stop_ids (the tokens that end a turn)")
    budget = max_total_tokens if max_total_tokens is not None else sampling.max_new_tokens * env.max_turns
    if budget < 1:
        raise ValueError(f"max_total_tokens must be positive, got {budget}")
    stops = set(sampling.stop_ids)
    per_episode = getattr(env, "for_episode", None)
    episodes = []
    for record in records:
        player = per_episode() if callable(per_episode) else env
        start = player.start(record)
        episodes.append(Episode(record, list(start.messages), start.tools, chat.prompt_ids(start.messages, start.tools),
                                logprobs=[] if logprobs else None, env=player))
    for turn in range(env.max_turns):
        active = [e for e in episodes if not e.done]
        if not active:
            break
        room = max(budget - len(e.completion_ids) for e in active)
        settings = replace(sampling, max_new_tokens=min(sampling.max_new_tokens, room))
        outs = engine.generate([e.prompt_ids + e.completion_ids for e in active], settings,
                               seed=turn_seed(seed, turn), logprobs=logprobs)
        if len(outs) != len(active):
            raise RuntimeError(f"engine {getattr(engine, 'name', engine)!r} returned {len(outs)} completions "
                               f"for {len(active)} prompts")
        for e, out in zip(active, outs):
            _play_turn(e, out.token_ids, out.logprobs, e.env, chat, tokenizer, stops, budget,
                       last=turn == env.max_turns - 1)
    for e in episodes:
        e.reward = float(e.env.reward(e.record, e.final_text))
    return episodes


def _play_turn(e: Episode, ids: list[int], logprobs: list[float] | None, env: Environment, chat: ChatFormat,
               tokenizer: Tokenizer, stops: set[int], budget: int, last: bool) -> None:
    ids = list(ids[: budget - len(e.completion_ids)])  # the engine may have been allowed more than this episode
    e._append(ids, True, None if logprobs is None else logprobs[: len(ids)])
    e.turns += 1
    stopped = bool(ids) and ids[-1] in stops
    text = tokenizer.decode(ids[:-1] if stopped else ids)
    e.last_text = text
    if not stopped:  # cut off mid-turn: recorded as written, not read by the environment
        e.messages.append({"role": "assistant", "content": text})
        e._finish("token_budget" if len(e.completion_ids) >= budget else "max_new_tokens")
        return
    outcome = env.step(e.record, e.messages, text, execute=not last)
    e.messages.append(outcome.assistant)
    if outcome.done:
        e._finish("answer", text)
        return
    if last:
        e._finish("max_turns")
        return
    e.tool_calls += outcome.tool_calls
    e.tool_errors += outcome.tool_errors
    try:
        cont = chat.continuation_ids(e.messages, outcome.results, e.tools)
    except ValueError as err:  # a turn the template cannot render (e.g. U+E000 in sampled text): end it here
        e.template_error = str(err)
        e._finish("template_error")
        return
    e.messages += outcome.results
    if len(e.completion_ids) + len(cont) >= budget:  # no room left for the model to say anything
        e._finish("token_budget")
        return
    e._append(cont, False)


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """Means over a batch of episodes, for the metrics log: turns, tool results per episode, the share of
    results that are errors, the shares of truncated episodes and of template errors, and the model's
    and the template's tokens per episode."""
    n = max(len(episodes), 1)
    calls = sum(e.tool_calls for e in episodes)
    model = sum(sum(e.loss_mask) for e in episodes)
    return {
        "tools/turns": sum(e.turns for e in episodes) / n,
        "tools/calls": calls / n,
        "tools/error_rate": sum(e.tool_errors for e in episodes) / calls if calls else 0.0,
        "tools/truncated": sum(e.truncated for e in episodes) / n,
        "tools/template_errors": sum(e.end == "template_error" for e in episodes) / n,
        "tools/model_tokens": model / n,
        "tools/template_tokens": (sum(len(e.completion_ids) for e in episodes) - model) / n,
    }
