"""Qwen2.5-VL (``model_type`` ``qwen2_5_vl``): the family folder.

- :mod:`.args`: :class:`Qwen2_5_VLArgs` (the language model's ``ModelArgs`` plus the vision tower's and the
  special tokens) and the named sizes ``qwen2.5-vl-3b``, ``qwen2.5-vl-7b``;
- :mod:`.vision`: the vision tower (window attention, the merger);
- :mod:`.model`: :class:`Qwen2_5_VLModel`, the decoder with the tower and multimodal RoPE
  (:class:`lmforge.models.vision.model.VisionLanguageModel`);
- :mod:`.hf_config`: config.json both ways (the tensor names: :mod:`lmforge.models.vision.layout`);
- :mod:`.flops`: the tower's FLOPs for a batch of images.

What Qwen's vision families share (patch embedding, 2-D RoPE, segment attention, multimodal positions)
is in :mod:`lmforge.models.vision`. LoRA targets the language model's projections (the tower's modules
have other names); the parameter groups name the tower, the merger (projector) and the language model
so a recipe can freeze any of them. Importing this package registers the family's spec.
"""

from __future__ import annotations

from lmforge.models.qwen2_5_vl import hf_config as _hf
from lmforge.models.qwen2_5_vl.args import QWEN2_5_VL_SIZES, Qwen2_5_VLArgs
from lmforge.models.qwen2_5_vl.flops import vision_flops
from lmforge.models.qwen2_5_vl.model import Qwen2_5_VLModel
from lmforge.models.qwen import QWEN2_LAYOUT
from lmforge.models.vision.family import register_vision_family
from lmforge.models.vision.layout import VisionLanguageAdapter

__all__ = ["PARAMETER_GROUPS", "QWEN2_5_VL", "QWEN2_5_VL_LAYOUT", "QWEN2_5_VL_SIZES", "Qwen2_5_VLArgs",
           "Qwen2_5_VLModel", "vision_flops"]

QWEN2_5_VL_LAYOUT = VisionLanguageAdapter(QWEN2_LAYOUT.layer_names, QWEN2_LAYOUT.global_names)
"""Qwen2's tensor names under ``model.language_model.``, the tower's under ``model.visual.``."""

PARAMETER_GROUPS = {
    "vision_tower": ("visual.patch_embed", "visual.blocks"),
    "projector": ("visual.merger",),
    "language_model": ("tok_embeddings", "layers", "norm", "output"),
}


QWEN2_5_VL = register_vision_family(_hf, QWEN2_5_VL_LAYOUT, Qwen2_5_VLModel, Qwen2_5_VLArgs, PARAMETER_GROUPS,
                                    lambda a, grid, n, training: vision_flops(a, grid, training), sizes=QWEN2_5_VL_SIZES)
