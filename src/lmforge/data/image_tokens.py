"""How a vision-language model's images become model inputs: the family's own image processor from
transformers (built offline from the model's arguments, no hub) and the image tokens a chat holds.

A chat is rendered with one *marker* per image (the family's placeholder, as its chat template writes
it: Qwen's ``<|vision_start|><|image_pad|><|vision_end|>``, Gemma 3's ``<start_of_image>``; with the byte
tokenizer, which has no such tokens, a private-use character), tokenized, and each marker's ids then
replaced by the image's expansion: as many image tokens as the tower gives that image features, between
the family's start and end tokens. That is what transformers' processors do to the text before
tokenizing, so the ids are the processor's.

The processors: Qwen2.5-VL and Qwen3-VL use Qwen2-VL's (dynamic resolution: each image resized to a
multiple of ``patch * merge`` pixels, pixel rows of ``3 * temporal_patch * patch**2`` and one
``image_grid_thw`` row per image; Qwen3-VL with its mean and std of 0.5); Gemma 3 its own (a fixed
``image_size`` square, ``mm_tokens_per_image`` tokens each).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from lmforge.errors import UserError
from lmforge.models.args import ModelArgs
from lmforge.models.tokenizer import ByteTokenizer, Tokenizer

__all__ = ["BYTE_IMAGE_MARKER", "ImageEncoding", "image_encoding_for", "expand_markers"]

BYTE_IMAGE_MARKER = "\ue000"
"""The image marker of the byte tokenizer (U+E000, private use: no text means it)."""

QWEN_FAMILIES = ("qwen2_5_vl", "qwen3_vl")
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096


@dataclass
class ImageEncoding:
    """A model's images as inputs: ``processor`` (a transformers image processor), the marker a chat carries
    per image and the ids of its expansion."""

    processor: Any
    marker: str
    marker_ids: list[int]
    before: list[int]
    image_token_id: int
    after: list[int]
    has_grid: bool
    """Qwen: the processor returns ``image_grid_thw`` and the token count follows each image's size."""
    tokens_per_image: int = 0
    """Gemma 3's fixed count (``has_grid`` False)."""
    merge: int = 1
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS

    def process(self, images: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``pixel_values`` and (Qwen) ``image_grid_thw`` of ``images``, in order, as the processor returns them."""
        out = self.processor(images=list(images), return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"] if self.has_grid else None

    def token_counts(self, images: Sequence[Any]) -> list[int]:
        """Image tokens of each image (the tower's merged patches), from the sizes the processor resizes the
        images to (its own ``smart_resize``), without computing their pixels."""
        if not self.has_grid:
            return [self.tokens_per_image] * len(images)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        p, size = self.processor, self.processor.size
        factor = p.patch_size * p.merge_size
        out = []
        for image in images:
            width, height = image.size
            h, w = smart_resize(height, width, factor, size["shortest_edge"], size["longest_edge"])
            out.append((h // p.patch_size) * (w // p.patch_size) // self.merge ** 2)
        return out

    def expansion(self, n_tokens: int) -> list[int]:
        return self.before + [self.image_token_id] * n_tokens + self.after


def _token(tokenizer: Tokenizer, text: str, expected: int, key: str) -> None:
    got = tokenizer.token_id(text)
    if got != expected:
        raise UserError(f"the tokenizer's {text!r} is id {got}, the model's {key} is {expected}: "
                        "model.tokenizer does not match the model")


def image_encoding_for(args: ModelArgs, tokenizer: Tokenizer,
                       max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> ImageEncoding | None:
    """The image encoding of a vision-language model's ``args`` with ``tokenizer``; None for a text model."""
    family = getattr(args, "hf_model_type", "")
    byte = isinstance(tokenizer, ByteTokenizer)
    if family in QWEN_FAMILIES:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        a: Any = args
        norm = dict(image_mean=[0.5] * 3, image_std=[0.5] * 3) if family == "qwen3_vl" else {}
        processor = Qwen2VLImageProcessorPil(patch_size=a.patch_size, temporal_patch_size=a.temporal_patch_size,
                                             merge_size=a.spatial_merge_size, **norm)
        start, end = a.vision_start_token_id, a.vision_end_token_id
        if byte:
            marker = BYTE_IMAGE_MARKER
        else:
            marker = "<|vision_start|><|image_pad|><|vision_end|>"
            _token(tokenizer, "<|image_pad|>", a.image_token_id, "image_token_id")
            _token(tokenizer, "<|vision_start|>", start, "vision_start_token_id")
            _token(tokenizer, "<|vision_end|>", end, "vision_end_token_id")
        return ImageEncoding(processor, marker, tokenizer.encode(marker), [start], a.image_token_id, [end],
                             has_grid=True, merge=a.spatial_merge_size, max_pixels=max_pixels)
    if family == "gemma3":
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

        g: Any = args
        processor = Gemma3ImageProcessorPil(size={"height": g.image_size, "width": g.image_size})
        if byte:
            marker, gap = BYTE_IMAGE_MARKER, []
        else:
            marker, gap = "<start_of_image>", tokenizer.encode("\n\n")
            _token(tokenizer, "<start_of_image>", g.boi_token_id, "boi_token_id")
            _token(tokenizer, "<end_of_image>", g.eoi_token_id, "eoi_token_id")
        return ImageEncoding(processor, marker, tokenizer.encode(marker), gap + [g.boi_token_id], g.image_token_id,
                             [g.eoi_token_id] + gap, has_grid=False, tokens_per_image=g.mm_tokens_per_image,
                             max_pixels=max_pixels)
    return None


def expand_markers(ids: list[int], mask: list[bool], encoding: ImageEncoding,
                   counts: Sequence[int]) -> tuple[list[int], list[bool]]:
    """``ids`` with the ``i``-th marker replaced by the expansion of ``counts[i]`` image tokens (no loss on
    them). ValueError when the chat holds another number of markers than images (a template that drops or
    repeats image parts)."""
    m = encoding.marker_ids
    out_ids: list[int] = []
    out_mask: list[bool] = []
    t, k = 0, 0
    while t < len(ids):
        if ids[t: t + len(m)] == m:
            if k >= len(counts):
                raise ValueError(f"the chat holds more image markers than its {len(counts)} image(s)")
            piece = encoding.expansion(counts[k])
            out_ids += piece
            out_mask += [False] * len(piece)
            t, k = t + len(m), k + 1
            continue
        out_ids.append(ids[t])
        out_mask.append(mask[t])
        t += 1
    if k != len(counts):
        raise ValueError(f"the rendered chat holds {k} image marker(s) for {len(counts)} image(s): the chat "
                         "template drops image parts")
    return out_ids, out_mask
