"""Image parts of chat records, read with PIL.

A message's ``content`` may be a list of parts in the layout transformers' processors and TRL read:
``{"type": "text", "text": ...}`` and ``{"type": "image", ...}``, where an image part names its image
by one of

* ``"path"`` (or ``"url"`` as a local path or ``file://`` address): a file, relative paths from the
  directory of the data file;
* ``"image"``: the encoded bytes, a PIL image, a path string, or a ``{"bytes": ..., "path": ...}`` dict
  (what a Hugging Face dataset's ``Image`` column holds);
* nothing: the record's ``images`` column holds the images, taken in order by the parts that name none
  (TRL's layout, ``{"messages": [...], "images": [...]}``).

Images are decoded and checked when the data is read, before the first step, so a missing or corrupt
file is one line naming it and the record (:class:`ImageError`), never a failure mid-run. An image
with more pixels than a run allows is not an error of the data's shape: the caller skips its record and
counts it (:class:`ImageTooLarge`).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Sequence

__all__ = ["IMAGES_KEY", "ImageError", "ImageTooLarge", "is_image_part", "image_sources", "load_image"]

IMAGES_KEY = "images"
"""The record column with the images of the parts that name none."""


class ImageError(ValueError):
    """An image cannot be read (missing, corrupt, not an image): the data is wrong, the run stops at start."""


class ImageTooLarge(ValueError):
    """An image has more pixels than the run allows: its record is skipped and counted."""


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image"


def _part_source(part: dict[str, Any]) -> Any:
    for key in ("image", "path", "url"):
        if part.get(key) is not None:
            return part[key]
    return None


def image_sources(messages: Sequence[dict[str, Any]], column: Any) -> list[Any]:
    """The source of every image part of ``messages``, in order: the part's own (``image``, ``path``,
    ``url``) or the next entry of the record's ``images`` column. ValueError when the counts disagree."""
    parts = [p for m in messages if isinstance(m.get("content"), list) for p in m["content"] if is_image_part(p)]
    listed = [] if column is None else list(column) if isinstance(column, (list, tuple)) else [column]
    sources, k = [], 0
    for part in parts:
        source = _part_source(part)
        if source is None:
            if k >= len(listed):
                raise ValueError(f"an image part names no image and the record's '{IMAGES_KEY}' has only "
                                 f"{len(listed)} (give \"path\" or \"image\" in the part, or one entry per part)")
            source, k = listed[k], k + 1
        sources.append(source)
    if k < len(listed):
        raise ValueError(f"the record's '{IMAGES_KEY}' has {len(listed)} images but only {k} image parts use them")
    return sources


def _local_path(value: str, base: Path | None) -> Path:
    if value.startswith(("http://", "https://")):
        raise ImageError(f"image {value}: web addresses are not fetched (download the file and give its path)")
    path = Path(value.removeprefix("file://")).expanduser()
    return path if path.is_absolute() or base is None else base / path


def load_image(source: Any, base: Path | None, max_pixels: int) -> Any:
    """The RGB PIL image of ``source`` (see the module doc), decoded now. :class:`ImageError` names the file
    when it is missing or not a readable image; :class:`ImageTooLarge` when it has more than ``max_pixels``
    pixels (checked from the header, before decoding)."""
    from PIL import Image

    if isinstance(source, Image.Image):
        image, name = source, "the record's PIL image"
    else:
        if isinstance(source, dict):  # a datasets Image column: bytes, or a path when the bytes are absent
            source = source.get("bytes") or source.get("path")
        if isinstance(source, (bytes, bytearray)):
            stream, name = io.BytesIO(source), f"image bytes ({len(source)} bytes)"
        elif isinstance(source, str):
            path = _local_path(source, base)
            if not path.is_file():
                raise ImageError(f"image {path}: no such file")
            stream, name = path, f"image {path}"
        else:
            raise ImageError(f"image part holds a {type(source).__name__}, not a path, bytes or an image")
        try:
            image = Image.open(stream)
        except Image.DecompressionBombError:
            raise ImageTooLarge(f"{name} is over PIL's decompression-bomb limit") from None
        except (OSError, Image.UnidentifiedImageError) as e:
            raise ImageError(f"{name}: not a readable image ({e.__class__.__name__})") from None
    width, height = image.size
    if width * height > max_pixels:
        raise ImageTooLarge(f"{name} is {width}x{height}, over {max_pixels} pixels")
    try:
        return image.convert("RGB")  # decodes the whole file: a truncated or corrupt one fails here
    except (OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"{name}: corrupt image ({e})") from None
