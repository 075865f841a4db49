"""Phase 3 of a run: the model. Loaded from where the config says and adapted (LoRA, a head) by the
model layer; then what the runtime decides once the model's shape and FLOPs are known (the checkpoints
to resume must fit it, its dtype and the device's peak, whether compiling pays); then laid out over the
mesh by its family's plan. Everything about it is held by one :class:`ModelBundle`."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lmforge.config import Config
from lmforge.errors import UserError
from lmforge.models.args import ModelArgs
from lmforge.models.heads import attach_head, head_of
from lmforge.models.load import LoadedModel, ModelSource, load_model
from lmforge.models.lora import apply_lora, base_weights_fingerprint, trainable_parameters
from lmforge.models.model import Transformer
from lmforge.models.spec import ModelSpec, freeze_groups, parameters_of, spec_for_args
from lmforge.models.tokenizer import Tokenizer
from lmforge.parallel import ParallelOptions, parallelize_decoder
from lmforge.parallel.layout_checks import check_layout
from lmforge.runtime.check import RunPlan, check_resume_compatible
from lmforge.runtime.compile_cache import choose_compile, enable_compile_caches, mark_compiled, shape_key
from lmforge.runtime.host_memory import map_large_buffers, trim
from lmforge.runtime.precision import choose_dtype, peak_flops_per_device
from lmforge.runtime.world import World


@dataclass(frozen=True)
class ModelBundle:
    """The run's model and what describes it."""

    tokenizer: Tokenizer
    args: ModelArgs
    spec: ModelSpec
    """The model family's spec: its plan over the mesh, its FLOP counts, Hugging Face in and out."""
    raw: Transformer
    """The unwrapped model (for generation, export and state dicts)."""
    module: nn.Module
    """The model the train step calls: laid out over the mesh (DDP/FSDP2) and/or compiled."""
    source: ModelSource
    """Where the starting weights came from (the frozen reference of DPO/GRPO is rebuilt from it)."""
    description: dict[str, Any]
    """Model shape and tokenizer, stored in every checkpoint so it describes itself."""
    dtype: str
    """The autocast dtype in use (``training.dtype`` with ``auto`` resolved, see runtime.precision)."""
    adapter_params: int | None
    """Trainable LoRA parameters on a frozen base (``[lora]``), None when every weight trains."""
    flops_per_token: float
    """Training FLOPs per token at the run's sequence length (what MFU divides by the peak)."""
    peak_flops: float
    """The device's peak FLOP/s in ``dtype`` (measured, or ``metrics.peak_tflops``)."""
    device_type: str
    notes: dict[str, Any]
    """What the setup line says of how the model was built (dtype, compile, host memory: the why)."""
    trainable: tuple[int, int]
    """(trainable, all) parameters of the laid-out model: the setup line's ``trainable_share``."""
    tower_trains: bool = True
    """Whether any weight of a vision-language model's tower or projector trains (its FLOPs then count a
    backward pass); see ``model.freeze``."""

    def training_flops(self, document_lengths: list[int]) -> float:
        """Training FLOPs of a batch's real documents for this run's model (LoRA counted as such)."""
        return self.spec.training_flops(self.args, document_lengths, self.adapter_params)

    def image_flops(self, image_grid_thw: torch.Tensor | None, n_images: int) -> float:
        """Training FLOPs of the vision tower and projector over a batch's images (0 without images or for a
        text family): forward and backward, or the forward alone when they are frozen."""
        if not n_images or self.spec.image_flops is None:
            return 0.0
        return self.spec.image_flops(self.args, image_grid_thw, n_images, self.tower_trains)

    def autocast(self) -> Any:
        if self.dtype == "bfloat16":
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        return nullcontext()


def build_model(cfg: Config, source: ModelSource) -> LoadedModel:
    """The run's starting model, checked against the data's sequence length."""
    m = cfg.model
    overrides = {k: v for k, v in {
        "dim": m.dim, "n_layers": m.n_layers, "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads,
        "ffn_hidden_dim": m.ffn_hidden_dim, "max_seq_len": m.max_seq_len, "tie_embeddings": m.tie_embeddings,
    }.items() if v is not None}
    loaded = load_model(source, tokenizer=m.tokenizer, size=m.size, overrides=overrides)
    if cfg.data.seq_len > loaded.args.max_seq_len:
        raise UserError(f"data.seq_len={cfg.data.seq_len} is longer than the model allows "
                        f"(max_seq_len={loaded.args.max_seq_len})")
    return loaded


def build_model_bundle(cfg: Config, plan: RunPlan, world: World, trainer: str, head: str | None) -> ModelBundle:
    """The model of the run, from the plan's source, ready to train over ``world``: checked against the
    layout and against the checkpoints in the plan's run directory before it is laid out."""
    info = world.dist
    torch.manual_seed(cfg.training.seed)
    host_memory = map_large_buffers() if cfg.training.release_host_memory else "off"
    loaded = build_model(cfg, plan.source)
    if cfg.training.release_host_memory:
        trim()  # what loading freed (a GGUF's dequantization buffers, a state dict's renamed copies)
    model, args = loaded.model, loaded.args
    description = loaded.description()
    adapter_params = None
    if cfg.lora.enabled:  # before any wrapper: DDP/FSDP must see which parameters train
        description |= {"lora": cfg.lora.model_dump(), "base": str(loaded.source),
                        "base_weights": base_weights_fingerprint(model)}
        apply_lora(model, cfg.lora, info.device)
        adapter_params = trainable_parameters(model)[0]
    spec = spec_for_args(args)
    if cfg.model.freeze:  # before any wrapper, as LoRA
        description |= {"freeze": list(cfg.model.freeze)}
        freeze_groups(model, spec, cfg.model.freeze)
    tower_trains = any(p.requires_grad for group in ("vision_tower", "projector")
                       if group in spec.parameter_groups for _, p in parameters_of(model, spec, group))
    if head:  # after LoRA, which freezes all it does not add: the head trains either way
        attach_head(model, head)
        description |= {"head": head}
    elif head_of(model):
        raise UserError(f"{loaded.source} is a reward model (a {head_of(model)} head, no trained vocabulary "
                        f"layer): `lmforge {trainer}` needs a language model to start from")
    fpt = spec.flops_per_token(args, cfg.data.seq_len, adapter_params)
    # What the runtime decides once the model's shape is known, then the layout over the mesh.
    check_resume_compatible(plan.run, args, description)
    model.to(info.device)
    dtype, dtype_why = choose_dtype(cfg.training.dtype, info.device, model.num_params(exclude_embeddings=True))
    peak, peak_src = peak_flops_per_device(  # MFU is measured against the peak of the dtype in use
        info.device, torch.bfloat16 if dtype == "bfloat16" else torch.float32,
        cfg.metrics.peak_tflops * 1e12 if cfg.metrics.peak_tflops else None)
    compile_on, compile_why = _choose_compile(cfg, args, world, dtype, fpt * cfg.data.seq_len, peak, model)
    notes = {"dtype": dtype, "dtype_reason": dtype_why, "compile": "on" if compile_on else "off",
             "compile_reason": compile_why, "activation_offload": _offload_note(cfg, info.device),
             "host_memory": host_memory, "peak_source": peak_src}
    module = parallelize(model, spec, cfg, world, bf16=dtype == "bfloat16", compile=compile_on)
    return ModelBundle(loaded.tokenizer, args, spec, model, module, loaded.source, description, dtype,
                       adapter_params, fpt, peak, info.device.type, notes, trainable_parameters(model), tower_trains)


def parallelize(model: Transformer, spec: ModelSpec, cfg: Config, world: World, bf16: bool,
                compile: bool | None = None) -> nn.Module:
    """Lay the model out over the mesh with its family's plan (the decoder plan unless the family
    brings its own), once every model-splitting degree has been checked against the model's shape, the
    data's sequence length and the batch (one line naming the key, never a shape error in a collective);
    ``compile`` None: ``training.compile`` as set (``auto`` resolved by the caller)."""
    check_layout(world.layout, model.args, cfg)
    plan = spec.parallelize or parallelize_decoder
    t, p, device = cfg.training, cfg.parallel, world.dist.device
    offload = t.activation_offload and device.type == "cuda"  # on a CPU activations already live in host memory
    compile = t.compile is True if compile is None else compile
    return plan(model, world.layout, world.mesh, device,
                ParallelOptions(t.activation_checkpointing, compile, bf16, p.sequence_parallel, p.pp_schedule,
                                p.pp_stages_per_rank, offload))


def _choose_compile(cfg: Config, args: ModelArgs, world: World, dtype: str, flops_per_row: float, peak: float,
                    model: nn.Module) -> tuple[bool, str]:
    """``training.compile`` resolved (``auto``: lmforge.runtime.compile_cache's rule) and why; when on,
    Inductor's caches go to lmforge's directory, the reason names it, and the first forward through the
    compiled blocks records their shapes as cached (what ``auto`` reads as a warm cache next time)."""
    t = cfg.training
    key = shape_key(args, cfg.data.seq_len, t.micro_batch_size, dtype, world.layout.describe_mesh(),
                    t.activation_checkpointing, cfg.lora.enabled)
    step_flops = flops_per_row * t.global_batch_size / world.dist.world_size
    on, why = choose_compile(t.compile, t.steps, step_flops, peak, t.max_seconds, key)
    if on:
        why = f"{why}; cache {enable_compile_caches()}"

        def mark(module: nn.Module, inputs: Any, output: Any) -> None:
            mark_compiled(key)
            handle.remove()

        handle = model.register_forward_hook(mark)
    return on, why


def _offload_note(cfg: Config, device: torch.device) -> str:
    if not cfg.training.activation_offload:
        return "off"
    if device.type != "cuda":
        return f"off on {device.type}: activations already live in host memory, offloading would only copy them"
    return "on: each block's saved activations in pinned host memory"
