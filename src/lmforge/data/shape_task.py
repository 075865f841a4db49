"""The embedded image task (``tasks.names = ["shapes"]``): small pictures of shapes drawn with PIL, each with
one question about its colour, its number of shapes or their kind, answered in one word.

Every picture is a function of its split and index (a seeded ``random.Random``), so the train and test
splits are the same on every machine and need no files or network; a test picture is never a train one
(the test split's seeds are disjoint). A model must read the image to answer: the question alone says
nothing of the answer, which is uniform over its choices. What each answer needs of the model: colour, the
mean of a few patches; kind, a shape's outline; count, how many separate blobs there are.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

__all__ = ["SHAPE_TASK", "COLOURS", "KINDS", "QUESTIONS", "ShapeExample", "shape_example", "shape_examples",
           "shape_records"]

SHAPE_TASK = "shapes"
SIDE = 56
"""Pixels per side: 4x4 patches of 14, 4 image tokens after Qwen's 2x2 merge, one per cell of the picture's
2x2 grid, so each shape sits in the token that sees it."""
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 230), "yellow": (230, 210, 40)}
KINDS = ("circle", "square", "triangle")
COUNTS = (1, 2, 3)
QUESTIONS = {"colour": "colour?", "count": "how many?", "kind": "which shape?"}
SPLIT_SIZES = {"train": 4000, "test": 300}
_SEEDS = {"train": 0, "test": 1_000_003}


@dataclass(frozen=True)
class ShapeExample:
    question: str
    """``colour``, ``count`` or ``kind``: what is asked."""
    answer: str
    colour: str
    kind: str
    count: int
    seed: int

    @property
    def prompt(self) -> str:
        return QUESTIONS[self.question]

    def image(self) -> Any:
        """The picture (RGB PIL), drawn from the seed."""
        return _draw(self.colour, self.kind, self.count, random.Random(self.seed))


def _draw(colour: str, kind: str, count: int, rng: random.Random) -> Any:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIDE, SIDE), (245, 245, 245))
    draw = ImageDraw.Draw(image)
    fill = tuple(max(0, min(255, c + rng.randint(-20, 20))) for c in COLOURS[colour])
    cell = SIDE // 2  # shapes sit in distinct cells of a 2x2 grid, so they never touch
    for k in rng.sample(range(4), count):
        r = rng.randint(9, 12)
        cx = (k % 2) * cell + cell // 2 + rng.randint(-1, 1)
        cy = (k // 2) * cell + cell // 2 + rng.randint(-1, 1)
        box = (cx - r, cy - r, cx + r, cy + r)
        if kind == "circle":
            draw.ellipse(box, fill=fill)
        elif kind == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return image


def shape_example(split: str, index: int) -> ShapeExample:
    """Example ``index`` of ``split`` (``train`` or ``test``)."""
    seed = _SEEDS[split] + index
    rng = random.Random(seed)
    colour, kind, count = rng.choice(list(COLOURS)), rng.choice(KINDS), rng.choice(COUNTS)
    question = rng.choice(list(QUESTIONS))
    answer = {"colour": colour, "kind": kind, "count": str(count)}[question]
    return ShapeExample(question, answer, colour, kind, count, seed)


def shape_examples(split: str, n: int | None = None) -> list[ShapeExample]:
    """The first ``n`` examples of ``split`` (all of it: :data:`SPLIT_SIZES`)."""
    return [shape_example(split, i) for i in range(min(n or SPLIT_SIZES[split], SPLIT_SIZES[split]))]


def shape_records(examples: list[ShapeExample], split: str) -> list[tuple[str, dict[str, Any]]]:
    """The examples as chat records with an image part (the image itself in the part), as SFT reads them."""
    return [(f"embedded-{SHAPE_TASK}-{split}:{i}", {"messages": [
        {"role": "user", "content": [{"type": "image", "image": ex.image()}, {"type": "text", "text": ex.prompt}]},
        {"role": "assistant", "content": ex.answer}]}) for i, ex in enumerate(examples)]
