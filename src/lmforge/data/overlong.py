"""Examples longer than a row (``data.overlong``): skipped, or truncated the same way in every recipe.

A tokenized sequence is a *prompt* (the tokens before its first loss token) and a *response* (the
rest: the first loss token to the end, later turns of a conversation included). Truncation cuts

1. the prompt from the left (its last tokens, nearest the response, stay), as far as needed to keep
   the response whole, but never below one prompt token, so the response's first token stays a target;
2. only when the response does not fit even then, the response's tail (its first tokens stay).

So the common case, a long context with a short answer, trains on the whole answer and its end-of-turn
token; a cut answer happens only for a response longer than the row, and the data summary counts
those separately. A sequence with no prompt (``{"text": ...}`` records, ``sft.loss_on="all"``) loses
its tail, as before.

A preference pair's two sequences share one row, so they are cut together: both prompts keep the same
number of last tokens (as many as the two whole responses leave room for, at least one); if the
responses still do not fit, they share the room left, each keeping at least half of it unless the
other needs less, and each loses its tail.
"""

from __future__ import annotations

from typing import Literal

Overlong = Literal["skip", "truncate"]
TokenSeq = tuple[list[int], list[bool]]
"""Token ids and the per-token "carries loss" mask (before shifting)."""


def _response_start(mask: list[bool]) -> int:
    return next((i for i, m in enumerate(mask) if m), len(mask))


def _cut(seq: TokenSeq, keep_prompt: int, keep_response: int) -> TokenSeq:
    ids, mask = seq
    p = _response_start(mask)
    lo, hi = p - keep_prompt, p + keep_response
    return ids[lo:hi], mask[lo:hi]


def _parts(seq: TokenSeq) -> tuple[int, int]:
    p = _response_start(seq[1])
    return p, len(seq[0]) - p


def fit_sequence(seq: TokenSeq, limit: int) -> tuple[TokenSeq, bool]:
    """``seq`` cut to at most ``limit`` tokens by the rule above, and whether its response lost its tail."""
    prompt, response = _parts(seq)
    if prompt + response <= limit:
        return seq, False
    keep_p = min(prompt, max(limit - response, 1))
    keep_r = min(response, limit - keep_p)
    return _cut(seq, keep_p, keep_r), keep_r < response


def fit_pair(chosen: TokenSeq, rejected: TokenSeq, limit: int) -> tuple[TokenSeq, TokenSeq, bool]:
    """Both sequences cut so that together they hold at most ``limit`` tokens, and whether a response lost
    its tail."""
    (pc, rc), (pr, rr) = _parts(chosen), _parts(rejected)
    if pc + rc + pr + rr <= limit:
        return chosen, rejected, False
    room = limit - rc - rr  # for the two prompts, with both responses whole
    short, long_ = min(pc, pr), max(pc, pr)
    k = min(long_, room - short) if room >= 2 * short else room // 2  # largest k: min(pc,k) + min(pr,k) <= room
    k = max(k, 1)
    kc, kr = min(pc, k), min(pr, k)
    left = limit - kc - kr
    keep_c = min(rc, max(left // 2, left - rr))
    keep_r = min(rr, left - keep_c)
    return _cut(chosen, kc, keep_c), _cut(rejected, kr, keep_r), keep_c < rc or keep_r < rr


def overlong_phrase(affected: int, total: int, unit: str, limit: str, overlong: Overlong, responses_cut: int) -> str:
    """The summary's account of over-long records: ``314 of 999 records (31.4%) longer than 257 tokens:
    truncated (...)``; empty when there were none."""
    if not affected:
        return ""
    share = f"{100 * affected / max(total, 1):.1f}%"
    text = f"{affected} of {total} {unit} ({share}) longer than {limit}: "
    if overlong == "skip":
        return text + "SKIPPED (data.overlong=skip; truncate keeps them, cut to fit)"
    cut = f"{responses_cut} with the response's end cut too" if responses_cut else "every response kept whole"
    return text + f"TRUNCATED (data.overlong=truncate: prompt cut from the left; {cut})"
