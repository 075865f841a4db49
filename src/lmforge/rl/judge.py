"""LLM-as-judge rewards: ``grpo.rewards = ["judge:URL"]`` scores each completion through an OpenAI-compatible
chat endpoint (vLLM, llama.cpp's server, SGLang, Ollama, a hosted API) with a rubric template.

The rubric (``grpo.judge_rubric``, text or a file path) is formatted with ``{prompt}``, ``{completion}`` and
``{answer}`` and sent as the user message; the judge's reply must contain ``SCORE: <number>`` (else its last
number is read), which is divided by ``grpo.judge_max_score`` and clipped to [0, 1].

A judge is a remote service that fails: each call has a timeout and is retried (timeouts, connection
errors, 429 and 5xx) with backoff. A completion the judge still could not score is ``None`` ("no score":
left out of ``reward/judge:URL``'s mean, 0 in the total) and counted, never passed off as a zero score:
``judge/failed`` (the fraction of the batch) is logged with every step, each failing batch prints a
warning with the last error, and a batch where more than ``grpo.judge_max_failed`` of the completions
failed stops the run with one ``error:`` line (the start-up probe is such a batch: an unreachable judge
fails the start). Scores are cached by (prompt, completion, and the reference answer the rubric shows): GRPO
resamples the same short answers often.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from lmforge.errors import UserError

__all__ = ["JudgeSettings", "JudgeReward", "DEFAULT_RUBRIC", "parse_score"]

DEFAULT_RUBRIC = (
    "You are grading an answer to a task.\n\nTask:\n{prompt}\n\nReference answer (may be empty):\n{answer}\n\n"
    "Answer to grade:\n{completion}\n\nRate how correct and helpful the answer is on a scale from 0 to 10. "
    "Reply with a short justification, then a last line of the form: SCORE: <number>"
)


@dataclass(frozen=True)
class JudgeSettings:
    model: str = "judge"
    rubric: str = DEFAULT_RUBRIC
    timeout_s: float = 30.0
    retries: int = 2
    max_score: float = 10.0
    max_failed: float = 0.5
    concurrency: int = 8
    api_key_env: str = ""
    """The environment variable holding the endpoint's key (sent as a bearer token); empty: none."""
    cache_size: int = 100_000


_SCORE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse_score(reply: str) -> float | None:
    """The ``SCORE: x`` of a judge's reply (the last one), else its last number; None without a number."""
    found = _SCORE.findall(reply) or _NUMBER.findall(reply)
    if not found:
        return None
    x = float(found[-1])
    return x if math.isfinite(x) else None


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, list):  # chat messages
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in prompt if isinstance(m, dict))
    return "" if prompt is None else str(prompt)


class _JudgeFailure(Exception):
    pass


class JudgeReward:
    """A reward function (``f(prompts, completions, **fields)``) backed by a chat endpoint; see the module."""

    def __init__(self, url: str, settings: JudgeSettings = JudgeSettings()) -> None:
        if not url.startswith(("http://", "https://")):
            raise UserError(f"reward `judge:{url}`: the judge's URL must start with http:// or https://")
        self.url = url.rstrip("/")
        if not self.url.endswith("/chat/completions"):
            self.url += "/chat/completions"
        self.name = f"judge:{url}"
        self.settings = settings
        rubric = settings.rubric
        if "\n" not in rubric and len(rubric) < 4096 and os.path.isfile(rubric):
            with open(rubric, encoding="utf-8") as f:
                rubric = f.read()
        try:
            rubric.format(prompt="", completion="", answer="")
        except (KeyError, IndexError, ValueError) as e:
            raise UserError(f"grpo.judge_rubric: not a template of {{prompt}}, {{completion}}, {{answer}} "
                            f"({type(e).__name__}: {e}; write a literal brace as {{{{ or }}}})") from None
        self.rubric = rubric
        self.api_key = ""
        if settings.api_key_env:
            self.api_key = os.environ.get(settings.api_key_env, "")
            if not self.api_key:
                raise UserError(f"grpo.judge_api_key_env={settings.api_key_env}: that environment variable is not set")
        self._cache: OrderedDict[tuple[str, str, str], float] = OrderedDict()
        self._lock = threading.Lock()
        self.calls = self.failures = self.cache_hits = self.scored = 0
        """Totals over the run: HTTP requests made, completions not scored, scores from the cache, scored."""
        self._last: dict[str, float] = {}

    # ------------------------------------------------------------------ one request
    def _request(self, content: str) -> str:
        import urllib.request  # here, not at import: the GRPO config reads this module (lmforge --help)

        body = json.dumps({"model": self.settings.model, "temperature": 0.0,
                           "messages": [{"role": "user", "content": content}]}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=self.settings.timeout_s) as resp:  # noqa: S310 - the user's URL
            payload = json.loads(resp.read().decode("utf-8", errors="replace"))
        try:
            return str(payload["choices"][0]["message"]["content"] or "")
        except (KeyError, IndexError, TypeError):
            raise _JudgeFailure(f"unexpected response {json.dumps(payload)[:120]}") from None

    def _score_one(self, prompt: str, completion: str, answer: str) -> float:
        import urllib.error

        content = self.rubric.format(prompt=prompt, completion=completion, answer=answer)
        last = ""
        for attempt in range(self.settings.retries + 1):
            if attempt:
                time.sleep(min(0.25 * 2 ** (attempt - 1), 4.0))
            with self._lock:
                self.calls += 1
            try:
                reply = self._request(content)
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code} {e.reason}"
                if e.code != 429 and e.code < 500:
                    break  # the request itself is wrong: asking again gets the same answer
                continue
            except (urllib.error.URLError, TimeoutError, OSError) as e:
                last = f"{type(getattr(e, 'reason', e)).__name__}: {getattr(e, 'reason', e)}"
                continue
            except (json.JSONDecodeError, _JudgeFailure) as e:
                last = f"bad response ({e})"
                continue
            score = parse_score(reply)
            if score is None:
                last = f"no score in the reply {reply[-80:]!r}"
                continue
            return min(max(score / self.settings.max_score, 0.0), 1.0)
        raise _JudgeFailure(last or "failed")

    # ------------------------------------------------------------------ the reward function
    def __call__(self, prompts: list[Any], completions: list[str], **fields: Any) -> list[float | None]:
        answers = fields.get("answer") or [None] * len(completions)
        keys = [(_prompt_text(p), c, "" if a is None else str(a)) for p, c, a in zip(prompts, completions, answers)]
        out: list[float | None] = [None] * len(keys)
        todo: dict[tuple[str, str, str], list[int]] = {}
        hits = 0
        for i, k in enumerate(keys):
            if k in self._cache:
                out[i] = self._cache[k]
                self._cache.move_to_end(k)
                hits += 1
            else:
                todo.setdefault(k, []).append(i)
        errors: list[str] = []
        if todo:
            with ThreadPoolExecutor(max_workers=max(1, min(self.settings.concurrency, len(todo)))) as pool:
                futures = {k: pool.submit(self._score_one, *k) for k in todo}
            for k, fut in futures.items():
                try:
                    score = fut.result()
                except _JudgeFailure as e:
                    errors.append(str(e))
                    continue
                self._cache[k] = score
                if len(self._cache) > self.settings.cache_size:
                    self._cache.popitem(last=False)
                for i in todo[k]:
                    out[i] = score
        failed = sum(len(todo[k]) for k in todo if k not in self._cache)
        self.failures += failed
        self.cache_hits += hits
        self.scored += len(keys) - failed
        self._last = {"judge/failed": failed / max(len(keys), 1), "judge/cache_hits": hits / max(len(keys), 1)}
        if failed:
            share = failed / len(keys)
            where = f"the judge at {self.url} could not score {failed} of {len(keys)} completions"
            if share > self.settings.max_failed:
                raise UserError(f"{where} (more than grpo.judge_max_failed={self.settings.max_failed:g}); "
                                f"last error: {errors[-1] if errors else '?'}")
            print(f"warning: {where} (no score: left out of its mean, 0 in the total); last error: "
                  f"{errors[-1] if errors else '?'}", file=sys.stderr, flush=True)
        return out

    def batch_metrics(self) -> dict[str, float]:
        """The last batch's ``judge/failed`` and ``judge/cache_hits`` (fractions of its completions)."""
        return dict(self._last)
