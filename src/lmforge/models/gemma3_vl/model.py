"""Gemma 3's multimodal model: the shared vision-language model (:class:`~lmforge.models.vision.model.
VisionLanguageModel`) with the Gemma 3 text decoder, the SigLIP tower and projector as ``visual``, text
embeddings scaled by sqrt(dim) before the image features take their places (unscaled), one position per
token, and attention that is causal except within each image: a run of image tokens attends to itself
in both directions (and in the sliding layers only within the window, ``q - k < window``), as
transformers builds it from ``token_type_ids``."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from lmforge.models.gemma3_vl.args import Gemma3VLArgs
from lmforge.models.gemma3_vl.vision import Gemma3Vision
from lmforge.models.vision.model import VisionLanguageModel

__all__ = ["Gemma3VLModel", "image_block_mask"]


def image_block_mask(tokens: Tensor, image_token_id: int, window: int | None,
                     document_ids: Tensor | None = None) -> Tensor:
    """[B, 1, T, T] boolean: causal, or both tokens in the same run of image tokens; within ``window``
    (``q - k < window``) for sliding layers; within one document of a packed row."""
    image = tokens == image_token_id
    start = image & ~F.pad(image, (1, 0))[:, :-1]
    block = torch.where(image, torch.cumsum(start.int(), 1) - 1, -1)
    pos = torch.arange(tokens.shape[1], device=tokens.device)
    same_image = (block[:, :, None] == block[:, None, :]) & (block[:, :, None] >= 0)
    mask = (pos[None, :, None] >= pos[None, None, :]) | same_image
    if window is not None:
        mask = mask & (pos[:, None] - pos[None, :] < window)
    if document_ids is not None:
        mask = mask & (document_ids[:, :, None] == document_ids[:, None, :])
    return mask.unsqueeze(1)


class Gemma3VLModel(VisionLanguageModel):
    def __init__(self, args: Gemma3VLArgs) -> None:
        super().__init__(args, Gemma3Vision(args), rope_axes=None)

    def embed(self, tokens: Tensor) -> Tensor:
        """Scaled text embeddings; an image token outside the vocabulary reads row 0 (replaced anyway)."""
        image = self.args.image_token_id  # type: ignore[attr-defined]
        if image >= self.config.vocab_size:
            tokens = tokens.masked_fill(tokens == image, 0)
        h = self.tok_embeddings(tokens)
        return h * torch.tensor(self.config.dim ** 0.5, dtype=h.dtype)

    def attention_mask(self, tokens: Tensor, document_ids: Tensor | None) -> Callable[[int | None], Tensor]:
        image = self.args.image_token_id  # type: ignore[attr-defined]
        return lambda window: image_block_mask(tokens, image, window, document_ids)
