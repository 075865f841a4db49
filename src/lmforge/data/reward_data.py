"""Reward-model data: DPO's preference records and row layout, with whole sequences and margins.

Records are DPO's (:mod:`lmforge.data.preference_data`: ``prompt``/``chosen``/``rejected``, plain text
or conversational) plus an optional numeric ``margin`` per record (how much the chosen response
should outscore the rejected one; 0 when absent). Rows are DPO's too (a pair's chosen then rejected
sequence as consecutive documents, several pairs packed per row), except that each sequence is kept
whole: a reward model reads every token and scores the last one (for a chat, the template's own
rendering of prompt + response, its end of turn included; plain text ends in EOS).

Each row carries its pairs' margins in :attr:`~lmforge.data.packing.Sample.values`, at the last
token of each pair's chosen sequence, so a margin travels with its pair through the loader,
microbatches and ranks.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import numpy as np
import torch

from lmforge.data.chat import ChatFormat
from lmforge.data.packing import Sample
from lmforge.data.preference_data import (
    PreferenceDataset,
    PreferencePair,
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

__all__ = ["RewardDataset", "read_reward_records", "build_reward_dataset", "rendered_sequence", "margin_of"]


def margin_of(record: dict[str, Any]) -> float:
    """The record's ``margin`` (0 when absent); ``ValueError`` unless it is a finite number."""
    value = record.get("margin", 0.0)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError(f"'margin' must be a finite number (got {type(value).__name__} {str(value)[:40]!r})")
    return float(value)


def read_reward_records(spec: str) -> list[Record]:
    """DPO's checked preference records, and every ``margin`` checked: one ``file:line`` error."""
    rows = read_preference_records(spec)
    for where, record in rows:
        try:
            margin_of(record)
        except ValueError as e:
            raise UserError(f"{where}: {e}") from None
    return rows


class RewardDataset(PreferenceDataset):
    """DPO's rows of whole pairs, each row with its pairs' margins (see the module doc)."""

    def __init__(self, pairs: Sequence[PreferencePair], margins: Sequence[float], seq_len: int, pad_id: int,
                 packing: bool = True) -> None:
        super().__init__(pairs, seq_len, pad_id, packing)
        self.margins = list(margins)

    def __getitem__(self, i: int) -> Sample:
        sample = super().__getitem__(i)
        values = np.zeros(self.seq_len, dtype=np.float32)
        end = 0
        for doc, j in enumerate(self.bins[i]):  # j = 2 * pair (chosen), 2 * pair + 1 (rejected)
            end += len(self.examples[j])
            if doc % 2 == 0:
                values[end - 1] = self.margins[j // 2]
        sample.values = torch.from_numpy(values)
        return sample


def build_reward_dataset(records: Sequence[Record], source: str, tokenizer: Tokenizer, chat: ChatFormat | None, *,
                         seq_len: int, packing: bool = True) -> tuple[RewardDataset, PreferenceSummary]:
    """Records -> whole-sequence pairs and their margins -> rows; plus the summary to report."""
    summary = PreferenceSummary(source=source, trainer="rm", records=len(records), seq_len=seq_len)
    pairs: list[PreferencePair] = []
    margins: list[float] = []
    for where, record in records:  # one at a time: a skipped record's margin leaves with it
        kept = tokenize_pairs([(where, record)], tokenizer, chat, seq_len, summary, whole=True)
        pairs += kept
        margins += [margin_of(record)] * len(kept)
    summary.pairs = len(pairs)
    if not pairs:
        raise UserError(summary.line() + ": no pairs left to train on")
    dataset = RewardDataset(pairs, margins, seq_len, tokenizer.pad_id, packing)
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
