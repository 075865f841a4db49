"""The Qwen2.5-VL model: the shared vision-language model (:class:`~lmforge.models.vision.model.
VisionLanguageModel`: Qwen2's decoder, the tower as ``visual``) with Qwen2.5-VL's tower and its RoPE
sections (contiguous: the first ``mrope_section[0]`` frequencies follow time, then height, then width)."""

from __future__ import annotations

from lmforge.models.qwen2_5_vl.args import Qwen2_5_VLArgs
from lmforge.models.qwen2_5_vl.vision import VisionTransformer
from lmforge.models.vision.model import VisionLanguageModel
from lmforge.models.vision.mrope import mrope_axes

__all__ = ["Qwen2_5_VLModel"]


class Qwen2_5_VLModel(VisionLanguageModel):
    def __init__(self, args: Qwen2_5_VLArgs) -> None:
        super().__init__(args, VisionTransformer(args), mrope_axes(args.mrope_section))
