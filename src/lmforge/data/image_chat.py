"""A chat with image parts, made ready for its template: each image read, its token count known from the
image processor, and each image part replaced by the model's marker (:mod:`lmforge.data.image_tokens`),
so the template renders text only and the markers are expanded to image tokens after tokenizing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from lmforge.data.image_tokens import ImageEncoding
from lmforge.data.images import IMAGES_KEY, image_sources, is_image_part, load_image

__all__ = ["ImageChat", "has_images", "image_chat", "record_directory"]


@dataclass
class ImageChat:
    messages: list[dict[str, Any]]
    """The messages with string contents, one marker per image."""
    images: list[Any]
    """The RGB PIL images, in order."""
    counts: list[int]
    """Image tokens of each image."""


def has_images(messages: Sequence[dict[str, Any]]) -> bool:
    return any(isinstance(m.get("content"), list) for m in messages)


def record_directory(where: str) -> Path | None:
    """The directory of the file a record came from (``where`` is ``file:line`` or ``file: row N``), against
    which an image's relative path is read."""
    path = where.rsplit(":", 1)[0]
    return Path(path).parent if path and Path(path).exists() else None


def image_chat(messages: Sequence[dict[str, Any]], record: dict[str, Any], base: Path | None,
               encoding: ImageEncoding | None) -> ImageChat:
    """``messages`` (validated, image parts kept) with every image read and replaced by ``encoding``'s marker.
    ValueError without an encoding (a text model); ``ImageError`` / ``ImageTooLarge`` from reading."""
    if encoding is None:
        raise ValueError("the record has image parts and the model reads text only (train a vision-language "
                         "model: qwen2_5_vl, qwen3_vl, gemma3)")
    sources = image_sources(messages, record.get(IMAGES_KEY))
    images = [load_image(s, base, encoding.max_pixels) for s in sources]
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = "".join(encoding.marker if is_image_part(p) else p["text"] for p in content)
        out.append({**m, "content": content})
    return ImageChat(out, images, encoding.token_counts(images))
