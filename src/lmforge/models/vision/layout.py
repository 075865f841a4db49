"""The tensor names of Qwen's vision-language models: the language model's are its text family's under
``model.language_model.`` (its head stays ``lm_head``), the vision tower's are lmforge's own under
``model.visual.`` (the towers' modules carry the checkpoints' names). Checkpoints in the layout the
models were published in
(``model.layers.*``, ``visual.*``) read too; writing gives transformers' current layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from torch import Tensor

from lmforge.models.args import ModelArgs
from lmforge.models.state_dict_adapter import StateDictAdapter, strip_wrapper_prefixes

__all__ = ["VisionLanguageAdapter"]

LANGUAGE, VISION = "model.language_model.", "model.visual."


@dataclass(frozen=True)
class VisionLanguageAdapter(StateDictAdapter):
    """The decoder's renaming (the base class) moved under ``model.language_model.``, plus the tower's
    parameters (``visual.*``) under ``model.visual.``."""

    def to_hf(self, model_state: Mapping[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
        vision = {k: t for k, t in model_state.items() if strip_wrapper_prefixes(k).startswith("visual.")}
        text = {k: t for k, t in model_state.items() if k not in vision}
        out = {(LANGUAGE + k[len("model."):] if k.startswith("model.") else k): t
               for k, t in super().to_hf(text, args).items()}
        out.update({"model." + strip_wrapper_prefixes(k): t for k, t in vision.items()})
        return out

    def from_hf(self, hf_state: Mapping[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
        text: dict[str, Tensor] = {}
        vision: dict[str, Tensor] = {}
        for name, t in hf_state.items():
            if name.startswith(VISION) or name.startswith("visual."):
                vision["visual." + name.split("visual.", 1)[1]] = t
            elif name.startswith(LANGUAGE):
                text["model." + name[len(LANGUAGE):]] = t
            else:  # lm_head, or the published layout's model.*
                text[name] = t
        return {**super().from_hf(text, args), **vision}

    def hf_module_name(self, name: str) -> str:
        return LANGUAGE + super().hf_module_name(name)[len("model."):]
