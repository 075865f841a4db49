"""Training samples, batches, and the packed pretraining dataset.

A :class:`Sample` is one fixed-length sequence with its targets already aligned
(``labels[t]`` is the target for ``input_ids[t]``), so the loss never shifts anything and
every trainer (pretraining, SFT, RL) can share the same model step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch

from lmforge.errors import UserError

__all__ = ["IGNORE_INDEX", "Sample", "Batch", "collate", "SampleDataset", "PackedTokenDataset"]

IGNORE_INDEX = -100  # matches torch.nn.functional.cross_entropy's default ignore_index


def image_inputs(pixel_values: torch.Tensor | None, image_grid_thw: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """A vision-language model's image keyword arguments (Qwen's grids only where there are some); empty
    without images. Every batch type that carries images hands them to the model through here."""
    if pixel_values is None:
        return {}
    return {"pixel_values": pixel_values} | ({} if image_grid_thw is None else {"image_grid_thw": image_grid_thw})


@dataclass
class Sample:
    """One training sequence of length T. ``labels`` uses IGNORE_INDEX where there is no loss.

    ``position_ids``/``document_ids`` are set only when several documents share a sequence and
    must not attend to each other (e.g. packed SFT); ``None`` means plain causal attention.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None
    document_lengths: list[int] | None = None
    """Real (non-padding) tokens of each document in order; ``None``: one document of length T."""
    document_values: list[float] | None = None
    """A number per real document that an objective reads (see ``Example.value``); usually None."""
    pixel_values: torch.Tensor | None = None
    """The images of a vision-language sample, in the order of their image tokens, as the family's image
    processor returns them (Qwen: patch rows [patches, features]; Gemma 3: [images, 3, H, W]); None: text."""
    image_grid_thw: torch.Tensor | None = None
    """Qwen: one (t, h, w) patch grid per image [images, 3], in order; None for Gemma 3 and text."""


@dataclass
class Batch:
    """Samples stacked to ``[B, T]``."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None
    document_lengths: list[list[int]] | None = None
    """Host-side real document lengths per row (see :attr:`Sample.document_lengths`), so FLOPs of
    the real tokens are known without reading the device tensors; ``None``: every row is one
    document of length T."""
    document_values: list[list[float]] | None = None
    """Host-side :attr:`Sample.document_values` per row, or None."""
    pixel_values: torch.Tensor | None = None
    """Every row's images (:attr:`Sample.pixel_values`) concatenated in row order, so the model's features
    fill the batch's image tokens row by row; None: no images."""
    image_grid_thw: torch.Tensor | None = None
    """The rows' :attr:`Sample.image_grid_thw` concatenated in the same order (Qwen), else None."""

    def _map(self, fn) -> "Batch":
        return Batch(
            input_ids=fn(self.input_ids),
            labels=fn(self.labels),
            position_ids=None if self.position_ids is None else fn(self.position_ids),
            document_ids=None if self.document_ids is None else fn(self.document_ids),
            document_lengths=self.document_lengths,
            document_values=self.document_values,
            pixel_values=None if self.pixel_values is None else fn(self.pixel_values),
            image_grid_thw=None if self.image_grid_thw is None else fn(self.image_grid_thw),
        )

    @property
    def image_count(self) -> int:
        """Images in the batch (host data: the grids' rows, or Gemma 3's images)."""
        if self.pixel_values is None:
            return 0
        return len(self.image_grid_thw) if self.image_grid_thw is not None else len(self.pixel_values)

    def image_inputs(self) -> dict[str, torch.Tensor]:
        """The model's image keyword arguments (``pixel_values``, ``image_grid_thw``); empty for text."""
        return image_inputs(self.pixel_values, self.image_grid_thw)

    def real_document_lengths(self) -> list[int]:
        """Lengths of every real document of the batch (all rows), from host data only."""
        if self.document_lengths is None:
            B, T = self.input_ids.shape
            return [T] * B
        return [n for row in self.document_lengths for n in row]

    def real_token_mask(self) -> torch.Tensor | None:
        """[B, T] bool, True at real tokens and False at padding; None when no row is padded.

        The model's attention mask in transformers' sense, for terms that must leave padding out
        (the MoE router losses). Padding is what follows a row's documents (``document_lengths``), so
        a token is real when its position in the row is below the row's real length. The position is
        ``position_ids`` for a row of one document, and the document's start plus ``position_ids``
        for packed rows (padding is the document after the last, its positions counting from the
        real length); that holds on a context-parallel shard too, whose ids are the row's, sharded.
        Built from host lengths and the device ids, with no host sync.
        """
        if self.document_lengths is None:
            return None
        B, T = self.input_ids.shape
        device = self.input_ids.device
        totals = [sum(row) for row in self.document_lengths]
        if self.document_ids is None:
            if self.position_ids is None and all(n >= T for n in totals):
                return None
            positions = self.position_ids if self.position_ids is not None else torch.arange(T, device=device)
            return positions.expand(B, T) < torch.tensor(totals, device=device).unsqueeze(1)
        width = max(len(row) for row in self.document_lengths) + 1
        starts = [[sum(row[:d]) for d in range(len(row))] + [total] * (width - len(row))
                  for row, total in zip(self.document_lengths, totals)]
        start = torch.tensor(starts, device=device).gather(1, self.document_ids.clamp(max=width - 1))
        positions = self.position_ids if self.position_ids is not None else torch.zeros_like(start)
        return start + positions < torch.tensor(totals, device=device).unsqueeze(1)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "Batch":
        """Page-locked copy, so the host-to-GPU copy can overlap with compute."""
        return self._map(lambda t: t.pin_memory())

    @property
    def num_targets(self) -> torch.Tensor:
        """Number of positions that carry loss, kept on-device to avoid a host sync."""
        return (self.labels != IGNORE_INDEX).sum()


def _stack_optional(samples: Sequence[Sample], field: str) -> torch.Tensor | None:
    values = [getattr(s, field) for s in samples]
    present = sum(v is not None for v in values)
    if present == 0:
        return None
    if present != len(values):
        raise ValueError(f"collate: {field} is set on some samples but not on others")
    return torch.stack(values)


def collate(samples: list[Sample]) -> Batch:
    """Stack equal-length samples into a batch."""
    if not samples:
        raise ValueError("collate: no samples")
    return Batch(
        input_ids=torch.stack([s.input_ids for s in samples]),
        labels=torch.stack([s.labels for s in samples]),
        position_ids=_stack_optional(samples, "position_ids"),
        document_ids=_stack_optional(samples, "document_ids"),
        document_lengths=_lengths(samples),
        document_values=_values(samples),
        pixel_values=_concat(samples, "pixel_values"),
        image_grid_thw=_concat(samples, "image_grid_thw"),
    )


def _concat(samples: Sequence[Sample], field: str) -> torch.Tensor | None:
    """The samples' images (or grids) joined in sample order; None when no sample has any."""
    values = [getattr(s, field) for s in samples if getattr(s, field) is not None]
    return torch.cat(values) if values else None


def _lengths(samples: Sequence[Sample]) -> list[list[int]] | None:
    if all(s.document_lengths is None for s in samples):
        return None
    return [list(s.document_lengths) if s.document_lengths is not None else [len(s.input_ids)] for s in samples]


def _values(samples: Sequence[Sample]) -> list[list[float]] | None:
    values = [s.document_values for s in samples]
    if all(v is None for v in values):
        return None
    if any(v is None for v in values):
        raise ValueError("collate: document_values is set on some samples but not on others")
    return [list(v) for v in values]  # type: ignore[arg-type]


class SampleDataset(Protocol):
    """Anything indexable that yields samples; the loader only needs these two methods."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> Sample: ...


def _tokenize_all(documents: Sequence[str], tokenizer) -> list[list[int]]:
    batch = getattr(tokenizer, "encode_batch", None)
    if callable(batch):
        return batch(documents)
    return [tokenizer.encode(d) for d in documents]


def window_sample(i: int, num_samples: int, seq_len: int, read) -> Sample:
    """Sample ``i`` of a token stream cut into ``seq_len`` windows: tokens ``[i*T, i*T+T+1)`` as
    (input, next-token label) pairs; ``read(start, stop)`` gives int64 tokens of the stream."""
    if i < 0:
        i += num_samples
    if not 0 <= i < num_samples:
        raise IndexError(f"sample {i} out of range [0, {num_samples})")
    start = i * seq_len
    window = torch.from_numpy(read(start, start + seq_len + 1))
    return Sample(input_ids=window[:-1], labels=window[1:])


class PackedTokenDataset:
    """Pretraining data: all documents as one token stream, cut into fixed windows.

    Each document is followed by EOS, then everything is concatenated. Sample ``i`` covers
    stream tokens ``[i*T, i*T + T + 1)``: inputs are the first T, labels the last T. Windows
    overlap by one token so that every token in the stream is a target exactly once. The
    trailing tokens that do not fill a window are dropped. No position or document ids:
    attention runs causally across document boundaries, as is standard for pretraining, and
    EOS tells the model where a new document starts.

    The stream is a single int32 numpy array (4 bytes per token, no per-sample objects).
    """

    def __init__(self, documents: list[str], tokenizer, seq_len: int) -> None:
        if seq_len < 1:
            raise UserError(f"seq_len must be at least 1, got {seq_len}")
        if tokenizer.vocab_size > np.iinfo(np.int32).max:
            raise UserError(f"vocab_size {tokenizer.vocab_size} does not fit in int32")
        eos = tokenizer.eos_id
        pieces: list[np.ndarray] = []
        for ids in _tokenize_all(documents, tokenizer):
            pieces.append(np.asarray(ids, dtype=np.int32))
            pieces.append(np.asarray([eos], dtype=np.int32))
        self.tokens: np.ndarray = (
            np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
        )
        self.seq_len = seq_len
        self._num_samples = max(0, (len(self.tokens) - 1) // seq_len)
        if self._num_samples == 0:
            raise UserError(
                f"not enough data: {len(self.tokens)} tokens from {len(documents)} documents, "
                f"need at least seq_len + 1 = {seq_len + 1}"
            )

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def __len__(self) -> int:
        return self._num_samples

    def __getitem__(self, i: int) -> Sample:
        return window_sample(i, self._num_samples, self.seq_len,
                             lambda start, stop: self.tokens[start:stop].astype(np.int64))
