"""Gemma 3 with images (``model_type`` ``gemma3``: gemma-3-4b and up): the family folder.

- :mod:`.args`: :class:`Gemma3VLArgs` (the Gemma 3 text decoder's ``ModelArgs`` plus the SigLIP tower's);
- :mod:`.vision`: the SigLIP tower and the projector;
- :mod:`.model`: :class:`Gemma3VLModel` (:class:`lmforge.models.vision.model.VisionLanguageModel` with
  scaled text embeddings and bidirectional attention within each image);
- :mod:`.hf_config`: config.json both ways (the text part through the ``gemma3_text`` family);
- :mod:`.flops`: the tower's and projector's FLOPs for a number of images.

LoRA targets the language model's projections; the parameter groups name the tower, the projector
and the language model. Importing this package registers the spec. Pan-and-scan crops (several
crops per image) are images like any other here: the processor's crops arrive as more images.
"""

from __future__ import annotations

from lmforge.models.gemma3 import GEMMA3_LAYOUT
from lmforge.models.gemma3_vl import hf_config as _hf
from lmforge.models.gemma3_vl.args import Gemma3VLArgs
from lmforge.models.gemma3_vl.flops import vision_flops
from lmforge.models.gemma3_vl.model import Gemma3VLModel
from lmforge.models.vision.family import register_vision_family
from lmforge.models.vision.layout import VisionLanguageAdapter

__all__ = ["GEMMA3_VL", "GEMMA3_VL_LAYOUT", "Gemma3VLArgs", "Gemma3VLModel", "PARAMETER_GROUPS", "vision_flops"]

GEMMA3_VL_LAYOUT = VisionLanguageAdapter(
    GEMMA3_LAYOUT.layer_names, GEMMA3_LAYOUT.global_names,
    vision_names={"visual.vision_tower.": "model.vision_tower.",
                  "visual.multi_modal_projector.": "model.multi_modal_projector."},
    read_aliases={"vision_tower.vision_model.": "visual.vision_tower.", "vision_tower.": "visual.vision_tower.",
                  "multi_modal_projector.": "visual.multi_modal_projector."},
    text_aliases={"language_model.model.": "model.", "language_model.lm_head.": "lm_head."},
    ignored=("model.vision_tower.head.", "vision_tower.head.", "vision_tower.vision_model.head."))
"""Gemma 3's text names under ``model.language_model.``; the tower and projector under ``model.`` (SigLIP's
unused pooling head, present when ``vision_use_head`` is on, is dropped on reading)."""

PARAMETER_GROUPS = {
    "vision_tower": ("visual.vision_tower",),
    "projector": ("visual.multi_modal_projector",),
    "language_model": ("tok_embeddings", "layers", "norm", "output"),
}


GEMMA3_VL = register_vision_family(_hf, GEMMA3_VL_LAYOUT, Gemma3VLModel, Gemma3VLArgs, PARAMETER_GROUPS,
                                   lambda a, grid, n, training: vision_flops(a, n, training))
