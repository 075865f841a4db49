"""The optimizer of a run (``optimizer.name``): AdamW, 8-bit AdamW, or Muon with AdamW beside it.

* ``adamw``: :func:`lmforge.training.train_step.build_optimizer`, unchanged.
* ``adamw8bit``: bitsandbytes' ``AdamW8bit``: both moments stored as 8-bit codes with one fp32 scale
  per block of 256 values (block-wise dynamic quantization), about a quarter of AdamW's state; tensors
  under 4096 values (norm weights) keep fp32 moments, as bitsandbytes does by default. It runs on CPU
  and CUDA, and its state is plain tensors (uint8 codes, fp32 scales and code maps), so DCP saves and
  reshards it like AdamW's.
* ``muon``: ``torch.optim.Muon`` on the hidden matrices (:func:`muon_parameters`) and AdamW on the rest,
  presented to the loop and to DCP as one optimizer (:class:`OptimizerGroup`).

Why Muon gets only the 2-D projections of the decoder blocks: Muon orthogonalizes a matrix's update
(Newton-Schulz), which fits a linear map from hidden states to hidden states. The embedding is a
lookup table (each row is updated only by its own token), the output layer maps onto the vocabulary
(its rows are classes), and the MoE router is a small classifier of the same kind; norms and biases
are vectors. Muon's authors train all of those with AdamW, and so does this module.

MoE expert weights ``[E, out, in]`` stay on AdamW: ``torch.optim.Muon`` takes 2-D parameters only, and
an expert's slice cannot be handed to it as its own parameter (one tensor holds every expert, and the
grouped kernel needs it so). Newton-Schulz per expert would mean a second Muon implementation here.

Learning rate: the Muon parameters use ``adjust_lr_fn="match_rms_adamw"`` (0.2 * sqrt(max(A, B))),
which scales each orthogonalized update to the RMS an AdamW update has, so one ``optimizer.lr`` and one
schedule serve both optimizers (``optimizer.muon_lr_ratio`` scales Muon's share when wanted). Weight
decay is decoupled in both, applied as ``lr * weight_decay``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch
from torch import nn

from lmforge.errors import UserError
from lmforge.optim.adamw import adamw_kernel, build_optimizer

if TYPE_CHECKING:  # pragma: no cover
    from lmforge.config import OptimizerSection



def require_bitsandbytes(key: str) -> Any:
    """Import bitsandbytes, or one line naming the install."""
    try:
        import bitsandbytes
    except ImportError:
        raise UserError(f"{key} needs the bitsandbytes package: pip install 'lmforge[quant]'") from None
    return bitsandbytes


class OptimizerGroup:
    """Several optimizers over disjoint parameters that the loop drives as one.

    ``param_groups`` lists every group of every optimizer (the loop sets each group's lr from the
    schedule, times the group's ``lr_scale``); ``step`` and ``zero_grad`` call each in turn. Checkpoints
    hand :attr:`optimizers` to DCP (``get_state_dict``/``set_state_dict`` take a list), which keys
    each state by parameter name, so the parts merge into one state dict and reshard like one optimizer.
    """

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        return {p: s for o in self.optimizers for p, s in o.state.items()}

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Each part's own state dict by position (DCP does not use this: see the class doc)."""
        return {str(i): o.state_dict() for i, o in enumerate(self.optimizers)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for i, o in enumerate(self.optimizers):
            o.load_state_dict(state[str(i)])


def optimizer_parts(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind ``optimizer`` (what DCP is given)."""
    return list(getattr(optimizer, "optimizers", [optimizer]))


def muon_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's, AdamW's) trainable parameters: Muon takes the 2-D projection matrices the model's blocks
    name as their hidden matrices (``hidden_matrices()``: attention and MLP projections, shared experts;
    never the router or the stacked experts); see the module doc for why everything else goes to AdamW.
    Wrappers (DDP, FSDP2, torch.compile) keep the blocks, so their parameters are found through them."""
    hidden = {id(p) for m in model.modules() if hasattr(m, "hidden_matrices") for p in m.hidden_matrices()}
    muon, rest = [], []
    for p in model.parameters():
        if p.requires_grad:
            (muon if id(p) in hidden and p.ndim == 2 else rest).append(p)
    return muon, rest


def _adamw_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's two groups as :func:`build_optimizer` makes them: decay on matrices only."""
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def build_muon(model: nn.Module, o: "OptimizerSection") -> OptimizerGroup:
    muon, rest = muon_parameters(model)
    if not muon:
        raise UserError("optimizer.name=muon: the model has no trainable 2-D projection matrices for Muon")
    parts: list[torch.optim.Optimizer] = [
        torch.optim.Muon([{"params": muon, "lr_scale": o.muon_lr_ratio}], lr=o.lr * o.muon_lr_ratio,
                         weight_decay=o.weight_decay, momentum=o.muon_momentum, nesterov=True,
                         ns_steps=o.muon_ns_steps, adjust_lr_fn="match_rms_adamw")]
    if rest:
        parts.append(torch.optim.AdamW(_adamw_groups(rest, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2),
                                       eps=o.eps, **adamw_kernel(rest)))
    return OptimizerGroup(parts)


def build_adamw8bit(model: nn.Module, o: "OptimizerSection") -> torch.optim.Optimizer:
    bnb = require_bitsandbytes("optimizer.name=adamw8bit")
    params = [p for p in model.parameters() if p.requires_grad]
    return bnb.optim.AdamW8bit(_adamw_groups(params, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)


def check_optimizer(o: "OptimizerSection", lora: bool, sharded: bool) -> None:
    """Refuse combinations that cannot work, in one line, before anything is built (``lora``:
    ``lora.enabled``; ``sharded``: the layout shards parameters)."""
    name = o.name
    if name == "muon" and lora:
        raise UserError("optimizer.name=muon trains full weight matrices; with lora.enabled use adamw or adamw8bit")
    if name == "adamw8bit" and sharded:
        raise UserError("optimizer.name=adamw8bit does not support FSDP (parallel.dp_shard > 1): bitsandbytes' "
                        "8-bit kernels take plain tensors, not sharded DTensors; use parallel.mode=ddp")
    if name == "adamw8bit":
        require_bitsandbytes("optimizer.name=adamw8bit")


def make_optimizer(model: nn.Module, o: "OptimizerSection") -> Any:
    """The run's optimizer over ``model``'s trainable parameters (``optimizer.name``)."""
    if o.name == "muon":
        return build_muon(model, o)
    if o.name == "adamw8bit":
        return build_adamw8bit(model, o)
    return build_optimizer(model, o.lr, o.weight_decay, (o.beta1, o.beta2), o.eps)


def _state_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    for part in optimizer_parts(optimizer):
        for state in part.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def state_bytes(optimizer: Any) -> int:
    """Bytes of optimizer state (moments, momentum buffers, quantization scales) on this rank."""
    total = 0
    for t in _state_tensors(optimizer):
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total
