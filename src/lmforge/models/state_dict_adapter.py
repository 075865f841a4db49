"""Renaming state dicts between lmforge's parameter names and a Hugging Face family's.

lmforge's rotary embeddings use Hugging Face's ``rotate_half`` layout, so converting a checkpoint
is a pure renaming of tensors: no q/k permutation in either direction, and no tensor is copied.
Two exceptions: a mixture of experts, where lmforge keeps each projection of all experts as one
[E, out, in] tensor (what a grouped matmul reads) while Hugging Face checkpoints store one matrix
per expert, so those are stacked on reading and split (as views) on writing; and families that
store projections fused (Phi-3's ``qkv_proj`` and ``gate_up_proj``), split on reading (as views)
and concatenated on writing; and families whose checkpoints keep several lmforge tensors in one, stacked
over experts, possibly interleaved and transposed (gpt-oss's ``gate_up_proj`` [E, dim, 2 hidden] with
gate and up columns alternating), described by :class:`Packed` and split on reading.
A :class:`StateDictAdapter` is that renaming for one family; each family's
:class:`~lmforge.models.spec.ModelSpec` holds one (the Llama layout they share, plus their extras).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

import torch
from torch import Tensor

from lmforge.errors import UserError
from lmforge.models.args import ModelArgs

__all__ = ["Packed", "StateDictAdapter", "strip_wrapper_prefixes"]

_LF_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Wrappers that prefix parameter names (torch.compile, DDP).
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def _rows(args: ModelArgs, lf_suffix: str) -> int:
    """Output rows of a fusable lmforge projection."""
    rows = {"attention.wq.weight": args.n_heads * args.head_dim, "attention.wk.weight": args.kv_heads * args.head_dim,
            "attention.wv.weight": args.kv_heads * args.head_dim, "feed_forward.w1.weight": args.ffn_dim,
            "feed_forward.w3.weight": args.ffn_dim}
    return rows[lf_suffix]


def strip_wrapper_prefixes(name: str) -> str:
    """``name`` without the prefixes torch.compile and DDP add (at the front or inside)."""
    changed = True
    while changed:
        changed = False
        for p in _WRAPPER_PREFIXES:
            if name.startswith(p):
                name, changed = name[len(p):], True
    return name.replace("._orig_mod.", ".")


@dataclass(frozen=True)
class Packed:
    """How one Hugging Face tensor inside a block holds lmforge tensors ``parts`` (lmforge suffixes, in order).

    In lmforge's layout the parts are joined along ``dim``: concatenated, or with ``interleaved`` their
    entries alternating (part 0's first row, part 1's first row, ...); with ``transposed`` the Hugging Face
    tensor is that join with its last two dimensions swapped. One part with ``transposed`` is a plain
    transpose (gpt-oss's ``down_proj`` [E, hidden, dim] is lmforge's ``w2`` [E, dim, hidden]). Parts have
    equal sizes along ``dim``. Reading copies only where the layouts differ (an interleave or a transpose:
    a strided view would become a strided parameter); writing copies once."""

    parts: tuple[str, ...]
    dim: int = 1
    interleaved: bool = False
    transposed: bool = False

    def split(self, t: Tensor) -> list[Tensor]:
        """The lmforge tensors in the Hugging Face tensor ``t``."""
        if self.transposed:
            t = t.transpose(-1, -2)
        n = len(self.parts)
        if t.shape[self.dim] % n:
            raise UserError(f"a tensor of shape {list(t.shape)} does not split into {n} equal parts along dim {self.dim}")
        parts = t.unflatten(self.dim, (-1, n)).unbind(self.dim + 1) if self.interleaved else t.chunk(n, self.dim)
        # strided views would become strided parameters: copy where the layouts differ
        return [p.contiguous() for p in parts] if self.interleaved or self.transposed else list(parts)

    def join(self, parts: list[Tensor]) -> Tensor:
        """The Hugging Face tensor holding ``parts`` (in the order of :attr:`parts`), contiguous."""
        t = torch.stack(parts, self.dim + 1).flatten(self.dim, self.dim + 1) if self.interleaved else \
            torch.cat(parts, self.dim) if len(parts) > 1 else parts[0]
        return (t.transpose(-1, -2) if self.transposed else t).contiguous()


@dataclass(frozen=True)
class StateDictAdapter:
    """lmforge names <-> Hugging Face ``*ForCausalLM`` names of one family.

    ``layer_names`` maps the suffix of a parameter inside block ``i`` (``layers.{i}.<suffix>``)
    to its Hugging Face suffix (``model.layers.{i}.<suffix>``); ``global_names`` maps the
    parameters outside the blocks. A name neither map knows is refused, so a checkpoint that
    carries something the family does not model (say a bias) never loads silently incomplete.
    """

    layer_names: Mapping[str, str]
    global_names: Mapping[str, str]
    expert_names: Mapping[str, str] = field(default_factory=dict)
    """Stacked expert weights inside a block: lmforge suffix -> the Hugging Face per-expert suffix with
    ``{e}`` for the expert index (``feed_forward.experts.w1`` -> ``mlp.experts.{e}.gate_proj.weight``)."""
    fused_names: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Hugging Face suffix of a fused projection -> the lmforge suffixes it holds, in row order
    (``self_attn.qkv_proj.weight`` -> ``attention.wq.weight``, ``attention.wk.weight``, ``attention.wv.weight``)."""
    packed_names: Mapping[str, Packed] = field(default_factory=dict)
    """Hugging Face suffix inside a block -> the lmforge tensors it holds and how (:class:`Packed`): gpt-oss's
    stacked experts (``mlp.experts.gate_up_proj`` -> ``feed_forward.experts.w1``, ``feed_forward.experts.w3``
    interleaved and transposed)."""
    read_hook: Callable[[Mapping[str, Tensor]], Mapping[str, Tensor]] | None = None
    """Applied to a Hugging Face state dict before renaming: e.g. gpt-oss's MXFP4 expert weights
    (``*_blocks`` / ``*_scales`` pairs) dequantized into the tensors they stand for."""
    _hf_layer_names: Mapping[str, str] = field(init=False, repr=False, compare=False)
    _hf_global_names: Mapping[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("layer_names", "global_names", "expert_names"):
            forward = dict(getattr(self, name))
            if len(set(forward.values())) != len(forward):
                raise ValueError(f"StateDictAdapter.{name} maps two lmforge names to one Hugging Face name")
            object.__setattr__(self, name, MappingProxyType(forward))
            object.__setattr__(self, f"_hf_{name}", MappingProxyType({v: k for k, v in forward.items()}))
        object.__setattr__(self, "fused_names", MappingProxyType(dict(self.fused_names)))
        object.__setattr__(self, "packed_names", MappingProxyType(dict(self.packed_names)))
        object.__setattr__(self, "_packed_part", MappingProxyType(
            {lf: hf for hf, packed in self.packed_names.items() for lf in packed.parts}))
        object.__setattr__(self, "_fused_part", MappingProxyType(
            {lf: hf for hf, parts in self.fused_names.items() for lf in parts}))
        object.__setattr__(self, "_hf_expert_patterns", tuple(
            (re.compile(re.escape(hf).replace(re.escape("{e}"), r"(\d+)")), lf) for lf, hf in self.expert_names.items()))

    def extend(self, layer_names: Mapping[str, str] | None = None,
               global_names: Mapping[str, str] | None = None,
               expert_names: Mapping[str, str] | None = None, drop: tuple[str, ...] = (),
               packed_names: Mapping[str, Packed] | None = None,
               read_hook: Callable[[Mapping[str, Tensor]], Mapping[str, Tensor]] | None = None) -> StateDictAdapter:
        """This renaming plus a family's extra names (e.g. Qwen2's q/k/v biases; gpt-oss's packed experts and
        its MXFP4 ``read_hook``), without the lmforge layer names in ``drop`` (e.g. a dense MLP an MoE family
        replaces)."""
        layers = {k: v for k, v in {**self.layer_names, **(layer_names or {})}.items() if k not in drop}
        return StateDictAdapter(layers, {**self.global_names, **(global_names or {})},
                                {**self.expert_names, **(expert_names or {})}, self.fused_names,
                                {**self.packed_names, **(packed_names or {})},
                                self.read_hook if read_hook is None else read_hook)

    def fuse(self, fused_names: Mapping[str, tuple[str, ...]]) -> StateDictAdapter:
        """This renaming with the given lmforge projections stored fused (Phi-3)."""
        parts = {lf for names in fused_names.values() for lf in names}
        layers = {k: v for k, v in self.layer_names.items() if k not in parts}
        return StateDictAdapter(layers, self.global_names, self.expert_names, {**self.fused_names, **fused_names},
                                self.packed_names, self.read_hook)

    def to_hf(self, model_state: Mapping[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
        """Hugging Face names for an lmforge state dict (wrapper prefixes such as torch.compile's dropped).

        With tied embeddings ``lm_head.weight`` is omitted, as ``save_pretrained`` does.
        """
        out: dict[str, Tensor] = {}
        fused: dict[str, dict[str, Tensor]] = {}
        packed: dict[str, dict[str, Tensor]] = {}
        for raw, t in model_state.items():
            name = strip_wrapper_prefixes(raw)
            if name in self.global_names:
                if name == "output.weight" and args.tie_embeddings:
                    continue
                out[self.global_names[name]] = t
                continue
            m = _LF_LAYER.fullmatch(name)
            if m is not None and m.group(2) in self._fused_part:  # type: ignore[attr-defined]
                hf = f"model.layers.{m.group(1)}.{self._fused_part[m.group(2)]}"  # type: ignore[attr-defined]
                fused.setdefault(hf, {})[m.group(2)] = t
                continue
            if m is not None and m.group(2) in self._packed_part:  # type: ignore[attr-defined]
                hf = f"model.layers.{m.group(1)}.{self._packed_part[m.group(2)]}"  # type: ignore[attr-defined]
                packed.setdefault(hf, {})[m.group(2)] = t
                continue
            if m is not None and m.group(2) in self.expert_names:
                for e, w in enumerate(t.unbind(0)):
                    out[f"model.layers.{m.group(1)}.{self.expert_names[m.group(2)].format(e=e)}"] = w
                continue
            if m is None or m.group(2) not in self.layer_names:
                raise ValueError(f"unexpected lmforge parameter {raw!r}")
            out[f"model.layers.{m.group(1)}.{self.layer_names[m.group(2)]}"] = t
        for hf, parts in fused.items():
            out[hf] = torch.cat([parts[lf] for lf in self.fused_names[hf.split(".", 3)[3]]])
        for hf, parts in packed.items():
            how = self.packed_names[hf.split(".", 3)[3]]
            missing = [lf for lf in how.parts if lf not in parts]
            if missing:
                raise ValueError(f"{hf} needs {missing} too")
            out[hf] = how.join([parts[lf] for lf in how.parts])
        return out

    def from_hf(self, hf_state: Mapping[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
        """lmforge names for a Hugging Face state dict.

        When the model ties embeddings, ``output.weight`` is the embedding tensor itself.
        Buffers HF may store (``rotary_emb.inv_freq``) are ignored: lmforge recomputes RoPE.
        """
        out: dict[str, Tensor] = {}
        experts: dict[str, dict[int, Tensor]] = {}
        if self.read_hook is not None:
            hf_state = self.read_hook(hf_state)
        for name, t in hf_state.items():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name in self._hf_global_names:
                out[self._hf_global_names[name]] = t
                continue
            m = _HF_LAYER.fullmatch(name)
            expert = self._expert_slot(m.group(2)) if m is not None else None
            if m is not None and m.group(2) in self.fused_names:
                parts = self.fused_names[m.group(2)]
                for lf, piece in zip(parts, t.split([_rows(args, lf) for lf in parts])):
                    out[f"layers.{m.group(1)}.{lf}"] = piece
                continue
            if m is not None and m.group(2) in self.packed_names:
                how = self.packed_names[m.group(2)]
                for lf, piece in zip(how.parts, how.split(t)):
                    out[f"layers.{m.group(1)}.{lf}"] = piece
                continue
            if expert is not None:
                lf, e = expert
                experts.setdefault(f"layers.{m.group(1)}.{lf}", {})[e] = t  # type: ignore[union-attr]
                continue
            if m is None or m.group(2) not in self._hf_layer_names:
                raise UserError(f"unexpected tensor {name!r} in Hugging Face checkpoint (a feature lmforge lacks?)")
            out[f"layers.{m.group(1)}.{self._hf_layer_names[m.group(2)]}"] = t
        for name, by_expert in experts.items():
            if sorted(by_expert) != list(range(args.n_experts)):
                raise UserError(f"Hugging Face checkpoint has {len(by_expert)} experts for {name}, "
                                f"config.json says {args.n_experts}")
            out[name] = torch.stack([by_expert[e] for e in range(args.n_experts)])
        if args.tie_embeddings:
            if "tok_embeddings.weight" not in out:
                raise UserError("Hugging Face checkpoint has no model.embed_tokens.weight")
            out["output.weight"] = out["tok_embeddings.weight"]
        elif "output.weight" not in out:
            raise UserError("checkpoint has no lm_head.weight but config says tie_word_embeddings=false")
        return out

    def _expert_slot(self, hf_suffix: str) -> tuple[str, int] | None:
        """(lmforge stacked name, expert index) of a per-expert Hugging Face tensor, else None."""
        for pattern, lf in self._hf_expert_patterns:  # type: ignore[attr-defined]
            m = pattern.fullmatch(hf_suffix)
            if m is not None:
                return lf, int(m.group(1))
        return None

    def hf_module_name(self, name: str) -> str:
        """The Hugging Face name of a projection inside a layer: ``layers.3.attention.wq`` ->
        ``model.layers.3.self_attn.q_proj`` (wrapper prefixes such as torch.compile's are dropped)."""
        m = _LF_LAYER.fullmatch(strip_wrapper_prefixes(name))
        fused = self._fused_part.get(f"{m.group(2)}.weight") if m else None  # type: ignore[attr-defined]
        fused = fused or (self._packed_part.get(m.group(2)) if m else None)  # type: ignore[attr-defined]
        if fused is not None:
            raise UserError(f"{name} is part of the fused Hugging Face projection {fused.removesuffix('.weight')}: "
                            "a PEFT adapter for it cannot be written; export the merged model (--hf) instead")
        suffix = self.layer_names.get(f"{m.group(2)}.weight") if m else None
        if m is None or suffix is None:
            raise ValueError(f"no Hugging Face name for lmforge module {name!r}")
        return f"model.layers.{m.group(1)}.{suffix.removesuffix('.weight')}"
