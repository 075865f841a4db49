"""LoRA adapters on lmforge's own modules, through ``peft``.

``peft.inject_adapter_in_model`` replaces each targeted ``nn.Linear`` (``wq``, ``wk``, ``wv``, ``wo``,
``w1``, ``w2``, ``w3``) with a ``peft`` LoRA layer that keeps the original as ``base_layer``; the base
weights are frozen, so the optimizer, the gradient sync and the checkpoints hold only the adapters.
The model stays an lmforge ``Transformer`` (no ``PeftModel`` wrapper), so the loop, the data-parallel
wrappers, generation and the chunked loss work on it unchanged.

In a mixture of experts the MLP projections ``w1 w2 w3`` are 3-D parameters of every expert at once
(:class:`~lmforge.models.layers.moe.GroupedExperts`), not linear layers: the same target names put
``peft``'s parameter adapters (``target_parameters``) on them, one low-rank update per expert.

With the adapters switched off (:func:`adapters_disabled`) the model *is* its base: that is the
reference model of GRPO's KL and of DPO, with no second copy of the weights.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from lmforge.errors import UserError

if TYPE_CHECKING:  # pragma: no cover
    from lmforge.config import LoraSection



def require_peft() -> Any:
    try:
        import peft
    except ImportError:
        raise UserError("lora.enabled=true needs the peft package: pip install 'lmforge[lora]'") from None
    return peft


def _tuner_layers(model: nn.Module) -> list[Any]:
    if "peft" not in sys.modules:  # nothing can carry adapters, and importing peft costs seconds
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def has_adapters(model: nn.Module) -> bool:
    """Whether ``model`` (or the module a wrapper holds) carries LoRA adapters."""
    return bool(_tuner_layers(model))


def apply_lora(model: nn.Module, lora: "LoraSection", device: torch.device | None = None) -> nn.Module:
    """Inject adapters into ``model`` in place and freeze everything else; returns ``model``.

    The adapters' B matrices start at zero (peft's default), so the adapted model starts out equal
    to its base. With ``lora.quantize=nf4`` the base's projections are first quantized to 4 bits on
    ``device`` (QLoRA, lmforge.models.qlora).
    """
    peft = require_peft()
    from lmforge.models.layers.moe import GroupedExperts
    from lmforge.models.spec import lora_targets_for

    targets = lora_targets_for(model.args, lora.target_modules)
    # stacked experts carry parameter adapters under the MLP's names (their w1/w2/w3)
    experts = [f"experts.{p.rpartition('.')[2]}" for p in targets.values() if p.startswith("feed_forward.")]
    if not any(isinstance(m, GroupedExperts) for m in model.modules()):
        experts = []
    elif lora.dropout:
        raise UserError("lora.dropout must be 0 for a mixture of experts (peft's expert adapters have no dropout)")
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=list(targets), target_parameters=experts or None, bias="none")
    model.requires_grad_(False)
    if lora.quantize == "nf4":
        from lmforge.models.qlora import quantize_base

        quantize_base(model, device or torch.device("cpu"))
    peft.inject_adapter_in_model(config, model)
    for layer in _tuner_layers(model):  # adapters train, everything else stays frozen
        layer.enable_adapters(True)
    return model


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model: adapters switched off for the block (a no-op for a model without adapters).

    Use under ``torch.no_grad()``: peft drops the adapters' ``requires_grad`` while they are off and
    restores it on exit.
    """
    layers = _tuner_layers(model)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


class BaseModelView:
    """Calls a model with its adapters switched off, without gradients: its frozen base, sharing the
    weights (the KL/DPO reference under LoRA). Call it like the model."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad(), adapters_disabled(self.model):
            return self.model(*args, **kwargs)

    def modules(self) -> Iterator[nn.Module]:
        """The model's modules (the base shares them): where routing replay finds the MoE layers."""
        return self.model.modules()


def merge_adapters(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and put the plain module back (in place); a 4-bit
    base (QLoRA) is dequantized first, so the merged weights are full precision."""
    from peft.tuners.lora.layer import ParamWrapper
    from peft.tuners.tuners_utils import BaseTunerLayer

    from lmforge.models.qlora import dequantize_linears, is_4bit, merged_linear

    for name, module in list(model.named_modules()):
        if not isinstance(module, BaseTunerLayer) or ".base_layer" in name:
            continue  # wrappers nested in another (one per adapted parameter) are merged with it
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(module, ParamWrapper):
            setattr(parent, child, _merge_parameter_adapters(module))
        elif is_4bit(module.get_base_layer()):
            setattr(parent, child, merged_linear(module))
        else:
            module.merge()
            setattr(parent, child, module.get_base_layer())
    return dequantize_linears(model)


@torch.no_grad()
def _merge_parameter_adapters(outer: nn.Module) -> nn.Module:
    """The module under a chain of ``ParamWrapper`` s (one per adapted parameter, e.g. an MoE's expert
    weights) with every low-rank update added to its parameter and peft's parametrizations removed."""
    from peft.tuners.lora.layer import ParamWrapper

    deltas: dict[str, torch.Tensor] = {}
    wrapper = outer
    while isinstance(wrapper, ParamWrapper):
        (adapter,) = wrapper.active_adapters
        deltas[wrapper.parameter_name] = wrapper.get_delta_weight(adapter)
        wrapper = wrapper.base_layer
    base = wrapper
    for name in list(getattr(base, "parametrizations", {})):
        nn.utils.parametrize.remove_parametrizations(base, name, leave_parametrized=False)
    for name, delta in deltas.items():
        getattr(base, name).add_(delta.to(getattr(base, name).dtype))
    return base


def base_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The frozen base's weights on the CPU under their plain names, adapters left out (not merged): what an
    engine that applies the adapters itself (vLLM's LoRA) starts on."""
    out = {}
    for name, t in model.state_dict().items():
        parts = name.split(".")
        if any(p.startswith("lora_") for p in parts):
            continue
        out[".".join(p for p in parts if p != "base_layer")] = t.detach().cpu()
    return out


def adapter_weights(model: nn.Module) -> dict[str, tuple[Any, Any]]:
    """``{module name: (A [r, in], B [out, r])}`` of every adapted layer, wrapper prefixes removed."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from peft.tuners.lora.layer import ParamWrapper

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, ParamWrapper):
            raise UserError("a PEFT adapter export of expert weights is not supported; export the merged model "
                            "(lmforge export --hf) instead")
        if isinstance(module, BaseTunerLayer):
            (adapter,) = module.active_adapters
            clean = name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
            out[clean] = (module.lora_A[adapter].weight, module.lora_B[adapter].weight)
    return out


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) unique parameter counts (tied weights counted once)."""
    seen: set[int] = set()
    trainable = total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return trainable, total


_FINGERPRINT_SAMPLES = 4096


def base_weights_fingerprint(model: nn.Module) -> str:
    """Identity of a base model's weights (before adapters), stored with a LoRA run's checkpoints.

    Adapters are only meaningful on the weights they were trained on, and a path names a place, not
    weights: a base directory moved elsewhere must be found again, one whose weights were replaced
    must be refused. Per tensor the hash covers its name, shape, the integer sum of all its values'
    fp32 bit patterns (one pass at memory speed; integer addition is exact in any order, so the thread
    count cannot change it, and any real change of a tensor moves it) and up to 4096 evenly spaced
    values. Values are taken in fp32, so a base loaded in another dtype of the same values hashes the same.
    """
    import hashlib

    h = hashlib.sha256()
    with torch.no_grad():
        for name, t in sorted(model.state_dict().items()):
            flat = t.detach().reshape(-1)
            step = max(1, flat.numel() // _FINGERPRINT_SAMPLES)
            bits = sum(int(flat[i:i + (1 << 22)].float().view(torch.int32).sum(dtype=torch.int64))
                       for i in range(0, flat.numel(), 1 << 22))
            h.update(f"{name}:{tuple(t.shape)}:{bits}".encode())
            h.update(flat[::step].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]
