"""The frozen reference model of DPO, GRPO's KL term and every method that scores against the start.

The reference is the run's starting model, frozen. A model with LoRA adapters needs no copy: its
reference is the same model with the adapters switched off (:class:`~lmforge.models.lora.BaseModelView`).
Any other model gets its starting weights loaded afresh from the run's :class:`ModelSource`.

Checkpoints record the reference's source, so a resumed run scores against the same reference even
if the configured start changed since (the recorded one wins, and says so in one event).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lmforge.models.load import ModelSource, load_model
from lmforge.models.lora import BaseModelView, has_adapters
from lmforge.training.runtime import Runtime


class FrozenReference:
    def __init__(self, rt: Runtime, source: ModelSource | None = None) -> None:
        self.rt = rt
        self.source = source or rt.model_source
        self.frozen = self._load(self.source)

    def _load(self, source: ModelSource) -> nn.Module | None:
        rt = self.rt
        if has_adapters(rt.raw_model):
            return None
        ref = load_model(source, args=rt.model_args, tokenizer=rt.model_description["tokenizer"]).model
        return ref.to(rt.dist.device).eval().requires_grad_(False)

    def model_for(self, policy: nn.Module) -> Any:
        """What to call for reference scores: the frozen copy, or ``policy`` with its adapters off."""
        return self.frozen if self.frozen is not None else BaseModelView(policy)

    def state_dict(self) -> dict[str, Any]:
        return {"reference": str(self.source)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Rebuild the reference a checkpoint recorded, if it is not the one configured now."""
        saved = ModelSource.parse(state.get("reference", str(self.source)))
        if saved == self.source:
            return
        self.source = saved
        if self.frozen is not None:
            self.frozen = self._load(saved)
            self.rt.metrics.record_event("reference", 0, f"reference model: {saved} (recorded in the checkpoint)")
