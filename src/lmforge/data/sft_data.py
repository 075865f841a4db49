"""Supervised fine-tuning data: records to examples with a loss mask, then packed or padded samples.

Records (JSONL lines or parquet rows) of the common formats (``data.format``: messages,
prompt/completion, Alpaca, ShareGPT, text; see :mod:`lmforge.data.record_formats`) are first mapped
to one of three shapes, which are tokenized here:

* ``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": ...}, ...], "tools": [...]}``
  - rendered with the chat format (:mod:`lmforge.data.chat`), ``tools`` (optional) passed to the
  template; loss on assistant turns, end-of-turn token included, and on the tool calls the template
  writes for an assistant's ``tool_calls``; tool results are context;
* ``{"prompt": ..., "completion": ...}`` - plain text ``prompt + completion + EOS`` (no template,
  so ``lmforge generate`` with the same prompt text continues it); loss on completion and EOS;
* ``{"text": ...}`` - plain text plus EOS, loss on every token.

``loss_on="all"`` puts loss on every token of every format.

An example of ``L`` tokens becomes ``L - 1`` (input, label) pairs, shifted *inside* the example, so
no example's first token is ever a target of the one before it. :class:`SFTDataset` then either packs
several examples into one ``seq_len`` sequence with ``document_ids`` (block-diagonal causal
attention) and ``position_ids`` restarting at 0 per example, or gives each example its own padded
sequence. Both give exactly the same per-token losses; packing wastes less compute on padding.

Problems with the data's *shape* (bad JSON, missing fields) stop the run at start with ``file:line``;
examples that merely cannot be trained on as they are (no loss tokens: skipped; longer than a row:
truncated or skipped, ``data.overlong``, see :mod:`lmforge.data.overlong`) are counted and reported in
one summary line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import numpy as np
import torch

from lmforge.data.chat import ChatFormat, validate_messages
from lmforge.data.image_chat import has_images, image_chat, record_directory
from lmforge.data.image_tokens import ImageEncoding, expand_markers
from lmforge.data.images import ImageTooLarge
from lmforge.data.overlong import Overlong, fit_sequence, overlong_phrase
from lmforge.data.packing import IGNORE_INDEX, Sample
from lmforge.data.record_formats import PROMPT_TURNS, check_format, detect_format, to_sft_record
from lmforge.data.sources import Record, read_file_records, record_files
from lmforge.data.tasks import TaskExample
from lmforge.errors import UserError
from lmforge.models.tokenizer import Tokenizer

__all__ = ["Example", "DataSummary", "SFTDataset", "read_sft_records", "task_records", "tokenize_records",
           "prepare_examples", "build_sft_dataset"]

@dataclass
class Example:
    """One tokenized example: inputs and labels already shifted (labels use IGNORE_INDEX)."""

    input_ids: np.ndarray
    labels: np.ndarray
    value: float | None = None
    """A number an objective reads per example, carried into its batch as ``document_values`` (KTO's
    desirability, a reward-model pair's margin); None for plain SFT examples."""
    images: list[Any] | None = None
    """The example's images (RGB PIL), in the order of its image tokens; run through the image processor
    when a sample is built, so memory holds the small decoded images, not their pixel rows."""

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class DataSummary:
    source: str
    records: int = 0
    examples: int = 0
    sequences: int = 0
    seq_len: int = 0
    packing: bool = True
    no_loss_tokens: int = 0
    overlong: Overlong = "truncate"
    too_long: int = 0
    """Examples skipped for being longer than a row (``data.overlong=skip``)."""
    truncated: int = 0
    responses_cut: int = 0
    """Of the truncated, those whose response lost its end (it did not fit even without its prompt)."""
    loss_tokens: int = 0
    images: int = 0
    """Images of the examples kept."""
    image_too_large: int = 0
    """Records skipped for an image over ``sft.max_image_pixels``."""
    fill: float = 0.0
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        mode = f"packed, {100 * self.fill:.1f}% of tokens used" if self.packing else "padded"
        text = (f"sft data {self.source}: {self.records} records -> {self.examples} examples, "
                f"{self.loss_tokens} loss tokens, {self.sequences} sequences of {self.seq_len} ({mode})")
        if self.images:
            text = text.replace(" examples, ", f" examples ({self.images} images), ", 1)
        if self.no_loss_tokens:
            text += f"; skipped {self.no_loss_tokens} without loss tokens"
        if self.image_too_large:
            text += f"; skipped {self.image_too_large} with an image over sft.max_image_pixels"
        overlong = overlong_phrase(self.too_long + self.truncated, self.records, "records",
                                   f"{self.seq_len + 1} tokens", self.overlong,
                                   self.responses_cut)
        return text + (f"; {overlong}" if overlong else "")

    def counts(self) -> dict[str, int]:
        return {"records": self.records, "examples": self.examples, "sequences": self.sequences,
                "skipped_no_loss_tokens": self.no_loss_tokens, "skipped_too_long": self.too_long,
                "truncated": self.truncated, "responses_cut": self.responses_cut, "loss_tokens": self.loss_tokens,
                "images": self.images, "skipped_image_too_large": self.image_too_large}


# ---------------------------------------------------------------------------------------- reading
def read_sft_records(spec: str | Path, fmt: str = "auto") -> list[Record]:
    """Every record of a ``.jsonl``/``.parquet`` file (or of such files in a directory) as an SFT
    record (see :mod:`lmforge.data.record_formats`), with its location.

    ``fmt="auto"`` detects each record's format from its keys, its file's first record settling
    records whose keys fit several formats.
    """
    check_format(fmt)
    out: list[Record] = []
    for f in record_files(spec):
        file_fmt: str | None = None
        for where, record in read_file_records(f):
            try:
                record_fmt = fmt if fmt != "auto" else detect_format(record, prefer=file_fmt)
                file_fmt = file_fmt or record_fmt
                out.append((where, to_sft_record(record, record_fmt)))
            except ValueError as e:
                raise UserError(f"{where}: {e}") from None
    if not out:
        raise UserError(f"no records in {spec}")
    return out


def task_records(examples: Sequence[TaskExample], split: str = "train") -> list[Record]:
    """Embedded task examples as one-turn conversations."""
    return [(f"embedded-tasks-{split}:{i}", {"messages": [{"role": "user", "content": ex.prompt},
                                                            {"role": "assistant", "content": ex.answer}]})
            for i, ex in enumerate(examples)]


# ---------------------------------------------------------------------------------------- tokenizing
Tokenized = tuple  # (ids, loss mask) or, with images, (ids, loss mask, images)


def _tokenize(record: dict[str, Any], tokenizer: Tokenizer, chat: ChatFormat | None,
              loss_on: str, images: ImageEncoding | None = None, base: Path | None = None) -> Tokenized:
    """Token ids and a per-token "carries loss" mask (before shifting), and a chat's images if it has any."""
    pictures: list[Any] = []
    if "messages" in record:
        if chat is None:
            raise ValueError(f"conversational records need a chat template and {tokenizer!r} has none "
                             "(give one with sft.chat_template=FILE.jinja)")
        messages = validate_messages(record["messages"], images=True)
        counts: list[int] = []
        if has_images(messages):
            prepared = image_chat(messages, record, base, images)
            messages, pictures, counts = prepared.messages, prepared.images, prepared.counts
        tools = record.get("tools")
        enc = chat.encode(messages, tools)
        ids, mask = enc.ids, enc.assistant_mask
        prompt_turns = record.get(PROMPT_TURNS, 0)
        if prompt_turns:  # conversational prompt/completion: assistant turns of the prompt are context
            prompt = chat.prompt_ids(messages[:prompt_turns], tools)
            if ids[:len(prompt)] != prompt:
                raise ValueError("the chat template renders the prompt differently on its own and before the "
                                 "completion, so the completion cannot be located; use the messages format")
            mask = [False] * len(prompt) + mask[len(prompt):]
        if pictures:
            assert images is not None
            ids, mask = expand_markers(ids, mask, images, counts)
    elif "prompt" in record or "completion" in record:
        prompt, completion = record.get("prompt"), record.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ValueError("'prompt' and 'completion' must both be strings")
        p = tokenizer.encode(prompt)
        c = tokenizer.encode(completion, add_eos=True)
        ids, mask = p + c, [False] * len(p) + [True] * len(c)
    elif "text" in record:
        if not isinstance(record["text"], str):
            raise ValueError("'text' must be a string")
        ids = tokenizer.encode(record["text"], add_eos=True)
        mask = [True] * len(ids)
    else:
        raise ValueError(f"record has none of 'messages', 'prompt'/'completion', 'text' "
                         f"(keys: {', '.join(sorted(record)) or 'none'})")
    if loss_on == "all":
        image_token = images.image_token_id if images is not None else None
        mask = [t != image_token for t in ids]
    return (ids, mask, pictures) if pictures else (ids, mask)


def tokenize_records(records: Sequence[Record], tokenizer: Tokenizer, chat: ChatFormat | None,
                     loss_on: Literal["assistant", "all"] = "assistant", images: ImageEncoding | None = None,
                     summary: DataSummary | None = None) -> list[Tokenized]:
    """Each record's (ids, mask), plus its images for a chat with image parts (``images``: the model's
    image encoding, None for a text model). A problem is one line naming the record; an image over the
    size limit skips its record, counted in ``summary`` (an error without one)."""
    out = []
    for where, record in records:
        try:
            out.append(_tokenize(record, tokenizer, chat, loss_on, images, record_directory(where)))
        except ImageTooLarge as e:
            if summary is None:
                raise UserError(f"{where}: {e}") from None
            summary.image_too_large += 1
        except ValueError as e:
            raise UserError(f"{where}: {e}") from None
    return out


def prepare_examples(tokenized: Sequence[Tokenized], seq_len: int,
                     overlong: Overlong, summary: DataSummary) -> list[Example]:
    """Shift each example into (inputs, labels); skip or truncate (:func:`lmforge.data.overlong.fit_sequence`)
    those longer than ``seq_len + 1`` tokens (``seq_len`` after the shift). One with images is skipped,
    never truncated: a cut could split an image's tokens from its pixels."""
    examples: list[Example] = []
    for ids, mask, *rest in tokenized:
        pictures = rest[0] if rest else None
        if len(ids) - 1 > seq_len:
            if overlong == "skip" or pictures:
                summary.too_long += 1
                continue
            (ids, mask), response_cut = fit_sequence((ids, mask), seq_len + 1)
            summary.truncated += 1
            summary.responses_cut += response_cut
        targets = np.asarray(ids[1:], dtype=np.int64)
        carries = np.asarray(mask[1:], dtype=bool)
        if len(ids) < 2 or not carries.any():
            summary.no_loss_tokens += 1
            continue
        labels = np.where(carries, targets, IGNORE_INDEX)
        examples.append(Example(np.asarray(ids[:-1], dtype=np.int64), labels, images=pictures))
        summary.loss_tokens += int(carries.sum())
        summary.images += len(pictures or [])
    summary.examples = len(examples)
    return examples


# ---------------------------------------------------------------------------------------- samples
class SFTDataset:
    """Fixed-length samples built from examples, packed (default) or one example per sample.

    Packing is next-fit in data order: examples fill a sequence until the next does not fit. The
    tail is padding with its own document id, so padding attends only to padding and never changes
    a real token's output.
    """

    def __init__(self, examples: Sequence[Example], seq_len: int, pad_id: int, packing: bool = True,
                 images: ImageEncoding | None = None) -> None:
        if not examples:
            raise UserError("no SFT examples left to train on (see the data summary above)")
        self.examples = list(examples)
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.packing = packing
        self.images = images
        self.bins: list[list[int]] = []
        if packing:
            used = seq_len + 1  # forces a new bin for the first example
            for i, ex in enumerate(self.examples):
                if used + len(ex) > seq_len:
                    self.bins.append([])
                    used = 0
                self.bins[-1].append(i)
                used += len(ex)
        else:
            self.bins = [[i] for i in range(len(self.examples))]

    @property
    def fill(self) -> float:
        """Fraction of sample positions holding real tokens."""
        return sum(len(e) for e in self.examples) / max(len(self.bins) * self.seq_len, 1)

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, i: int) -> Sample:
        sample = self._tokens(i)
        pictures = [p for j in self.bins[i] for p in (self.examples[j].images or [])]
        if pictures:  # the images travel with their documents' tokens, in the same order
            assert self.images is not None, "examples with images need the model's image encoding"
            sample.pixel_values, sample.image_grid_thw = self.images.process(pictures)
        return sample

    def _tokens(self, i: int) -> Sample:
        T = self.seq_len
        inputs = np.full(T, self.pad_id, dtype=np.int64)
        labels = np.full(T, IGNORE_INDEX, dtype=np.int64)
        if not self.packing:
            ex = self.examples[self.bins[i][0]]
            inputs[: len(ex)] = ex.input_ids
            labels[: len(ex)] = ex.labels
            return Sample(torch.from_numpy(inputs), torch.from_numpy(labels), document_lengths=[len(ex)],
                          document_values=None if ex.value is None else [ex.value])
        positions = np.zeros(T, dtype=np.int64)
        documents = np.full(T, len(self.bins[i]), dtype=np.int64)
        at = 0
        for doc, j in enumerate(self.bins[i]):
            ex = self.examples[j]
            n = len(ex)
            inputs[at: at + n] = ex.input_ids
            labels[at: at + n] = ex.labels
            positions[at: at + n] = np.arange(n)
            documents[at: at + n] = doc
            at += n
        positions[at:] = np.arange(T - at)
        values = [self.examples[j].value for j in self.bins[i]]
        return Sample(torch.from_numpy(inputs), torch.from_numpy(labels), torch.from_numpy(positions),
                      torch.from_numpy(documents), [len(self.examples[j]) for j in self.bins[i]],
                      None if values[0] is None else values)


def build_sft_dataset(records: Sequence[Record], source: str, tokenizer: Tokenizer, chat: ChatFormat | None, *,
                      seq_len: int, loss_on: Literal["assistant", "all"] = "assistant",
                      overlong: Overlong = "truncate", packing: bool = True,
                      images: ImageEncoding | None = None) -> tuple[SFTDataset, DataSummary]:
    """Records -> tokenized, masked, filtered examples -> samples; plus the summary to report. ``images``:
    the model's image encoding (:func:`lmforge.data.image_tokens.image_encoding_for`) when it reads images."""
    summary = DataSummary(source=source, records=len(records), seq_len=seq_len, packing=packing, overlong=overlong)
    tokenized = tokenize_records(records, tokenizer, chat, loss_on, images, summary)
    examples = prepare_examples(tokenized, seq_len, overlong, summary)
    if not examples:
        raise UserError(summary.line() + ": no examples left to train on")
    dataset = SFTDataset(examples, seq_len, tokenizer.pad_id, packing, images)
    summary.sequences = len(dataset)
    summary.fill = dataset.fill
    return dataset, summary
