"""The frozen reference model of DPO, GRPO's KL term and every method that scores against the start.

The reference is the run's starting model, frozen. A model with LoRA adapters needs no copy: its
reference is the same model with the adapters switched off (:class:`~lmforge.models.lora.BaseModelView`).
Any other model gets its starting weights loaded afresh from the run's :class:`ModelSource`.

Checkpoints record the reference's source, so a resumed run scores against the same reference even
if the configured start changed since (the recorded one wins, and says so in one event).
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from lmforge.models.load import ModelSource, load_model
from lmforge.models.lora import BaseModelView, has_adapters
from lmforge.runtime import Runtime


class FrozenReference:
    """``frozen``: the reference's own copy, or None to use the policy with its adapters off. ``reload``
    rebuilds a copy from another source (on resume); :meth:`for_run` gives both for a run."""

    def __init__(self, frozen: nn.Module | None, source: ModelSource,
                 reload: Callable[[ModelSource], nn.Module | None] | None = None,
                 record_event: Callable[[str], None] | None = None) -> None:
        self.frozen, self.source = frozen, source
        self.reload, self.record_event = reload, record_event

    @classmethod
    def for_run(cls, rt: Runtime) -> "FrozenReference":
        def load(source: ModelSource) -> nn.Module | None:
            if has_adapters(rt.model.raw):
                return None
            ref = load_model(source, args=rt.model.args, tokenizer=rt.model.description["tokenizer"]).model
            return ref.to(rt.world.dist.device).eval().requires_grad_(False)

        return cls(load(rt.model.source), rt.model.source, load,
                   lambda line: rt.metrics.record_event("reference", 0, line))

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
        if self.frozen is not None and self.reload is not None:
            self.frozen = self.reload(saved)
            if self.record_event:
                self.record_event(f"reference model: {saved} (recorded in the checkpoint)")
