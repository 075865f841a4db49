"""The Qwen3-VL model: the shared vision-language model (:class:`~lmforge.models.vision.model.
VisionLanguageModel`: Qwen3's decoder, the tower as ``visual``, DeepStack features added to the first
blocks' outputs) with Qwen3-VL's tower and its interleaved RoPE axes."""

from __future__ import annotations

from lmforge.models.qwen3_vl.args import Qwen3VLArgs
from lmforge.models.qwen3_vl.vision import VisionTransformer
from lmforge.models.vision.model import VisionLanguageModel
from lmforge.models.vision.mrope import mrope_axes

__all__ = ["Qwen3VLModel"]


class Qwen3VLModel(VisionLanguageModel):
    def __init__(self, args: Qwen3VLArgs) -> None:
        super().__init__(args, VisionTransformer(args), mrope_axes(args.mrope_section, interleaved=True))
