"""Unpaired preference data for KTO: single responses labelled desirable or undesirable.

A record is either

* unpaired: ``{"prompt": ..., "completion": ..., "label": true|false}`` (prompt and completion both
  strings, or both message lists as in DPO's conversational records), or
* a preference pair ``{"prompt", "chosen", "rejected"}``, read as two examples: the chosen response
  desirable, the rejected one undesirable.

KTO's reference point needs, for each example, the log-ratio of a response to *another* prompt
(an estimate of the policy's KL from the reference). Each example therefore travels with one mismatched
sequence: its own prompt followed by the completion of the next example (in data order, cyclically)
whose prompt differs. The two are laid out as a DPO pair is (:mod:`lmforge.data.preference_data`): the
example as the "chosen" sequence and the mismatched one as the "rejected" sequence of one pair, so the
packing, the per-sequence log-probs and the normalizer over pairs are DPO's. Both carry the example's
label as their ``Example.value`` (1.0 desirable, 0.0 undesirable).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from lmforge.data.chat import ChatFormat, validate_messages
from lmforge.data.overlong import Overlong
from lmforge.data.preference_data import (
    PreferenceDataset,
    PreferenceSummary,
    read_preference_records,
    tokenize_pairs,
)
from lmforge.data.sources import Record, read_records
from lmforge.errors import UserError
from lmforge.models.tokenizer import Tokenizer

__all__ = ["read_unpaired_examples", "build_unpaired_dataset"]

UNPAIRED = ("prompt", "completion", "label")


def _check_unpaired(record: dict[str, Any]) -> None:
    missing = [k for k in UNPAIRED if k not in record]
    if missing:
        raise ValueError(f"missing key {missing[0]!r} (a KTO record has prompt, completion, label; or prompt, "
                         f"chosen, rejected; keys: {', '.join(sorted(record)) or 'none'})")
    if not isinstance(record["label"], bool):
        raise ValueError(f"'label' must be true or false, got {json.dumps(record['label'])}")
    kinds = {type(record["prompt"]), type(record["completion"])}
    if kinds not in ({str}, {list}):
        raise ValueError("prompt and completion must be both strings or both message lists (got "
                         f"{type(record['prompt']).__name__}, {type(record['completion']).__name__})")
    if isinstance(record["prompt"], list):
        validate_messages(record["prompt"])
        try:
            messages = validate_messages(record["completion"])
        except ValueError as e:
            raise ValueError(f"'completion': {e}") from None
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError("'completion' has no assistant message")


def read_unpaired_examples(spec: str) -> tuple[list[tuple[str, Any, Any, bool]], int]:
    """``(where, prompt, completion, desirable)`` for every example of the records in ``spec`` (a pair
    gives two), and the number of records. One ``file:line`` error for the first bad record."""
    rows = read_records(spec)
    if all("chosen" in r for _, r in rows):  # every record a pair: DPO's reader checks them
        return [(w, r["prompt"], r[key], key == "chosen") for w, r in read_preference_records(spec)
                for key in ("chosen", "rejected")], len(rows)
    out = []
    for where, record in rows:
        try:
            if "chosen" in record:
                raise ValueError("a file mixes preference pairs (prompt, chosen, rejected) with unpaired "
                                 "records (prompt, completion, label); give one kind")
            _check_unpaired(record)
        except ValueError as e:
            raise UserError(f"{where}: {e}") from None
        out.append((where, record["prompt"], record["completion"], record["label"]))
    return out, len(rows)


def _partners(prompts: Sequence[str], kinds: Sequence[type]) -> list[int]:
    """For each example, the next example (cyclically) with another prompt and a completion of the same
    kind (text or messages); itself if there is none (then the estimate is of the matched log-ratio,
    said in the summary)."""
    n, out = len(prompts), []
    for i in range(n):
        others = ((i + k) % n for k in range(1, n))
        out.append(next((j for j in others if prompts[j] != prompts[i] and kinds[j] is kinds[i]), i))
    return out


def build_unpaired_dataset(path: str, tokenizer: Tokenizer, chat: ChatFormat | None, seq_len: int,
                           packing: bool, overlong: Overlong = "truncate") -> tuple[PreferenceDataset, PreferenceSummary]:
    """Examples of ``path`` -> (example, mismatched) pairs -> rows; plus the summary to report."""
    examples, records = read_unpaired_examples(path)
    keys = [json.dumps(p, sort_keys=True) for _, p, _, _ in examples]
    partners = _partners(keys, [type(y) for _, _, y, _ in examples])
    pseudo: list[Record] = [(where, {"prompt": p, "chosen": y, "rejected": examples[j][2]})
                            for (where, p, y, _), j in zip(examples, partners)]
    summary = PreferenceSummary(source=path, method="kto", records=records, seq_len=seq_len,
                                unit="examples", overlong=overlong)
    pairs = tokenize_pairs(pseudo, tokenizer, chat, seq_len, summary, values=[float(e[3]) for e in examples],
                           paired=False)
    desirable = sum(1 for p in pairs if p.chosen.value == 1.0)
    summary.note = (f"{desirable} desirable and {len(pairs) - desirable} undesirable examples, each with a "
                    "mismatched completion for the reference point")
    if any(j == i for i, j in enumerate(partners)):
        alone = sum(j == i for i, j in enumerate(partners))
        summary.note += f" ({alone} with no other prompt to borrow from: their own completion stands in)"
    if not pairs:
        raise UserError(summary.line() + ": no examples left to train on")
    dataset = PreferenceDataset(pairs, seq_len, tokenizer.pad_id, packing)
    summary.sequences, summary.fill = len(dataset), dataset.fill
    return dataset, summary
