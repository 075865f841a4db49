"""Fingerprints of what a run trains on, stored in every checkpoint and checked on resume.

A resumed run continues at a sample index; that index only means the same thing if the data, the
sequence length and the tokenizer are the ones the checkpoint was trained on. The fingerprint is a
hash of the dataset's size and of samples spread evenly over it (their token ids and target
labels, and the pixels of their images), so it changes when any of the three changes, costs the same for any corpus size, and
is the same on every rank and at every world size.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, Sequence

from lmforge.data.packing import SampleDataset
from lmforge.errors import UserError

SAMPLES = 32


def dataset_fingerprint(dataset: SampleDataset, samples: int = SAMPLES) -> str:
    """Hash of the dataset's length and of up to ``samples`` evenly spaced samples."""
    h = hashlib.sha256(f"samples={len(dataset)}".encode())
    n = len(dataset)
    for i in sorted({(k * n) // samples for k in range(min(samples, n))}):
        sample = dataset[i]
        h.update(sample.input_ids.numpy().tobytes())
        h.update(sample.labels.numpy().tobytes())
        if sample.pixel_values is not None:  # a vision-language sample: its images are data too
            h.update(sample.pixel_values.numpy().tobytes())
    return h.hexdigest()[:16]


def records_fingerprint(records: Sequence[dict[str, Any]]) -> str:
    """Hash of every record (prompt records are small: all of them are hashed)."""
    h = hashlib.sha256(f"records={len(records)}".encode())
    for r in records:
        h.update(json.dumps(r, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def check_fingerprint(saved: str | None, now: str, policy: str, warn: Callable[[str], None]) -> None:
    """Refuse (``checkpoint.on_data_change=stop``) or warn when the data changed since the checkpoint.

    Checkpoints written before fingerprints existed carry none and are accepted.
    """
    if saved is None or saved == now:
        return
    what = (f"the checkpoint was trained on other data (fingerprint {saved}, now {now}): the data files, "
            f"data.seq_len or the tokenizer changed")
    if policy == "continue":
        warn(f"warning: {what}; continuing at the saved position (checkpoint.on_data_change=continue)")
        return
    raise UserError(f"{what}; resume with the same data, or set checkpoint.on_data_change=continue")
