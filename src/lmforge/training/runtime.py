"""The services every trainer runs on, built the same way for every recipe.

``build_runtime`` turns a validated config into a :class:`Runtime`: process group, device mesh and
device, tokenizer, model (fresh, from a Hugging Face directory, or from an lmforge checkpoint) laid
out over the mesh by its family's plan, AdamW, the MetricLogger and the checkpoint tiers. What only
one recipe needs (the elastic recipe's step hooks and fast snapshot tier, a goodput clock that starts
at an earlier failure) comes in a :class:`RecipeServices` from the recipe; nothing else about the
trainer reaches the runtime.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from lmforge import distributed as dist_utils
from lmforge.checkpoint import STATE_FILE, Checkpointer, RunDir, list_checkpoints, resolve_checkpoint
from lmforge.checkpoint.layout import write_json, write_text
from lmforge.checkpoint.runlock import hold_run_lock
from lmforge.checkpoint.tiers import CheckpointTiers
from lmforge.config import Config
from lmforge.errors import UserError
from lmforge.metrics import MetricLogger
from lmforge.metrics.progress import progress_bar
from lmforge.metrics.sinks import WandbSink
from lmforge.models.flops import peak_flops_per_device
from lmforge.models.heads import attach_head, head_of
from lmforge.models.load import LoadedModel, ModelSource, load_model
from lmforge.models.lora import apply_lora, base_weights_fingerprint, trainable_parameters
from lmforge.models.qlora import check_qlora
from lmforge.models.args import ModelArgs
from lmforge.models.model import Transformer
from lmforge.models.spec import ModelSpec, spec_for_args
from lmforge.models.tokenizer import Tokenizer
from lmforge.parallel import ParallelDims, ParallelOptions, parallelize_decoder
from lmforge.parallel.dims import sub_mesh
from lmforge.parallel.layout_checks import check_layout, check_same_layout_on_every_rank
from lmforge.training.host_memory import map_large_buffers, trim
from lmforge.training.compile_cache import choose_compile, enable_compile_caches, mark_compiled, shape_key
from lmforge.training.precision import choose_dtype
from lmforge.training.startup_checks import check_fresh_start, check_resume_compatible
from lmforge.training.optimizers import check_optimizer, make_optimizer

StepHook = Callable[["Runtime", Any, Any], None]
"""``hook(rt, state, source)``, called at the very end of every step of the loop."""
SnapshotRoot = Callable[[Config, RunDir, dist_utils.DistInfo], "tuple[Path | None, str]"]
"""Where a fast checkpoint tier lives for this run, or (None, why not)."""


@dataclass(frozen=True)
class RecipeServices:
    """What a recipe adds to the shared runtime (the elastic recipe uses all three)."""

    step_hooks: tuple[StepHook, ...] = ()
    snapshot_root: SnapshotRoot | None = None
    """Adds a fast checkpoint tier (snapshots) where it returns a directory."""
    snapshot_keep: int = 1
    process_start: float | None = None
    """Moves the start of goodput accounting earlier (a restarted attempt counts from the failure)."""
    head: str | None = None
    """An output head the recipe's objective reads (``"score"``: a reward model's scalar score; see
    :mod:`lmforge.models.heads`), added to the model before it is wrapped, and named in checkpoints."""


@dataclass
class Runtime:
    """The services every trainer runs on, all built by :func:`build_runtime` and never replaced."""

    cfg: Config
    dist: dist_utils.DistInfo
    dims: ParallelDims
    mesh: Any
    """The ``DeviceMesh`` of ``dims`` (None for one process)."""
    tokenizer: Tokenizer
    model_args: ModelArgs
    spec: ModelSpec
    """The model family's spec: its plan over the mesh, its FLOP counts, Hugging Face in and out."""
    raw_model: Transformer
    """The unwrapped model (for generation, export and state dicts)."""
    model: nn.Module
    """The model the train step calls: laid out over the mesh (DDP/FSDP2) and/or compiled."""
    optimizer: torch.optim.Optimizer
    metrics: MetricLogger
    checkpoints: CheckpointTiers
    run_dir: Path
    model_source: ModelSource
    """Where the starting weights came from (the frozen reference of DPO/GRPO is rebuilt from it)."""
    model_description: dict[str, Any]
    """Model shape and tokenizer, stored in every checkpoint so it describes itself."""
    step_hooks: tuple[StepHook, ...] = ()
    dtype: str = "float32"
    """The autocast dtype in use (``training.dtype`` with ``auto`` resolved, see training.precision)."""
    before_save: Callable[[], None] | None = None
    """Called before every checkpoint save (the loop installs its non-finite guard here)."""
    adapter_params: int | None = None
    """Trainable LoRA parameters on a frozen base (``[lora]``), None when every weight trains."""

    def training_flops(self, document_lengths: list[int]) -> float:
        """Training FLOPs of a batch's real documents for this run's model (LoRA counted as such)."""
        return self.spec.training_flops(self.model_args, document_lengths, self.adapter_params)

    def open_run_dir(self) -> None:
        """Write the run's config, model description and metrics: called once every start-up check
        (config, data, the checkpoint to resume) has passed, so a refused start leaves the run
        directory as it was."""
        self.metrics.open()
        if self.dist.is_main:
            run = RunDir(self.run_dir)
            try:
                write_text(run.config, self.cfg.to_toml())
                write_json(run.model_args, self.model_description)
            except OSError as e:
                raise UserError(f"run.dir={self.run_dir}: cannot write the run directory ({e.strerror or e})") from None

    def context_shard(self, batch: Any) -> Any:
        """This rank's share of every sequence of ``batch`` under context parallelism (``parallel.cp``:
        load-balanced chunks, see lmforge.parallel.context_parallel); the batch itself otherwise."""
        if self.dims.cp == 1:
            return batch
        from lmforge.parallel.context_parallel import shard_batch

        return shard_batch(batch, self.dims.coords(self.dist.rank)["cp"], self.dims.cp)

    def autocast(self) -> Any:
        if self.dtype == "bfloat16":
            return torch.autocast(self.dist.device.type, dtype=torch.bfloat16)
        return nullcontext()


def prepare_run_dir(run_dir: Path, is_main: bool) -> None:
    """Create the run directory, or fail with one line when it cannot be written."""
    if not is_main:
        return
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write_test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise UserError(f"run.dir={run_dir}: cannot write the run directory ({e.strerror or e})") from None


def claim_run_dir(run_dir: Path, is_main: bool) -> None:
    """Rank 0 creates the run directory and locks it for this run (see runlock); if either fails,
    every rank raises the same one-line error instead of the others waiting in a collective."""
    problem = None
    if is_main:
        try:
            prepare_run_dir(run_dir, True)
            hold_run_lock(run_dir)
        except UserError as e:
            problem = str(e)
    problem = dist_utils.broadcast_object(problem)
    if problem:
        raise UserError(problem)


def model_source(cfg: Config) -> ModelSource:
    """Where a run's starting weights come from: a Hugging Face directory or Hub model (pinned to its
    commit), an lmforge checkpoint, or a fresh initialization with the run's seed."""
    m = cfg.model
    if m.from_hf:  # a Hugging Face directory, a llama.cpp .gguf file (lmforge.models.gguf) or a Hub name
        return ModelSource.from_hf(m.from_hf)
    if m.from_checkpoint:
        p = Path(m.from_checkpoint)
        if not (p / STATE_FILE).is_file() and not list_checkpoints(RunDir(p).checkpoints):
            raise UserError(f"model.from_checkpoint={p}: no checkpoint there; train the starting model first "
                            f"(e.g. lmforge pretrain --config configs/debug.toml --run.dir={p})")
        return ModelSource("checkpoint", str(resolve_checkpoint(p).resolve()))
    return ModelSource("init", str(cfg.training.seed))


def build_model(cfg: Config) -> LoadedModel:
    """The run's starting model (see :func:`model_source`), checked against the data's sequence length."""
    m = cfg.model
    overrides = {k: v for k, v in {
        "dim": m.dim, "n_layers": m.n_layers, "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads,
        "ffn_hidden_dim": m.ffn_hidden_dim, "max_seq_len": m.max_seq_len, "tie_embeddings": m.tie_embeddings,
    }.items() if v is not None}
    loaded = load_model(model_source(cfg), tokenizer=m.tokenizer, size=m.size, overrides=overrides)
    if cfg.data.seq_len > loaded.args.max_seq_len:
        raise UserError(f"data.seq_len={cfg.data.seq_len} is longer than the model allows "
                        f"(max_seq_len={loaded.args.max_seq_len})")
    return loaded


def parallelize(model: Transformer, spec: ModelSpec, cfg: Config, dims: ParallelDims, mesh: Any,
                device: torch.device, bf16: bool, compile: bool | None = None) -> nn.Module:
    """Lay the model out over the mesh with its family's plan (the decoder plan unless the family
    brings its own); ``compile`` None: ``training.compile`` as set (``auto`` resolved by the caller)."""
    plan = spec.parallelize or parallelize_decoder
    t = cfg.training
    offload = t.activation_offload and device.type == "cuda"  # on a CPU activations already live in host memory
    p = cfg.parallel
    compile = t.compile is True if compile is None else compile
    return plan(model, dims, mesh, device, ParallelOptions(t.activation_checkpointing, compile, bf16,
                                                           p.sequence_parallel, p.pp_schedule,
                                                           p.pp_stages_per_rank, offload))


def _choose_compile(cfg: Config, args: ModelArgs, dims: ParallelDims, dtype: str, flops_per_row: float,
                    peak: float, world: int) -> tuple[bool, str, str]:
    """``training.compile`` resolved (``auto``: lmforge.training.compile_cache's rule) and why; when on,
    Inductor's caches go to lmforge's directory and the reason names it. Also returns the shapes' key."""
    t = cfg.training
    key = shape_key(args, cfg.data.seq_len, t.micro_batch_size, dtype, dims.describe_mesh(),
                    t.activation_checkpointing, cfg.lora.enabled)
    step_flops = flops_per_row * t.global_batch_size / world
    on, why = choose_compile(t.compile, t.steps, step_flops, peak, t.max_seconds, key)
    if on:
        why = f"{why}; cache {enable_compile_caches()}"
    return on, why, key


def _mark_when_compiled(model: nn.Module, key: str) -> None:
    """After the first forward through the compiled blocks, record their shapes as cached (what ``auto``
    reads as a warm cache next time)."""

    def hook(module: nn.Module, inputs: Any, output: Any) -> None:
        mark_compiled(key)
        handle.remove()

    handle = model.register_forward_hook(hook)


def _offload_note(cfg: Config, device: torch.device) -> str:
    if not cfg.training.activation_offload:
        return "off"
    if device.type != "cuda":
        return f"off on {device.type}: activations already live in host memory, offloading would only copy them"
    return "on: each block's saved activations in pinned host memory"


def _router_note(cfg: Config, trainer: str, args: Any) -> dict[str, str]:
    """The setup line's ``router_losses`` entry (MoE models only): which terms this run trains with."""
    from lmforge.objectives.router import router_setup_note

    t = cfg.training
    note = router_setup_note(trainer, t.router_aux_loss_coef, t.router_z_loss_coef, args)
    return {} if note is None else {"router_losses": note}


def build_metrics(cfg: Config, info: dist_utils.DistInfo, run: RunDir, fpt: float, peak: float,
                  process_start: float | None) -> MetricLogger:
    """The MetricLogger, with the model's FLOPs per token and the device's peak for MFU."""
    bar = progress_bar(cfg.metrics.progress, cfg.training.steps, cfg.training.max_tokens, is_main=info.is_main)
    sinks = [WandbSink.start(run.root, cfg.to_dict())] if cfg.metrics.wandb and info.is_main else []
    return MetricLogger(run.root, rank=info.rank, world_size=info.world_size, log_every=cfg.metrics.log_every,
                        flops_per_token=fpt, peak_flops=peak, tensorboard=cfg.metrics.tensorboard,
                        console=bar.write if bar else None, process_start=process_start, sinks=sinks,
                        progress=bar, defer=True, device=info.device)


def build_checkpoints(cfg: Config, info: dist_utils.DistInfo, run: RunDir, metrics: MetricLogger,
                      trainer: str, services: RecipeServices) -> CheckpointTiers:
    """The durable tier in the run directory, plus a fast tier where the recipe asks for one."""
    report = lambda line: metrics.record_event("checkpoint_damaged", 0, line)  # noqa: E731
    durable = Checkpointer(run.root, cfg.checkpoint.keep, on_damaged=cfg.checkpoint.on_damaged, report=report)
    fast = None
    if services.snapshot_root is not None:
        root, why_not = services.snapshot_root(cfg, run, info)
        if root is None:
            metrics.console(f"{trainer}: fast snapshots off ({why_not})")
        else:
            fast = Checkpointer(run.root, services.snapshot_keep, on_damaged=cfg.checkpoint.on_damaged,
                                report=report, root=root)
    return CheckpointTiers(durable, fast)


def build_runtime(cfg: Config, trainer: str, services: RecipeServices = RecipeServices()) -> Runtime:
    """Process group and mesh, run directory, model laid out over the mesh, optimizer, MetricLogger
    and checkpoint tiers, plus what the recipe's ``services`` add."""
    if cfg.training.threads:
        torch.set_num_threads(cfg.training.threads)
    info = dist_utils.init_distributed(cfg.training.device)
    check_same_layout_on_every_rank(cfg.parallel)
    dims = ParallelDims.from_config(cfg.parallel, info.world_size)
    info.data_rank, info.data_world = dims.data_rank(info.rank), dims.data_world
    check_optimizer(cfg, sharded=bool(dims.shards))
    check_qlora(cfg.lora, sharded=bool(dims.shards))
    run = RunDir(cfg.run.dir)
    claim_run_dir(run.root, info.is_main)
    torch.manual_seed(cfg.training.seed)
    host_memory = map_large_buffers() if cfg.training.release_host_memory else "off"
    loaded = build_model(cfg)
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
    if services.head:  # after LoRA, which freezes all it does not add: the head trains either way
        attach_head(model, services.head)
        description |= {"head": services.head}
    elif head_of(model):
        raise UserError(f"{loaded.source} is a reward model (a {head_of(model)} head, no trained vocabulary "
                        f"layer): `lmforge {trainer}` needs a language model to start from")
    check_layout(dims, args, cfg)
    check_fresh_start(cfg, run)
    check_resume_compatible(run, args, description)
    model.to(info.device)
    dtype, dtype_why = choose_dtype(cfg.training.dtype, info.device, model.num_params(exclude_embeddings=True))
    mesh = dims.build_mesh(info.device.type)
    group = dims.gradient_group_name()
    dist_utils.set_data_group(sub_mesh(mesh, group).get_group() if group else None, dims.gradient_world)
    spec = spec_for_args(args)
    peak, peak_src = peak_flops_per_device(  # MFU is measured against the peak of the dtype in use
        info.device, torch.bfloat16 if dtype == "bfloat16" else torch.float32,
        cfg.metrics.peak_tflops * 1e12 if cfg.metrics.peak_tflops else None)
    fpt = spec.flops_per_token(args, cfg.data.seq_len, adapter_params)
    compile_on, compile_why, compile_key = _choose_compile(cfg, args, dims, dtype, fpt * cfg.data.seq_len, peak,
                                                           info.world_size)
    wrapped = parallelize(model, spec, cfg, dims, mesh, info.device, bf16=dtype == "bfloat16", compile=compile_on)
    if compile_on:
        _mark_when_compiled(model, compile_key)
    optimizer = make_optimizer(wrapped, cfg.optimizer)
    metrics = build_metrics(cfg, info, run, fpt, peak, services.process_start)
    trainable, total = trainable_parameters(model)
    metrics.log_setup({
        "trainer": trainer, "parameters": model.num_params(), "non_embedding_parameters":
        model.num_params(exclude_embeddings=True), "trainable_parameters": trainable,
        "trainable_share": round(trainable / total, 6), "flops_per_token": fpt,
        "peak_tflops_per_device": peak / 1e12, "peak_source": peak_src,
        "world_size": info.world_size, "device": str(info.device), "parallel": dims.kind,
        "mesh": dims.describe_mesh(), "dtype": dtype, "dtype_reason": dtype_why,
        "compile": "on" if compile_on else "off", "compile_reason": compile_why,
        "optimizer": cfg.optimizer.name, "activation_offload": _offload_note(cfg, info.device), "host_memory": host_memory, "threads": torch.get_num_threads(), "run_dir": str(run.root),
        **_router_note(cfg, trainer, args),
    }, cfg.to_toml())
    return Runtime(cfg=cfg, dist=info, dims=dims, mesh=mesh, tokenizer=loaded.tokenizer, model_args=args,
                   spec=spec, raw_model=model, model=wrapped, optimizer=optimizer, metrics=metrics,
                   checkpoints=build_checkpoints(cfg, info, run, metrics, trainer, services), run_dir=run.root,
                   model_source=loaded.source, model_description=description, step_hooks=services.step_hooks,
                   dtype=dtype, adapter_params=adapter_params)
