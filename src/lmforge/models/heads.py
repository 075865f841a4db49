"""Output heads a recipe adds to the decoder besides its vocabulary layer: ``score``, a reward model's
scalar score per sequence.

The head is an ordinary submodule of the :class:`~lmforge.models.model.Transformer` (``model.score``,
a bias-free ``Linear(dim, 1)`` as Hugging Face's ``*ForSequenceClassification`` has), added before
any data-parallel wrapper, so DDP and FSDP2 treat it as one more parameter of the root module, the
optimizer trains it and DCP checkpoints hold it. A checkpoint's model description names the head
(``"head": "score"``), and loading adds it again before the weights are read.

It is read through the forward's ``head`` hook (:class:`ScoreHead`), inside ``Transformer.forward``,
so a wrapper that acts on forward calls (FSDP2 unsharding the root's parameters) sees an ordinary call.

A reward model never uses the vocabulary output layer. An untied one is frozen: it gets no gradient
(DDP would wait for it forever), holds no optimizer state, and is left out of checkpoints (frozen
parameters are); export drops it. A tied one is the embedding table, which trains as the embedding.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

HEADS = ("score",)


def head_of(model: nn.Module) -> str | None:
    """The extra head ``model`` carries (``"score"``), or None."""
    return "score" if isinstance(getattr(model, "score", None), nn.Linear) else None


def attach_head(model: nn.Module, head: str) -> nn.Linear:
    """Add ``head`` to ``model`` (kept if it has one already, e.g. loaded from a reward model's
    checkpoint), make it trainable and freeze an untied vocabulary layer (see the module doc).

    A new score head starts at zero: every sequence scores 0, so the first step's loss is exactly
    log 2 and a fresh reward model is neutral (as a GRPO reward it adds nothing until trained). A
    zero head still gets a gradient (the chosen minus the rejected hidden state), and from the
    second step the backbone does too; random small weights would only add noise to the start.
    """
    if head not in HEADS:
        raise ValueError(f"unknown model head {head!r}; known: {', '.join(HEADS)}")
    if head_of(model) is None:
        ref = model.tok_embeddings.weight
        model.score = nn.Linear(model.args.dim, 1, bias=False, device=ref.device, dtype=ref.dtype)
        nn.init.zeros_(model.score.weight)
    model.score.requires_grad_(True)
    if not model.args.tie_embeddings:
        model.output.requires_grad_(False)
    return model.score


def score_layer(model: nn.Module) -> nn.Linear:
    """The score head of ``model`` or of the module a wrapper (DDP, torch.compile) holds."""
    while head_of(model) is None:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            raise ValueError("the model has no score head (see lmforge.models.heads.attach_head)")
        model = inner
    return model.score


class ScoreHead:
    """The forward's ``head``: the score of the final-normed hidden state at flat positions
    ``positions`` of ``[B * T]``, as float32 ``[len(positions)]``."""

    def __init__(self, score: nn.Linear, positions: Tensor) -> None:
        self.score, self.positions = score, positions

    def __call__(self, hidden: Tensor, output_weight: Tensor) -> Tensor:
        picked = hidden.flatten(0, 1).index_select(0, self.positions)
        return self.score(picked).squeeze(-1).float()


def last_positions(lengths: list[list[int]], seq_len: int, device: torch.device | str) -> Tensor:
    """Flat ``[B * T]`` positions of the last token of every document, rows in order, from each row's
    real document lengths (documents start at position 0 and follow each other): host data only."""
    out = []
    for row, docs in enumerate(lengths):
        end = row * seq_len
        for n in docs:
            end += n
            out.append(end - 1)
    return torch.tensor(out, dtype=torch.long, device=device)
