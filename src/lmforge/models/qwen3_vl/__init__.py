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


def _register():  # type: ignore[no-untyped-def]
    from lmforge.models.spec import ModelSpec, register_spec

    return register_spec(ModelSpec(
        name=_hf.MODEL_TYPE, hf_model_type=_hf.MODEL_TYPE, hf_architecture=_hf.ARCHITECTURE,
        args_from_hf=_hf.args_from_hf, hf_config=_hf.hf_config, check_exportable=_hf.check_exportable,
        state_dict_adapter=QWEN3_VL_LAYOUT, build=Qwen3VLModel, fused_decode=False,
        args_class=Qwen3VLArgs, sizes=QWEN3_VL_SIZES, parameter_groups=PARAMETER_GROUPS,
        image_flops=lambda a, grid, n, training: vision_flops(a, grid, training),
    ))


QWEN3_VL = _register()
