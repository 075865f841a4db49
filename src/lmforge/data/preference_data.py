"""Preference data for DPO: ``prompt``/``chosen``/``rejected`` records to packed pairs of sequences.

A record holds one prompt and two responses, in one of two forms:

* plain text: ``{"prompt": str, "chosen": str, "rejected": str}``; each sequence is
  ``prompt + response + EOS`` without a template, log-probs on the response and EOS (as SFT's
  prompt/completion records);
* conversational: ``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}``; each
  sequence is ``prompt + response`` rendered with the chat template, log-probs on the response's
  assistant turns (their content and end-of-turn token), as SFT's conversational prompt/completion.

Both are tokenized by SFT's own code (:func:`lmforge.data.sft_data.tokenize_records`), so DPO sees the
same tokens and assistant masks as SFT of the same data.

Layout: a pair's two sequences are two consecutive documents of one row (chosen, then rejected), and
several pairs pack into a ``seq_len`` row (next-fit in data order) with ``document_ids`` and
``position_ids`` restarting per sequence, so no sequence attends to another and each gets exactly
the log-probs it would get alone. A pair therefore never straddles two microbatches, and a row's
documents are always ``chosen_0, rejected_0, chosen_1, rejected_1, ..., padding``: that invariant is
all :func:`sequence_index` needs to sum per-token log-probs per sequence. Packing wastes no compute on
padding, unlike padding every sequence to the longest. ``packing=False`` puts one pair in each row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from lmforge.data.chat import ChatFormat, validate_messages
from lmforge.data.image_tokens import ImageEncoding
from lmforge.data.images import IMAGES_KEY
from lmforge.data.overlong import Overlong, fit_pair, overlong_phrase
from lmforge.data.packing import IGNORE_INDEX, Batch
from lmforge.data.record_formats import PROMPT_TURNS
from lmforge.data.sft_data import Example, SFTDataset, tokenize_records
from lmforge.data.sources import Record, read_records
from lmforge.errors import UserError
from lmforge.models.tokenizer import Tokenizer

__all__ = ["PreferencePair", "PreferenceSummary", "PreferenceDataset", "read_preference_records",
           "to_sft_records", "build_preference_dataset", "sequence_index", "pairs_in", "pair_values"]

FIELDS = ("prompt", "chosen", "rejected")


@dataclass
class PreferencePair:
    """A prompt's chosen and rejected sequences, each shifted into (inputs, labels)."""

    chosen: Example
    rejected: Example

    def __len__(self) -> int:
        return len(self.chosen) + len(self.rejected)


@dataclass
class PreferenceSummary:
    source: str
    method: str = "dpo"
    records: int = 0
    pairs: int = 0
    sequences: int = 0
    seq_len: int = 0
    overlong: Overlong = "truncate"
    too_long: int = 0
    """Pairs skipped for not fitting one row (``data.overlong=skip``)."""
    truncated: int = 0
    responses_cut: int = 0
    """Of the truncated pairs, those where a response lost its end."""
    no_loss_tokens: int = 0
    """Pairs skipped for a response with no text or no tokens."""
    identical: int = 0
    """Pairs skipped because chosen and rejected are the same sequence: no preference to learn (the
    loss of such a pair is constant, its gradient zero), only a diluted normalizer and accuracy."""
    loss_tokens: int = 0
    fill: float = 0.0
    note: str = ""
    """Said after the counts (KTO: its desirable and undesirable examples)."""
    unit: str = "pairs"
    """What a pair is to the method (KTO: an example with its mismatched completion)."""

    def line(self) -> str:
        u = self.unit
        text = (f"{self.method} data {self.source}: {self.records} records -> {self.pairs} {u}, {self.loss_tokens} "
                f"response tokens, {self.sequences} rows of {self.seq_len} ({100 * self.fill:.1f}% of tokens used)")
        text += f"; {self.note}" if self.note else ""
        if self.no_loss_tokens:
            text += f"; skipped {self.no_loss_tokens} {u} with an empty response"
        if self.identical:
            text += f"; skipped {self.identical} {u} whose chosen and rejected are identical"
        overlong = overlong_phrase(self.too_long + self.truncated, self.records, u,
                                   f"a row of {self.seq_len} tokens (both sequences)", self.overlong, self.responses_cut)
        return text + (f"; {overlong}" if overlong else "")

    def counts(self) -> dict[str, int]:
        return {"records": self.records, "pairs": self.pairs, "sequences": self.sequences,
                "skipped_too_long": self.too_long, "truncated": self.truncated, "responses_cut": self.responses_cut,
                "skipped_no_loss_tokens": self.no_loss_tokens, "skipped_identical": self.identical,
                "loss_tokens": self.loss_tokens}


# ---------------------------------------------------------------------------------------- reading
def _check(record: dict[str, Any]) -> None:
    """The record's shape; ``ValueError`` with a short reason (the caller adds file:line)."""
    missing = [k for k in FIELDS if k not in record]
    if missing:
        raise ValueError(f"missing key {missing[0]!r} (a preference record has prompt, chosen, rejected; "
                         f"keys: {', '.join(sorted(record)) or 'none'})")
    kinds = {type(record[k]) for k in FIELDS}
    if kinds not in ({str}, {list}):
        got = ", ".join(f"{k}: {type(record[k]).__name__}" for k in FIELDS)
        raise ValueError(f"prompt, chosen and rejected must be all strings or all message lists (got {got})")
    if isinstance(record["prompt"], list):
        validate_messages(record["prompt"], images=True)
        for key in ("chosen", "rejected"):
            try:
                messages = validate_messages(record[key], images=True)
            except ValueError as e:
                raise ValueError(f"{key!r}: {e}") from None
            if not any(m["role"] == "assistant" for m in messages):
                raise ValueError(f"{key!r} has no assistant message")


def read_preference_records(spec: str, check: Callable[[dict[str, Any]], Any] | None = None) -> list[Record]:
    """Every record of a ``.jsonl``/``.parquet`` file or directory (the shared record reader),
    checked (and by ``check``, which raises ``ValueError``): one ``file:line`` error for the first bad record."""
    rows = read_records(spec)
    for where, record in rows:
        try:
            _check(record)
            if check is not None:
                check(record)
        except ValueError as e:
            raise UserError(f"{where}: {e}") from None
    return rows


def to_sft_records(record: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The chosen and rejected sequences as SFT records (prompt/completion, or a conversation whose
    first ``len(prompt)`` messages are context)."""
    p = record["prompt"]
    if isinstance(p, str):
        return tuple({"prompt": p, "completion": record[k]} for k in ("chosen", "rejected"))  # type: ignore[return-value]
    extra = {IMAGES_KEY: record[IMAGES_KEY]} if record.get(IMAGES_KEY) is not None else {}  # the prompt's images
    return tuple({"messages": p + record[k], PROMPT_TURNS: len(p), **extra}  # type: ignore[return-value]
                 for k in ("chosen", "rejected"))


# ---------------------------------------------------------------------------------------- pairs
def _shift(ids: list[int], mask: list[bool]) -> Example | None:
    """(inputs, labels) shifted inside the sequence; None when no target carries a log-prob."""
    carries = np.asarray(mask[1:], dtype=bool)
    if len(ids) < 2 or not carries.any():
        return None
    labels = np.where(carries, np.asarray(ids[1:], dtype=np.int64), IGNORE_INDEX)
    return Example(np.asarray(ids[:-1], dtype=np.int64), labels)


def _whole(ids: list[int], mask: list[bool]) -> Example | None:
    """The whole sequence as input (a reward model reads every token, the last one included), labels
    marking its response tokens; None when the response has no tokens."""
    carries = np.asarray(mask, dtype=bool)
    if not carries.any():
        return None
    tokens = np.asarray(ids, dtype=np.int64)
    return Example(tokens, np.where(carries, tokens, IGNORE_INDEX))


def _empty_response(response: str | list[dict[str, Any]]) -> bool:
    """No text in the response (its assistant messages'): usually a field lost in a conversion."""
    if isinstance(response, str):
        return not response.strip()
    return not any(str(m.get("content") or "").strip() for m in response if m.get("role") == "assistant")


def tokenize_pairs(records: Sequence[Record], tokenizer: Tokenizer, chat: ChatFormat | None, seq_len: int,
                   summary: PreferenceSummary, values: Sequence[float] | None = None,
                   whole: bool = False, paired: bool = True,
                   images: ImageEncoding | None = None) -> list[PreferencePair]:
    """Records to pairs. A pair with a response of no text or no tokens, or whose chosen and rejected
    are the same sequence, is counted and skipped (the data summary line says how many); one whose two
    sequences do not fit one row is truncated together (:func:`lmforge.data.overlong.fit_pair`) or
    skipped, as ``summary.overlong`` says. ``values[k]``: the number both sequences of record ``k``'s
    pair carry into their batch (``Example.value``). ``whole``: keep each sequence whole rather than
    shifted into next-token inputs and labels (reward models). ``paired=False`` (KTO's example with a
    borrowed completion as its "rejected"): only the example's own completion must have text, and the
    two may be the same. ``images``: a vision-language model's image encoding, for prompts with image parts
    (both sequences of a pair carry the prompt's images; a pair with images is skipped, never truncated,
    when it does not fit)."""
    if chat is None and any(isinstance(r.get("prompt"), list) for _, r in records):
        where = next(w for w, r in records if isinstance(r.get("prompt"), list))
        raise UserError(f"{where}: conversational records need a chat template and {tokenizer!r} has none "
                        "(give one with dpo.chat_template=FILE.jinja)")
    pairs = []
    for k, (where, record) in enumerate(records):
        if _empty_response(record["chosen"]) or (paired and _empty_response(record["rejected"])):
            summary.no_loss_tokens += 1  # a lone end-of-turn token is no response to prefer or avoid
            continue
        sequences = [(where, r) for r in to_sft_records(record)]
        (c_ids, c_mask, *c_pics), (r_ids, r_mask, *r_pics) = tokenize_records(sequences, tokenizer, chat,
                                                                                 "assistant", images)
        if paired and c_ids == r_ids and c_mask == r_mask:
            summary.identical += 1
            continue
        example = _whole if whole else _shift
        chosen, rejected = example(c_ids, c_mask), example(r_ids, r_mask)
        if chosen is None or rejected is None:
            summary.no_loss_tokens += 1
            continue
        chosen.images, rejected.images = (c_pics or [None])[0], (r_pics or [None])[0]
        if len(chosen) + len(rejected) > seq_len:
            if summary.overlong == "skip" or c_pics:
                summary.too_long += 1
                continue
            shift = 0 if whole else 2  # a shifted sequence of L tokens is an example of L - 1
            (c_ids, c_mask), (r_ids, r_mask), response_cut = fit_pair((c_ids, c_mask), (r_ids, r_mask), seq_len + shift)
            chosen, rejected = example(c_ids, c_mask), example(r_ids, r_mask)
            summary.truncated += 1
            summary.responses_cut += response_cut
            if chosen is None or rejected is None:  # a row too short for even one response token each
                summary.no_loss_tokens += 1
                continue
        if values is not None:
            chosen.value = rejected.value = float(values[k])
        pair = PreferencePair(chosen, rejected)
        summary.loss_tokens += int((chosen.labels != IGNORE_INDEX).sum() + (rejected.labels != IGNORE_INDEX).sum())
        pairs.append(pair)
    summary.pairs = len(pairs)
    return pairs


class PreferenceDataset(SFTDataset):
    """Rows of whole pairs: SFT's packed rows (documents, restarting positions, padding as its own
    document), with bins that keep each pair's two sequences together and in order."""

    def __init__(self, pairs: Sequence[PreferencePair], seq_len: int, pad_id: int, packing: bool = True,
                 images: ImageEncoding | None = None) -> None:
        if not pairs:
            raise UserError("no preference pairs left to train on (see the data summary above)")
        super().__init__([ex for p in pairs for ex in (p.chosen, p.rejected)], seq_len, pad_id, packing=True,
                         images=images)
        self.packing_pairs = packing
        self.bins = []
        used = seq_len + 1  # forces a new row for the first pair
        for j, pair in enumerate(pairs):
            if not packing or used + len(pair) > seq_len:
                self.bins.append([])
                used = 0
            self.bins[-1] += [2 * j, 2 * j + 1]
            used += len(pair)


def build_preference_dataset(records: Sequence[Record], source: str, tokenizer: Tokenizer, chat: ChatFormat | None,
                             *, seq_len: int, packing: bool = True, overlong: Overlong = "truncate",
                             images: ImageEncoding | None = None) -> tuple[PreferenceDataset, PreferenceSummary]:
    """Records -> tokenized pairs -> rows; plus the summary to report. ``images``: a vision-language model's
    image encoding (prompts with image parts)."""
    summary = PreferenceSummary(source=source, records=len(records), seq_len=seq_len, overlong=overlong)
    pairs = tokenize_pairs(records, tokenizer, chat, seq_len, summary, images=images)
    if not pairs:
        raise UserError(summary.line() + ": no pairs left to train on")
    dataset = PreferenceDataset(pairs, seq_len, tokenizer.pad_id, packing, images)
    summary.sequences, summary.fill = len(dataset), dataset.fill
    return dataset, summary


# ---------------------------------------------------------------------------------------- batches
def pairs_in(batch: Batch) -> int:
    """Pairs in a batch of :class:`PreferenceDataset` rows (host data only: no device sync)."""
    assert batch.document_lengths is not None, "preference rows always carry their document lengths"
    return sum(len(row) for row in batch.document_lengths) // 2


def pair_values(batch: Batch, device: torch.device) -> torch.Tensor | None:
    """Each pair's ``Example.value`` (its chosen sequence's document value), ``[pairs]`` float32 on
    ``device``, in the order of :func:`sequence_index`; None when the rows carry no values. From host
    data: a copy to the device, no sync."""
    if batch.document_values is None:
        return None
    return torch.tensor([v for row in batch.document_values for v in row[0::2]], dtype=torch.float32, device=device)


def sequence_index(batch: Batch, positions: torch.Tensor) -> torch.Tensor:
    """For flat positions of ``[B * T]`` (target tokens), the index of the sequence each belongs to,
    counted over the whole batch: ``2j`` is pair j's chosen sequence, ``2j + 1`` its rejected one.

    Row b's documents are its pairs' sequences in order, so the index is the document id plus the
    number of sequences in the rows before it. Padding's document id would overlap the next row's
    first sequence, but padding has no targets and is never among ``positions``.
    """
    assert batch.document_ids is not None and batch.document_lengths is not None
    per_row = [len(row) for row in batch.document_lengths]
    before = torch.tensor(np.cumsum([0] + per_row[:-1]), dtype=torch.long, device=positions.device)
    T = batch.input_ids.shape[1]
    return batch.document_ids.flatten().index_select(0, positions) + before[positions // T]
