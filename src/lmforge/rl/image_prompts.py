"""GRPO prompts with images: a prompt's ids (image tokens expanded) and its pixels, made once per prompt.

A prompt record's messages carry image parts as SFT's records do (:mod:`lmforge.data.image_chat`). Its
tokens are the chat's generation prompt with each image's marker expanded to the tower's token count;
its :class:`PromptImages` go with every completion sampled from it, so the engine samples conditioned
on the picture and every trainer forward over a completion (old, reference, loss) sees the same pixels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from lmforge.data.chat import ChatFormat, validate_messages
from lmforge.data.image_chat import has_images, image_chat
from lmforge.data.image_tokens import ImageEncoding, expand_markers
from lmforge.errors import UserError

__all__ = ["PromptImages", "attach_images", "check_image_prompts", "image_prompt", "is_image_prompt", "stack_images"]


@dataclass
class PromptImages:
    pixel_values: Tensor
    """The prompt's images as the family's image processor returns them."""
    image_grid_thw: Tensor | None
    """Qwen's patch grid per image; None for Gemma 3."""


def is_image_prompt(prompt: Any) -> bool:
    """A message list with at least one list content (image parts)."""
    return isinstance(prompt, list) and has_images([m for m in prompt if isinstance(m, dict)])


def image_prompt(prompt: list[dict[str, Any]], record: dict[str, Any], encoding: ImageEncoding | None,
                 chat: ChatFormat) -> tuple[list[int], PromptImages]:
    """The generation prompt's ids (markers expanded to image tokens) and the prompt's images. One line for
    a text model, a missing or unreadable image, or a template that drops image parts."""
    if encoding is None:
        raise UserError("a GRPO prompt has image parts and the model reads text only (train a vision-language "
                        "model: qwen2_5_vl, qwen3_vl, gemma3)")
    try:
        prepared = image_chat(validate_messages(prompt, images=True), record, None, encoding)
        ids = chat.prompt_ids(prepared.messages)
        ids, _ = expand_markers(ids, [False] * len(ids), encoding, prepared.counts)
    except ValueError as e:  # ImageError, ImageTooLarge, a template's raise_exception
        raise UserError(f"GRPO prompt: {e}") from None
    pixels, grid = encoding.process(prepared.images)
    return ids, PromptImages(pixels, grid)


def stack_images(rows: Sequence[PromptImages | None], device: torch.device) -> dict[str, Tensor]:
    """The images of ``rows`` in row order as the model's keyword arguments (empty when none has any)."""
    present = [r for r in rows if r is not None]
    if not present:
        return {}
    out = {"pixel_values": torch.cat([r.pixel_values for r in present]).to(device)}
    if present[0].image_grid_thw is not None:
        out["image_grid_thw"] = torch.cat([r.image_grid_thw for r in present]).to(device)  # type: ignore[misc]
    return out


def attach_images(batch: Any, rows: Sequence[PromptImages | None]) -> None:
    """Give a :class:`lmforge.objectives.grpo.PolicyBatch` its rows' prompt images, in row order."""
    inputs = stack_images(rows, batch.input_ids.device)
    batch.pixel_values = inputs.get("pixel_values")
    batch.image_grid_thw = inputs.get("image_grid_thw")


def check_image_prompts(model_args: Any, tokenizer: Any, g: Any,
                        prompts: Sequence[dict[str, Any]]) -> ImageEncoding | None:
    """The policy's image encoding when some training prompt has images, None for a text run; one line for
    what does not take image prompts: a text model, an engine that takes no images (vLLM is sent token
    ids only), partial rollouts, environments and router replay (their rounds carry no pixels)."""
    if not any(is_image_prompt(r.get(g.prompt_field)) for r in prompts):
        return None
    from lmforge.data.image_tokens import image_encoding_for

    from lmforge.rl.engines.kinds import engine_kind

    refused = [(not engine_kind(g.engine).takes_images, f"grpo.engine={g.engine}"),
               (bool(g.async_steps and g.partial_rollouts), "grpo.partial_rollouts"),
               (bool(g.environment), "grpo.environment"), (bool(g.router_replay), "grpo.router_replay")]
    for bad, what in refused:
        if bad:
            raise UserError(f"{what} does not take prompts with images: GRPO on image prompts runs lmforge's engine "
                            "(grpo.engine=lmforge) on whole rounds, without environments or router replay")
    encoding = image_encoding_for(model_args, tokenizer)
    if encoding is None:
        raise UserError("a GRPO prompt has image parts and the model reads text only (train a vision-language "
                        "model: qwen2_5_vl, qwen3_vl, gemma3)")
    return encoding
