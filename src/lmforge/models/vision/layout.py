"""The tensor names of the vision-language families: the language model's are its text family's under
``model.language_model.`` (its head stays ``lm_head``), the vision side's are lmforge's own module names
under the family's prefixes (the towers' modules carry the checkpoints' names): Qwen's ``visual.*`` is
``model.visual.*``; Gemma 3's ``visual.vision_tower.*`` and ``visual.multi_modal_projector.*`` are
``model.vision_tower.*`` and ``model.multi_modal_projector.*``. Checkpoints in the layouts the models were
published and are saved in (Qwen2.5-VL's ``model.layers.*`` and ``visual.*``; Gemma 3's
``language_model.model.*``, ``vision_tower.vision_model.*``) read too; writing gives transformers' in-memory
names, which it loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from torch import Tensor

from lmforge.models.args import ModelArgs
from lmforge.models.state_dict_adapter import StateDictAdapter, strip_wrapper_prefixes

__all__ = ["VisionLanguageAdapter"]

LANGUAGE = "model.language_model."


@dataclass(frozen=True)
class VisionLanguageAdapter(StateDictAdapter):
    """The decoder's renaming (the base class) moved under ``model.language_model.``, plus the vision side's
    parameters renamed by prefix (``vision_names``: lmforge prefix -> Hugging Face prefix)."""

    vision_names: Mapping[str, str] = field(default_factory=lambda: {"visual.": "model.visual."})
    read_aliases: Mapping[str, str] = field(default_factory=lambda: {"visual.": "visual."})
    """More Hugging Face prefixes that read as an lmforge prefix (a published layout)."""
    text_aliases: Mapping[str, str] = field(default_factory=dict)
    """More Hugging Face prefixes of the language model's tensors -> the ``model.`` / ``lm_head.`` names the
    text family reads (Gemma 3's saved ``language_model.model.*``)."""
    ignored: tuple[str, ...] = ()
    """Hugging Face prefixes of tensors the model never uses (dropped on reading: SigLIP's pooling head)."""

    def _lf_vision(self, name: str) -> str | None:
        return next((p for p in self.vision_names if name.startswith(p)), None)

    def to_hf(self, model_state: Mapping[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
        vision, text = {}, {}
        for k, t in model_state.items():
            name = strip_wrapper_prefixes(k)
            prefix = self._lf_vision(name)
            if prefix is None:
                text[k] = t
            else:
                vision[self.vision_names[prefix] + name[len(prefix):]] = t
        out = {(LANGUAGE + k[len("model."):] if k.startswith("model.") else k): t
               for k, t in super().to_hf(text, args).items()}
        return {**out, **vision}

    def from_hf(self, hf_state: Mapping[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
        readers = {**{hf: lf for lf, hf in self.vision_names.items()}, **self.read_aliases}
        order = sorted(readers, key=len, reverse=True)  # the longest prefix first (vision_tower.vision_model.)
        text: dict[str, Tensor] = {}
        vision: dict[str, Tensor] = {}
        for name, t in hf_state.items():
            if name.startswith(self.ignored) if self.ignored else False:
                continue
            prefix = next((p for p in order if name.startswith(p)), None)
            alias = next((p for p in self.text_aliases if name.startswith(p)), None)
            if prefix is not None:
                vision[readers[prefix] + name[len(prefix):]] = t
            elif alias is not None:
                text[self.text_aliases[alias] + name[len(alias):]] = t
            elif name.startswith(LANGUAGE):
                text["model." + name[len(LANGUAGE):]] = t
            else:  # lm_head, or the published layout's model.*
                text[name] = t
        return {**super().from_hf(text, args), **vision}

    def hf_module_name(self, name: str) -> str:
        return LANGUAGE + super().hf_module_name(name)[len("model."):]
