"""QLoRA (``lora.quantize = "nf4"``): LoRA adapters on a base whose projections are 4-bit NormalFloat.

:func:`quantize_base` replaces every attention and MLP projection of the decoder blocks (``wq wk wv wo
w1 w2 w3``, all of them, adapters or not) with bitsandbytes' ``Linear4bit``: the frozen weight is
stored as 4-bit NF4 codes with one scale per block of 64 values (the scales themselves quantized to
8 bits, "double quantization"), and dequantized block by block in each forward. The embedding, the
output layer and the norms stay in full precision, as in the QLoRA paper. ``peft`` then puts its
bitsandbytes LoRA layer on each quantized projection, and the adapters train in fp32 on top.

Checkpoints hold only the adapters, as with plain LoRA: the base is quantized again from its source
on resume, and NF4 quantization is deterministic, so a resumed run sees the same base.

Export (:func:`merged_linear`) dequantizes each base weight and adds the adapter's update in full
precision: the merged model is the trained one (base as quantized + adapters), not re-quantized.

bitsandbytes runs NF4 on CPU (a reference kernel) and CUDA. Mixtures of experts are refused: their
expert weights are 3-D parameters, not linear layers bitsandbytes can hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmforge.errors import UserError

if TYPE_CHECKING:  # pragma: no cover
    from lmforge.config import LoraSection

QUANT_BLOCK = 64
"""Values per NF4 scale (bitsandbytes' default, the QLoRA paper's)."""


def require_bitsandbytes() -> Any:
    try:
        import bitsandbytes
    except ImportError:
        raise UserError("lora.quantize=nf4 needs the bitsandbytes package: pip install 'lmforge[quant]'") from None
    return bitsandbytes


def check_qlora(lora: "LoraSection", sharded: bool) -> None:
    """Refuse, in one line, what QLoRA cannot do, before anything is built."""
    if lora.quantize == "none":
        return
    if not lora.enabled:
        raise UserError("lora.quantize=nf4 quantizes the frozen base under LoRA adapters: set lora.enabled=true")
    if sharded:
        raise UserError("lora.quantize=nf4 does not support FSDP (parallel.dp_shard > 1): sharding would split "
                        "the 4-bit weights from their scales; use parallel.mode=ddp")
    require_bitsandbytes()


def _projections(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    from lmforge.models.spec import spec_for_args

    out = []
    for block in model.layers:
        for path in spec_for_args(model.args).lora_targets.values():
            parent_name, _, child = path.rpartition(".")
            parent = block.get_submodule(parent_name)
            linear = getattr(parent, child, None)
            if isinstance(linear, nn.Linear):
                out.append((parent, child, linear))
    return out


@torch.no_grad()
def quantize_base(model: nn.Module, device: torch.device) -> nn.Module:
    """Replace the blocks' projections with frozen NF4 ``Linear4bit`` layers on ``device`` (in place)."""
    bnb = require_bitsandbytes()
    from lmforge.models.layers.moe import GroupedExperts

    if any(isinstance(m, GroupedExperts) for m in model.modules()):
        raise UserError("lora.quantize=nf4 does not support mixtures of experts (their expert weights are not "
                        "linear layers); use lora.quantize=none")
    for parent, child, linear in _projections(model):
        q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              compute_dtype=torch.float32, compress_statistics=True, quant_type="nf4")
        # bitsandbytes repacks the weight for its CPU inference kernel on an eval-mode forward without grad
        # (CPUs with AVX512-BF16) and keeps it so; that kernel gives the input no gradient, so a later train
        # step would silently stop every gradient below the layer (and fail on a bias). Keep one layout.
        q.support_avx512bf16_for_cpu = False
        q.weight = bnb.nn.Params4bit(linear.weight.data.float().cpu(), requires_grad=False, quant_type="nf4",
                                     blocksize=QUANT_BLOCK, compress_statistics=True)
        if linear.bias is not None:
            q.bias = nn.Parameter(linear.bias.data.float().clone(), requires_grad=False)
        q._register_state_dict_hook(_drop_quant_constants)
        setattr(parent, child, q.to(device))  # bitsandbytes quantizes as the weight moves to the device
    model.is_loaded_in_4bit = True  # peft reads this to put its bitsandbytes LoRA layers on Linear4bit
    return model


def _drop_quant_constants(module: nn.Module, state_dict: dict[str, Any], prefix: str, _meta: Any) -> None:
    """Leave the NF4 scales and code map out of state dicts (bitsandbytes adds them beside the packed
    weight): the base is frozen and quantized again from its source, so checkpoints hold adapters only."""
    for key in [k for k in state_dict if k.startswith(prefix + "weight.")]:
        del state_dict[key]


def is_4bit(module: nn.Module) -> bool:
    bnb = _bnb_if_loaded()
    return bnb is not None and isinstance(module, bnb.nn.Linear4bit)


def _bnb_if_loaded() -> Any:
    import sys

    return sys.modules.get("bitsandbytes")


def dequantized_weight(linear: nn.Module) -> torch.Tensor:
    """The full-precision weight an NF4 ``Linear4bit`` computes with."""
    import bitsandbytes.functional as F

    w = linear.weight
    return F.dequantize_4bit(w.data, w.quant_state).float()


@torch.no_grad()
def merged_linear(layer: nn.Module) -> nn.Linear:
    """A plain ``nn.Linear``: a peft LoRA layer's dequantized NF4 base plus its adapter's update."""
    base = layer.get_base_layer()
    weight = dequantized_weight(base)
    for adapter in layer.active_adapters:
        weight = weight + layer.get_delta_weight(adapter).float().to(weight.device)
    return _linear(weight, base.bias)


@torch.no_grad()
def dequantize_linears(model: nn.Module) -> nn.Module:
    """Every remaining NF4 ``Linear4bit`` of ``model`` back to a plain ``nn.Linear`` (in place)."""
    for name, module in list(model.named_modules()):
        if is_4bit(module):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, _linear(dequantized_weight(module), module.bias))
    if hasattr(model, "is_loaded_in_4bit"):
        del model.is_loaded_in_4bit
    return model


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device)
    out.weight.copy_(weight)
    if bias is not None:
        out.bias.copy_(bias.float())
    return out
