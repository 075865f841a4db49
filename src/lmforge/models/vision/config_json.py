"""What the config.json files of Qwen's vision-language families share: the multimodal RoPE settings
(``rope_parameters`` now, ``rope_scaling`` ``{"type": "mrope", ...}`` in older files) and the special
token ids."""

from __future__ import annotations

from typing import Any, Mapping

from lmforge.errors import UserError

__all__ = ["TOKEN_IDS", "mrope_settings", "token_ids"]

TOKEN_IDS = {"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
             "vision_end_token_id": 151653}
"""The special tokens' config.json keys and transformers' defaults (the same for every Qwen-VL)."""


def mrope_settings(text: Mapping[str, Any], where: str, family: str, default_theta: float,
                   default_sections: list[int]) -> tuple[float, list[int]]:
    """(rope_theta, mrope_section) of a language model's config section; one line for any scaling."""
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise UserError(f"{where}: rope type {kind!r} is not supported for {family} (only mrope)")
    theta = float(rope.get("rope_theta", text.get("rope_theta", default_theta)))
    return theta, [int(n) for n in rope.get("mrope_section", default_sections)]


def token_ids(cfg: Mapping[str, Any]) -> dict[str, int]:
    """The special token ids of a config.json (transformers' defaults for missing ones)."""
    return {k: int(cfg.get(k, v)) for k, v in TOKEN_IDS.items()}
