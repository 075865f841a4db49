"""What a model family provides, and the registry that finds a family's spec.

A :class:`ModelSpec` is everything lmforge needs to know about one family besides the shared
layers: how its Hugging Face ``config.json`` reads into ``ModelArgs`` and is written back, how its
checkpoint tensors are named, how to build the model, whether the fused decode step runs it, how
to lay it out over devices and how to count its FLOPs. Code that depends on the family asks the
spec (``spec_for_args(args)``, ``spec_for_hf_config(cfg, where)``) and never tests a family name.

The built-in families live in their folders under :mod:`lmforge.models`, listed in
:mod:`lmforge.models.families`, and register themselves when the first lookup here (or of a named size)
imports that list (:func:`~lmforge.models.args.load_families`). To add one, see ``docs/models.md`` ("Layout").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from torch import nn

from lmforge.errors import UserError
from lmforge.models import flops
from lmforge.models.args import ModelArgs, load_families, register_args_class, register_sizes
from lmforge.models.state_dict_adapter import StateDictAdapter

__all__ = [
    "DECODER_LORA_TARGETS", "GGUFFormat", "ModelSpec", "freeze_groups", "get_spec", "gguf_format_for",
    "lora_targets_for",
    "parameters_of", "register_spec", "registered_model_types",
    "registered_specs", "spec_for_args",
    "spec_for_hf_config",
]

DECODER_LORA_TARGETS = {"wq": "attention.wq", "wk": "attention.wk", "wv": "attention.wv", "wo": "attention.wo",
                        "w1": "feed_forward.w1", "w2": "feed_forward.w2", "w3": "feed_forward.w3"}
"""The gated decoders' attention and MLP projections, by short name (every family built on them)."""

AfterOptimizerStep = Callable[[nn.Module, ModelArgs, Mapping[str, Any]], None]
"""(the unwrapped model, its args, the step's global totals) -> None."""
ArgsFromHF = Callable[[Mapping[str, Any], str], ModelArgs]
"""(parsed config.json, file name for errors) -> ``ModelArgs``; UserError for what the family cannot run."""
HFConfig = Callable[..., dict[str, Any]]
"""(args, *, torch_dtype, bos_token_id, eos_token_id, pad_token_id) -> the config.json to write."""
Parallelize = Callable[..., nn.Module]
"""(model, dims, mesh, device, options) -> the module the train step calls, as
``lmforge.parallel.plans.parallelize_decoder``."""
FlopsPerToken = Callable[[ModelArgs, int, int | None], float]
"""(args, seq_len, adapter_params) -> training FLOPs per token (see ``flops.flops_per_token``)."""
TrainingFlops = Callable[[ModelArgs, Iterable[int], int | None], float]
"""(args, document lengths, adapter_params) -> training FLOPs of a batch (see ``flops.training_flops``)."""
ImageFlops = Callable[[ModelArgs, Any, int, bool], float]
"""(args, image_grid_thw or None, number of images, training) -> FLOPs of the vision tower and projector over a
batch's images (forward only when ``training`` is False: a frozen tower is not differentiated)."""


@dataclass(frozen=True)
class GGUFFormat:
    """How llama.cpp stores a family: its GGUF ``architecture``, the block tensor names (``blk.N.<part>``
    -> the Hugging Face module name), and its converter's two rewrites: q/k projections permuted
    (``LlamaModel.permute``) and ``*norm.weight`` stored plus one (Gemma 3's ``norm_shift``)."""

    architecture: str
    layer_names: Mapping[str, str]
    permuted_qk: bool = False
    norm_shifted: bool = False
    reads: bool = True
    """Whether a file of this architecture reads as this family (llama.cpp writes Mistral as ``llama``:
    Mistral writes that architecture, and it reads back as Llama)."""


@dataclass(frozen=True, eq=False)
class ModelSpec:
    """One model family: its Hugging Face identity and conversions, its model, and its runtime hooks."""

    name: str
    """Registry key (``get_spec(name)``)."""
    hf_model_type: str
    """Hugging Face ``model_type``; ``ModelArgs.hf_model_type`` names the spec by it (``spec_for_args``)."""
    hf_architecture: str
    """The ``*ForCausalLM`` class transformers builds for this family (written to ``architectures``)."""
    args_from_hf: ArgsFromHF
    """config.json -> ``ModelArgs``: the family's defaults for missing keys and the settings it refuses."""
    hf_config: HFConfig
    """``ModelArgs`` -> config.json; refuses (like ``check_exportable``) what the family cannot express."""
    check_exportable: Callable[[ModelArgs], None]
    """UserError unless ``args`` are what the family can express (switches it requires or forbids).
    Export calls it before writing anything."""
    state_dict_adapter: StateDictAdapter
    """lmforge parameter names <-> the family's Hugging Face tensor names."""
    build: Callable[[ModelArgs], nn.Module]
    """The model for ``args`` (any device context applies, e.g. ``torch.device("meta")``)."""
    fused_decode: bool
    """Whether ``lmforge.models.decode_step``'s fused step computes what ``build``'s model does; if not,
    generation calls the model's own forward every step."""
    parallelize: Parallelize | None = None
    """How to lay the model out over the mesh (checkpointing, compile, FSDP2 / DDP). ``None``: the
    runtime applies the default decoder plan, ``lmforge.parallel.plans.parallelize_decoder``, which
    suits every family built from the shared layers."""
    flops_per_token: FlopsPerToken = flops.flops_per_token
    """Training FLOPs per token at a sequence length, for MFU."""
    training_flops: TrainingFlops = flops.training_flops
    """Training FLOPs of a batch's real tokens given its document lengths, for MFU."""
    lora_targets: Mapping[str, str] = field(default_factory=lambda: dict(DECODER_LORA_TARGETS))
    """Linear layers that can carry LoRA adapters: short name (``lora.target_modules``) -> its path inside
    a block. A mixture of experts' stacked experts take the MLP's names (peft's parameter adapters)."""
    after_optimizer_step: AfterOptimizerStep | None = None
    """Called by the loop after every optimizer step with the step's global totals (sums over microbatches
    and ranks, e.g. ``router_expert_tokens`` [MoE layers, experts]): DeepSeek-V3's auxiliary-loss-free
    balancing moves its routers' correction biases here. None: nothing to do."""
    gguf: GGUFFormat | None = None
    """How llama.cpp stores the family (None: GGUF in and out refused in one line)."""
    args_class: type[ModelArgs] = ModelArgs
    """The family's argument class: ``ModelArgs``, or a subclass with the family's own fields whose
    ``decoder_config()`` builds its modules; checkpoints of the family load into it."""
    sizes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Named sizes (``model.size``) of the family's published models: ``args_class`` fields."""
    image_flops: ImageFlops | None = None
    """A vision-language family's tower FLOPs for a batch's images (the decoder's are ``training_flops``,
    over image and text tokens alike); None for a text family."""
    parameter_groups: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """The model's parts by role, name -> the parameter-name prefixes it covers (a vision-language model's
    ``vision_tower``, ``projector``, ``language_model``), so a recipe can freeze or tune one part by name
    (:func:`parameters_of`). Empty: the model is one part."""


def parameters_of(model: nn.Module, spec: ModelSpec, group: str) -> list[tuple[str, nn.Parameter]]:
    """``model``'s (name, parameter) pairs in ``spec``'s parameter group ``group`` (wrapper prefixes, e.g.
    torch.compile's, ignored); one line naming the known groups otherwise."""
    from lmforge.models.state_dict_adapter import strip_wrapper_prefixes

    if group not in spec.parameter_groups:
        known = ", ".join(spec.parameter_groups) or "none"
        raise UserError(f"model family {spec.name!r} has no parameter group {group!r} (groups: {known})")
    prefixes = spec.parameter_groups[group]
    return [(n, p) for n, p in model.named_parameters()
            if any(strip_wrapper_prefixes(n) == x or strip_wrapper_prefixes(n).startswith(x + ".") for x in prefixes)]


def freeze_groups(model: nn.Module, spec: ModelSpec, groups: Iterable[str]) -> int:
    """Stop the parameters of ``spec``'s parameter ``groups`` training (``model.freeze``: a vision-language
    model's tower or projector kept as it is); returns how many weights were frozen. One line naming the
    known groups for an unknown one, or for a family of one part."""
    frozen = 0
    for group in groups:
        for _, p in parameters_of(model, spec, group):
            frozen += p.numel() if p.requires_grad else 0
            p.requires_grad_(False)
    return frozen


def lora_targets_for(args: ModelArgs, requested: Iterable[str] | None) -> dict[str, str]:
    """The family's LoRA targets among ``requested`` (None: all), short name -> path inside a block;
    one line naming the unknown ones."""
    known = spec_for_args(args).lora_targets
    names = list(known) if requested is None else list(requested)
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise UserError(f"lora.target_modules: unknown module(s) {unknown}; choose from {', '.join(known)}")
    if not names:
        raise UserError(f"lora.target_modules is empty; choose from {', '.join(known)} (or leave it out: all)")
    return {n: known[n] for n in names}


def gguf_format_for(architecture: str, where: str) -> tuple[ModelSpec, GGUFFormat]:
    """The family a GGUF file's ``general.architecture`` reads as (the spec whose ``gguf`` reads it)."""
    load_families()
    for spec in _BY_NAME.values():
        if spec.gguf is not None and spec.gguf.reads and spec.gguf.architecture == architecture:
            return spec, spec.gguf
    known = sorted({s.gguf.architecture for s in _BY_NAME.values() if s.gguf is not None and s.gguf.reads})
    raise UserError(f"{where}: GGUF architecture {architecture!r} is not supported (supported: {', '.join(known)})")


_BY_NAME: dict[str, ModelSpec] = {}
_BY_MODEL_TYPE: dict[str, ModelSpec] = {}


def register_spec(spec: ModelSpec) -> ModelSpec:
    """Add ``spec`` to the registry and return it. Names and Hugging Face model types are unique, so
    a config.json always selects one family."""
    if spec.name in _BY_NAME:
        raise ValueError(f"a model spec named {spec.name!r} is already registered")
    if spec.hf_model_type in _BY_MODEL_TYPE:
        raise ValueError(f"model_type {spec.hf_model_type!r} already belongs to spec "
                         f"{_BY_MODEL_TYPE[spec.hf_model_type].name!r}")
    _BY_NAME[spec.name] = spec
    _BY_MODEL_TYPE[spec.hf_model_type] = spec
    register_args_class(spec.hf_model_type, spec.args_class)
    register_sizes({name: {**fields, "hf_model_type": spec.hf_model_type} for name, fields in spec.sizes.items()})
    return spec


def registered_specs() -> tuple[ModelSpec, ...]:
    """Every registered spec, in registration order."""
    load_families()
    return tuple(_BY_NAME.values())


def registered_model_types() -> tuple[str, ...]:
    """The Hugging Face model types lmforge runs (valid ``ModelArgs.hf_model_type`` values)."""
    load_families()
    return tuple(_BY_MODEL_TYPE)


def get_spec(name: str) -> ModelSpec:
    load_families()
    try:
        return _BY_NAME[name]
    except KeyError:
        raise UserError(f"unknown model family {name!r}; known: {', '.join(_BY_NAME)}") from None


def spec_for_args(args: ModelArgs) -> ModelSpec:
    """The family ``args`` belong to (by ``args.hf_model_type``)."""
    load_families()
    try:
        return _BY_MODEL_TYPE[args.hf_model_type]
    except KeyError:
        raise UserError(f"unknown hf_model_type {args.hf_model_type!r}; known: "
                        f"{', '.join(_BY_MODEL_TYPE)}") from None


def spec_for_hf_config(cfg: Mapping[str, Any], where: str) -> ModelSpec:
    """The family of a parsed ``config.json`` (by its ``model_type``); ``where`` names the file in errors."""
    load_families()
    if not isinstance(cfg, Mapping):
        raise UserError(f"{where}: expected a JSON object of model settings, got a {type(cfg).__name__}")
    family = cfg.get("model_type")
    spec = _BY_MODEL_TYPE.get(family) if isinstance(family, str) else None
    if spec is None:
        raise UserError(f"{where}: model_type {family!r} is not supported (supported: {', '.join(_BY_MODEL_TYPE)})")
    return spec
