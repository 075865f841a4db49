"""Sampling from a vision-language model given a prompt with images, one prompt at a time.

Qwen's families decode with the KV cache. The prefill runs the tower and numbers the prompt with its
multimodal positions (an image's tokens share their time position and count rows and columns, so a
prompt of ``P`` tokens ends at a position below ``P - 1``); every later token continues from the
largest of them: position ``P + step + delta`` on all three axes, where ``delta = max position + 1 - P``
is what transformers calls ``rope_deltas``. Continuing text positions (``P + step``) instead would be
the text model's numbering, not the one the model was trained with.

Gemma 3 attends bidirectionally within each image, a mask the KV-cache decode does not take: each step
is a full forward over the prompt, the images and the tokens so far (exact, slower; fine for short
answers).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from lmforge.models.generate import _sample
from lmforge.models.layers.kv_cache import KVCache

__all__ = ["generate_with_images"]


@torch.inference_mode()
def generate_with_images(model: torch.nn.Module, prompt: Sequence[int], pixel_values: Tensor,
                         image_grid_thw: Tensor | None, max_new_tokens: int, stop_ids: Sequence[int] = (),
                         temperature: float = 0.0, top_p: float = 1.0,
                         generator: torch.Generator | None = None) -> list[int]:
    """Up to ``max_new_tokens`` new tokens after ``prompt`` (its image tokens filled by ``pixel_values``,
    and Qwen's ``image_grid_thw``), stopping after any of ``stop_ids`` (included); greedy at temperature 0."""
    device = next(model.parameters()).device
    tokens = torch.tensor([list(prompt)], device=device)
    images = {"pixel_values": pixel_values.to(device)}
    if image_grid_thw is not None:
        images["image_grid_thw"] = image_grid_thw.to(device)
    out: list[int] = []
    was_training = model.training
    model.eval()
    last = lambda h, _w: model.output(h[:, -1])  # noqa: E731 - project the last position only
    try:
        if not model.multimodal_rope:  # Gemma 3: a full forward per token
            for _ in range(max_new_tokens):
                ids = torch.cat([tokens, torch.tensor([out], dtype=tokens.dtype, device=device)], 1)
                nxt = int(_sample(model(ids, head=last, **images), temperature, top_p, generator)[0])
                out.append(nxt)
                if nxt in stop_ids:
                    break
            return out
        P = tokens.shape[1]
        cache = KVCache.for_model(model, 1, P + max_new_tokens)
        positions = model.position_ids(tokens, images.get("image_grid_thw"))
        delta = int(positions.max()) + 1 - P  # transformers' rope_deltas
        logits = model(tokens, position_ids=positions, kv_cache=cache, head=last, **images)
        for step in range(max_new_tokens):
            nxt = int(_sample(logits, temperature, top_p, generator)[0])
            out.append(nxt)
            if nxt in stop_ids or step == max_new_tokens - 1:
                break
            position = torch.full((3, 1, 1), P + step + delta, device=device)
            logits = model(torch.tensor([[nxt]], device=device), position_ids=position, kv_cache=cache, head=last)
        return out
    finally:
        model.train(was_training)
