"""What a ``data.train`` / ``data.validation`` value means: one rule for every recipe.

* ``none`` (or empty): no data. Accepted for ``data.validation`` by every recipe (no eval loss; the
  held-out task scores and ``eval.tasks`` still run where configured).
* ``embedded``: the data built into lmforge for the recipe's kind of training (the text corpus for
  next-token pretraining, the add/reverse/sort tasks for SFT and GRPO). As ``data.validation`` it is the
  held-out split of the embedded training data, so it goes with ``data.train = "embedded"``; next to
  other training data it means no validation set, and the run says so once at start-up.
* anything else: a path (a file, a directory of files, a ``datasets`` directory, or a directory
  written by ``lmforge prepare``), read by the recipe's reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, TypeVar

InputKind = Literal["none", "embedded", "path"]
T = TypeVar("T")


@dataclass(frozen=True)
class DataSpec:
    """A data value as the config gives it, and what it means."""

    key: str
    """The config key that named it (``data.train``, ``data.validation``), for messages."""
    value: str
    """As given: for ``path`` inputs, the path."""
    kind: InputKind


def data_spec(key: str, value: str) -> DataSpec:
    kind: InputKind = "none" if value in ("", "none") else "embedded" if value == "embedded" else "path"
    return DataSpec(key, value, kind)


def train_spec(data: Any) -> DataSpec:
    return data_spec("data.train", data.train)


def validation_spec(data: Any) -> tuple[DataSpec, str]:
    """``data.validation`` by the rule above, and a note for the run when ``embedded`` was dropped
    because the training data is not the embedded data (empty otherwise)."""
    spec = data_spec("data.validation", data.validation)
    trains_on_embedded = data.train == "embedded" and not getattr(data, "sources", None)
    if spec.kind == "embedded" and not trains_on_embedded:
        return DataSpec(spec.key, spec.value, "none"), (
            "data.validation=embedded is the embedded training data's held-out split, and data.train is not "
            "embedded: no validation set (name one with data.validation=PATH)")
    return spec, ""


def train_and_validation(data: Any, build: Callable[[DataSpec, str], T],
                         validation_split: str = "validation") -> tuple[T, T | None]:
    """``build(spec, split)`` for ``data.train`` and ``data.validation``; None for a validation value that
    means no data. ``validation_split`` names the held-out split of embedded data (``test`` for tasks)."""
    val, _ = validation_spec(data)
    return build(train_spec(data), "train"), None if val.kind == "none" else build(val, validation_split)
