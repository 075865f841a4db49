"""A vision-language model: lmforge's decoder (:class:`~lmforge.models.model.Transformer`, unchanged for
text) with a vision tower as ``visual`` and a multimodal RoPE table.

A forward with images runs the tower over all of the batch's images at once, puts its features in
place of the image tokens (row by row, in order), numbers the tokens with three positions each
(:func:`~lmforge.models.vision.mrope_position_ids`, documents of a packed row restarting at 0) and runs
the decoder on those embeddings; a tower with DeepStack features (Qwen3-VL) has them added to the first
blocks' outputs at the image tokens. A forward without images is the decoder's own, and its numbers are
those of the text model.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from lmforge.models.args import ModelArgs
from lmforge.models.model import OutputHead, Transformer
from lmforge.models.vision.mrope import MultimodalRotaryEmbedding, mrope_position_ids, scatter_image_features

__all__ = ["VisionLanguageModel"]


class VisionLanguageModel(Transformer):
    """Vision tower (``visual``: pixel rows and ``grid_thw`` -> (features [n_image_tokens, dim], DeepStack
    features, a possibly empty list of the same shape)) + decoder. ``forward`` takes ``pixel_values`` and
    ``image_grid_thw`` as the image processor returns them. The family's args name ``image_token_id`` and
    ``spatial_merge_size``."""

    FIRST_STAGE_MODULES = ("tok_embeddings", "visual")

    def __init__(self, args: ModelArgs, visual: nn.Module, rope_axes: Sequence[int] | None) -> None:
        """``rope_axes``: the frequencies' axes of a multimodal RoPE (:func:`~lmforge.models.vision.mrope_axes`);
        None keeps the decoder's RoPE and one position per token (Gemma 3)."""
        super().__init__(args)
        self.visual = visual
        self.multimodal_rope = rope_axes is not None
        if rope_axes is not None:
            self.ropes["global"] = MultimodalRotaryEmbedding(self.config.ropes["global"], rope_axes)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        super().init_weights(seed)
        if self.visual is None:
            return
        device = next(self.visual.parameters()).device
        if seed is None or device.type == "meta":
            self.visual.init_weights()
            return
        # the towers draw from the global RNG: seeded here (and restored after), so the whole model depends only
        # on ``seed``, as the decoder does (a LoRA run's random base is rebuilt from it at export)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed + 1)
            self.visual.init_weights()

    def embed(self, tokens: Tensor) -> Tensor:
        """The text embeddings the image features are placed among (the family may scale them)."""
        return self.tok_embeddings(tokens)

    def attention_mask(self, tokens: Tensor, document_ids: Tensor | None) -> Callable[[int | None], Tensor] | None:
        """The attention of a batch with images, per sliding window (see ``Transformer.hidden_states``); None:
        the decoder's causal attention (per document)."""
        return None

    def image_features(self, pixel_values: Tensor, image_grid_thw: Tensor | None = None) -> Tensor:
        """The language-model inputs of every image [sum of t * h * w / merge**2, dim], images in order."""
        return self.visual(pixel_values, image_grid_thw)[0]

    def position_ids(self, tokens: Tensor, image_grid_thw: Tensor | None,
                     document_ids: Tensor | None = None) -> Tensor:
        """The multimodal RoPE positions [3, B, T] of ``tokens`` (see :func:`mrope_position_ids`)."""
        return mrope_position_ids(tokens, image_grid_thw, self.args.image_token_id,  # type: ignore[attr-defined]
                                  self.args.spatial_merge_size, document_ids)  # type: ignore[attr-defined]

    def forward(  # type: ignore[override]
        self, tokens: Tensor, position_ids: Tensor | None = None, document_ids: Tensor | None = None,
        kv_cache: Any = None, head: OutputHead | None = None, *, pixel_values: Tensor | None = None,
        image_grid_thw: Tensor | None = None,
    ) -> Any:
        """Logits [B, T, vocab] (or ``head``'s result) as :meth:`Transformer.forward`, with the images of
        ``pixel_values`` / ``image_grid_thw`` at the image tokens. ``position_ids``: [3, B, T] as
        :meth:`position_ids` makes them (computed here when None and there are images), or [B, T] for text."""
        embeds, after_layer, mask = None, None, None
        if pixel_values is not None:
            if image_grid_thw is None and self.multimodal_rope:
                raise ValueError("pixel_values need image_grid_thw (the image processor returns both)")
            image_token = self.args.image_token_id  # type: ignore[attr-defined]
            features, deepstack = self.visual(pixel_values, image_grid_thw)
            embeds = scatter_image_features(self.embed(tokens), tokens, features, image_token)
            if deepstack:
                after_layer = _deepstack(tokens == image_token, deepstack)
            if position_ids is None and self.multimodal_rope:
                position_ids = self.position_ids(tokens, image_grid_thw, document_ids)
            mask = self.attention_mask(tokens, document_ids)
            if mask is not None:  # the documents are in the mask
                document_ids = None
        h = self.hidden_states(tokens, position_ids, document_ids, kv_cache, embeds=embeds, after_layer=after_layer,
                               mask=mask)
        if self.output is None:
            return h
        if head is not None:
            return head(h, self.output.weight)
        return self.output(h)


def _deepstack(mask: Tensor, features: list[Tensor]) -> Callable[[int, Tensor], Tensor]:
    """Block ``i``'s output plus DeepStack feature ``i`` at the image tokens (``mask`` [B, T]), for the first
    ``len(features)`` blocks."""
    def add(i: int, h: Tensor) -> Tensor:
        if i >= len(features):
            return h
        return h.masked_scatter(mask.unsqueeze(-1), h[mask] + features[i].to(h.dtype))
    return add
