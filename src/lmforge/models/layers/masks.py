"""Boolean attention masks: the sliding-window band, and the dense per-document reference mask."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["document_mask", "sliding_window_mask"]


def sliding_window_mask(T: int, window: int, device: torch.device | str | None = None) -> Tensor:
    """Banded causal mask [1, 1, T, T]: i attends j iff i - window < j <= i (Mistral's rule)."""
    i = torch.arange(T, device=device).unsqueeze(1)
    j = torch.arange(T, device=device).unsqueeze(0)
    return ((j <= i) & (j > i - window))[None, None]


def document_mask(document_ids: Tensor) -> Tensor:
    """Block-diagonal causal mask [B, 1, T, T]: i attends j iff j <= i and same document.

    The dense reference for packed attention; the model itself uses ``packed_layout``, whose
    memory grows with the tokens per document instead of T^2.
    """
    T = document_ids.shape[1]
    same = document_ids.unsqueeze(2) == document_ids.unsqueeze(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
    return (same & causal).unsqueeze(1)
