"""Qwen3-VL (``model_type`` ``qwen3_vl``): the family folder.

- :mod:`.args`: :class:`Qwen3VLArgs` (the language model's ``ModelArgs`` plus the vision tower's and the
  special tokens) and the named size ``qwen3-vl-8b``;
- :mod:`.vision`: the vision tower (resampled position table, the merger and the DeepStack mergers);
- :mod:`.model`: :class:`Qwen3VLModel`, Qwen3's decoder with the tower, interleaved multimodal RoPE and
  DeepStack (:class:`lmforge.models.vision.model.VisionLanguageModel`);
- :mod:`.hf_config`: config.json both ways (the tensor names: :mod:`lmforge.models.vision.layout`);
- :mod:`.flops`: the tower's FLOPs for a batch of images.

LoRA targets the language model's projections; the parameter groups name the tower, the mergers
(projector, DeepStack's included) and the language model. Importing this package registers the spec.
"""

from __future__ import annotations

from lmforge.models.qwen import QWEN3_LAYOUT
from lmforge.models.qwen3_vl import hf_config as _hf
from lmforge.models.qwen3_vl.args import QWEN3_VL_SIZES, Qwen3VLArgs
from lmforge.models.qwen3_vl.flops import vision_flops
from lmforge.models.qwen3_vl.model import Qwen3VLModel
from lmforge.models.vision.family import register_vision_family
from lmforge.models.vision.layout import VisionLanguageAdapter

__all__ = ["PARAMETER_GROUPS", "QWEN3_VL", "QWEN3_VL_LAYOUT", "QWEN3_VL_SIZES", "Qwen3VLArgs", "Qwen3VLModel",
           "vision_flops"]

QWEN3_VL_LAYOUT = VisionLanguageAdapter(QWEN3_LAYOUT.layer_names, QWEN3_LAYOUT.global_names)
"""Qwen3's tensor names under ``model.language_model.``, the tower's under ``model.visual.``."""

PARAMETER_GROUPS = {
    "vision_tower": ("visual.patch_embed", "visual.pos_embed", "visual.blocks"),
    "projector": ("visual.merger", "visual.deepstack_merger_list"),
    "language_model": ("tok_embeddings", "layers", "norm", "output"),
}


QWEN3_VL = register_vision_family(_hf, QWEN3_VL_LAYOUT, Qwen3VLModel, Qwen3VLArgs, PARAMETER_GROUPS,
                                  lambda a, grid, n, training: vision_flops(a, grid, training), sizes=QWEN3_VL_SIZES)
