"""Reward-model data: DPO's preference records and row layout, with whole sequences and margins.

Records are DPO's (:mod:`lmforge.data.preference_data`: ``prompt``/``chosen``/``rejected``, plain text
or conversational) plus an optional numeric ``margin`` per record (how much the chosen response
should outscore the rejected one; 0 when absent). Rows are DPO's too (a pair's chosen then rejected
sequence as consecutive documents, several pairs packed per row), except that each sequence is kept
whole: a reward model reads every token and scores the last one (for a chat, the template's own
rendering of prompt + response, its end of turn included; plain text ends in EOS).

Each pair carries its margin as its value (``Example.value``, in batches ``document_values``), so a
margin travels with its pair through the loader, microbatches and ranks.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence


from lmforge.data.chat import ChatFormat
from lmforge.data.overlong import Overlong
from lmforge.data.preference_data import (
    PreferenceDataset,
    PreferenceSummary,
    read_preference_records,
    to_sft_records,
    tokenize_pairs,
)
from lmforge.data.record_formats import prompt_messages
from lmforge.data.sft_data import tokenize_records
from lmforge.data.sources import Record
from lmforge.errors import UserError
from lmforge.models.tokenizer import Tokenizer

__all__ = ["read_reward_records", "build_reward_dataset", "rendered_sequence", "margin_of", "MAX_MARGIN"]


MAX_MARGIN = 1e4
"""Largest ``|margin|`` accepted. A margin is in reward units, which the Bradley-Terry loss compares with
a score difference; far beyond any score a model gives, it only drives the loss to infinity in fp32 (at
about 1e38) or bf16, which would stop the run at its first step, after its files are written."""


def margin_of(record: dict[str, Any]) -> float:
    """The record's ``margin`` (0 when absent); ``ValueError`` unless it is a number within ``MAX_MARGIN``."""
    value = record.get("margin", 0.0)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"'margin' must be a finite number (got {type(value).__name__} {str(value)[:40]!r})")
    try:
        margin = float(value)
    except OverflowError:  # an integer beyond any float
        margin = math.inf
    if not math.isfinite(margin) or abs(margin) > MAX_MARGIN:
        raise ValueError(f"'margin' must be a finite number within +-{MAX_MARGIN:g} (got {str(value)[:40]})")
    return margin


def read_reward_records(spec: str) -> list[Record]:
    """DPO's checked preference records, and every ``margin`` checked: one ``file:line`` error."""
    return read_preference_records(spec, check=margin_of)


def build_reward_dataset(records: Sequence[Record], source: str, tokenizer: Tokenizer, chat: ChatFormat | None, *,
                         seq_len: int, packing: bool = True, overlong: Overlong = "truncate"
                         ) -> tuple[PreferenceDataset, PreferenceSummary]:
    """Records -> whole-sequence pairs, each with its margin as its value -> rows; plus the summary."""
    summary = PreferenceSummary(source=source, method="rm", records=len(records), seq_len=seq_len, overlong=overlong)
    pairs = tokenize_pairs(records, tokenizer, chat, seq_len, summary, values=[margin_of(r) for _, r in records],
                           whole=True)
    if not pairs:
        raise UserError(summary.line() + ": no pairs left to train on")
    dataset = PreferenceDataset(pairs, seq_len, tokenizer.pad_id, packing)
    summary.sequences, summary.fill = len(dataset), dataset.fill
    return dataset, summary


def rendered_sequence(tokenizer: Tokenizer, chat: ChatFormat, prompt: Any, response: str) -> list[int]:
    """The tokens a reward model trained on conversational records reads for ``prompt`` (a user message,
    or a list of chat messages) answered by ``response``: exactly the chosen sequence of the record
    ``{"prompt": prompt, "chosen": [assistant response]}``."""
    record = {"prompt": prompt_messages(prompt), "chosen": [{"role": "assistant", "content": response}],
              "rejected": []}
    ((ids, _),) = tokenize_records([("prompt", to_sft_records(record)[0])], tokenizer, chat, "assistant")
    return list(ids)
