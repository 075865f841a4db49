"""Everything a trainer needs before its first step, built the same way for every trainer.

``build_runtime`` turns a validated config into a :class:`Runtime`: process group and device,
tokenizer, model (fresh, from a Hugging Face directory, or from an lmforge checkpoint), its
data-parallel wrapper, AdamW, the MetricLogger and the Checkpointer.
"""

from __future__ import annotations

import json
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
from lmforge.models.flops import flops_per_token, peak_flops_per_device, training_flops
from lmforge.models.load import LoadedModel, ModelSource, load_model
from lmforge.models.lora import apply_lora, trainable_parameters
from lmforge.models.model import ModelArgs, Transformer
from lmforge.models.tokenizer import Tokenizer
from lmforge.training.precision import choose_dtype
from lmforge.training.train_step import build_optimizer

StepHook = Callable[["Runtime", Any, Any], None]
"""``hook(rt, state, source)``, called at the very end of every step of the loop."""
SnapshotRoot = Callable[[Config, RunDir, dist_utils.DistInfo], "tuple[Path | None, str]"]
"""Where a fast checkpoint tier lives for this run, or (None, why not)."""


@dataclass
class Runtime:
    """The services every trainer runs on, all built by :func:`build_runtime` and never replaced."""

    cfg: Config
    dist: dist_utils.DistInfo
    tokenizer: Tokenizer
    model_args: ModelArgs
    raw_model: Transformer
    """The unwrapped model (for generation, export and state dicts)."""
    model: nn.Module
    """The model the train step calls: DDP/FSDP-wrapped and/or compiled."""
    optimizer: torch.optim.Optimizer
    metrics: MetricLogger
    checkpoints: CheckpointTiers
    run_dir: Path
    model_source: ModelSource
    """Where the starting weights came from (GRPO rebuilds its reference model from it)."""
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
        return training_flops(self.model_args, document_lengths, self.adapter_params)

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
    """Where a run's starting weights come from: a Hugging Face directory, an lmforge checkpoint, or
    a fresh initialization with the run's seed."""
    m = cfg.model
    if m.from_hf:
        return ModelSource("hf", m.from_hf)
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


def build_runtime(cfg: Config, trainer: str, *, step_hooks: tuple[StepHook, ...] = (),
                  snapshot_root: SnapshotRoot | None = None, snapshot_keep: int = 1,
                  process_start: float | None = None) -> Runtime:
    """Process group, run directory, model, optimizer, MetricLogger and checkpoint tiers.

    ``step_hooks`` run after every step; ``snapshot_root`` adds a fast checkpoint tier;
    ``process_start`` moves the start of goodput accounting earlier (see MetricLogger).
    """
    if cfg.training.threads:
        torch.set_num_threads(cfg.training.threads)
    info = dist_utils.init_distributed(cfg.training.device)
    run = RunDir(cfg.run.dir)
    claim_run_dir(run.root, info.is_main)
    torch.manual_seed(cfg.training.seed)
    loaded = build_model(cfg)
    model, args = loaded.model, loaded.args
    description = loaded.description()
    adapter_params = None
    if cfg.lora.enabled:  # before any wrapper: DDP/FSDP must see which parameters train
        apply_lora(model, cfg.lora)
        adapter_params = trainable_parameters(model)[0]
        description |= {"lora": cfg.lora.model_dump(), "base": str(loaded.source)}
    _check_fresh_start(cfg, run)
    _check_resume_compatible(run, args, description)
    model.to(info.device)
    raw = model
    if cfg.training.activation_checkpointing:
        _apply_activation_checkpointing(model)
    if cfg.training.compile:
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block)
    dtype, dtype_why = choose_dtype(cfg.training.dtype, info.device, raw.num_params(exclude_embeddings=True))
    wrapped = dist_utils.wrap_model(model, cfg.parallel.mode, info, bf16=dtype == "bfloat16")
    o = cfg.optimizer
    optimizer = build_optimizer(wrapped, o.lr, o.weight_decay, (o.beta1, o.beta2), o.eps)
    peak, peak_src = peak_flops_per_device(  # MFU is measured against the peak of the dtype in use
        info.device, torch.bfloat16 if dtype == "bfloat16" else torch.float32,
        cfg.metrics.peak_tflops * 1e12 if cfg.metrics.peak_tflops else None)
    fpt = flops_per_token(args, cfg.data.seq_len, adapter_params)
    bar = progress_bar(cfg.metrics.progress, cfg.training.steps, cfg.training.max_tokens, is_main=info.is_main)
    sinks = [WandbSink.start(run.root, cfg.to_dict())] if cfg.metrics.wandb and info.is_main else []
    metrics = MetricLogger(run.root, rank=info.rank, world_size=info.world_size, log_every=cfg.metrics.log_every,
                           flops_per_token=fpt, peak_flops=peak, tensorboard=cfg.metrics.tensorboard,
                           console=bar.write if bar else None, process_start=process_start, sinks=sinks,
                           progress=bar, defer=True, device=info.device)
    trainable, total = trainable_parameters(raw)
    metrics.log_setup({
        "trainer": trainer, "parameters": raw.num_params(), "non_embedding_parameters":
        raw.num_params(exclude_embeddings=True), "trainable_parameters": trainable,
        "trainable_share": round(trainable / total, 6), "flops_per_token": fpt, "peak_tflops_per_device": peak / 1e12,
        "peak_source": peak_src, "world_size": info.world_size, "device": str(info.device),
        "parallel": cfg.parallel.mode if info.world_size > 1 else "none", "dtype": dtype, "dtype_reason": dtype_why,
        "threads": torch.get_num_threads(), "run_dir": str(run.root),
    }, cfg.to_toml())
    report = lambda line: metrics.record_event("checkpoint_damaged", 0, line)  # noqa: E731
    durable = Checkpointer(run.root, cfg.checkpoint.keep, on_damaged=cfg.checkpoint.on_damaged, report=report)
    fast = None
    if snapshot_root is not None:
        root, why_not = snapshot_root(cfg, run, info)
        if root is None:
            metrics.console(f"{trainer}: fast snapshots off ({why_not})")
        else:
            fast = Checkpointer(run.root, snapshot_keep, on_damaged=cfg.checkpoint.on_damaged, report=report, root=root)
    return Runtime(cfg=cfg, dist=info, tokenizer=loaded.tokenizer, model_args=args, raw_model=raw, model=wrapped,
                   optimizer=optimizer, metrics=metrics, checkpoints=CheckpointTiers(durable, fast),
                   run_dir=run.root, model_source=loaded.source, model_description=description,
                   step_hooks=tuple(step_hooks), dtype=dtype, adapter_params=adapter_params)


def _check_fresh_start(cfg: Config, run: RunDir) -> None:
    """``checkpoint.resume=never`` starts from step 0; in a directory that already holds checkpoints
    the new run's saves would interleave with the old ones (and the newer old ones would win the next
    resume), so it is refused instead of guessing which to delete."""
    if cfg.checkpoint.resume != "never":
        return
    found = list_checkpoints(run.checkpoints)
    if found:
        raise UserError(f"checkpoint.resume=never but run.dir={run.root} already holds checkpoints "
                        f"(newest {found[-1].name}); choose a new run.dir or move {run.checkpoints} away")


def _saved_description(run: RunDir) -> dict[str, Any]:
    """The model description the run's checkpoints were made for: from the newest checkpoint that
    describes itself, else from ``model_args.json`` (older runs); {} when neither can be read."""
    for ckpt in reversed(list_checkpoints(run.checkpoints)):
        try:
            described = json.loads((ckpt / STATE_FILE).read_text()).get("model", {})
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(described, dict) and isinstance(described.get("model_args"), dict):
            return described
    try:
        saved = json.loads(run.model_args.read_text())
    except (OSError, ValueError, AttributeError):
        return {}
    return saved if isinstance(saved, dict) and isinstance(saved.get("model_args", {}), dict) else {}


def _check_resume_compatible(run: RunDir, args: ModelArgs, description: dict[str, Any]) -> None:
    """Refuse to resume a run directory whose checkpoints were made for another model shape, or for
    other LoRA adapters or another base model (a LoRA checkpoint holds only the adapters)."""
    run_dir = run.root
    if not list_checkpoints(run.checkpoints):
        return
    described = _saved_description(run)
    if described:
        _check_same_adapters(run_dir, described, description)
    saved = described.get("model_args", {})
    new = args.to_dict()
    diff = sorted((k for k in new if k in saved and saved[k] != new[k]), key=lambda k: k != "vocab_size")
    if diff and diff[0] == "vocab_size":
        raise UserError(f"run.dir={run_dir}: the tokenizer's vocabulary ({new['vocab_size']}) does not match the "
                        f"checkpoints' ({saved['vocab_size']}); model.tokenizer must be the one the run started with")
    if diff:
        k = diff[0]
        raise UserError(f"run.dir={run_dir} holds checkpoints of another model (model {k}: {saved[k]} there, "
                        f"{new[k]} now); use a new run.dir or checkpoint.resume=never")


def _check_same_adapters(run_dir: Path, saved: dict[str, Any], now: dict[str, Any]) -> None:
    if ("lora" in saved) != ("lora" in now):
        had = "LoRA adapters" if "lora" in saved else "full weights"
        raise UserError(f"run.dir={run_dir} holds checkpoints of {had}; set lora.enabled="
                        f"{'true' if 'lora' in saved else 'false'} to resume it, or use a new run.dir")
    if "lora" not in saved:
        return
    if saved["lora"] != now["lora"]:
        k = next(k for k in now["lora"] if saved["lora"].get(k) != now["lora"][k])
        raise UserError(f"run.dir={run_dir} holds adapters with lora.{k}={saved['lora'].get(k)!r}, "
                        f"not {now['lora'][k]!r}; use the same [lora] settings or a new run.dir")
    if saved.get("base") != now.get("base"):
        raise UserError(f"run.dir={run_dir} holds adapters for the base model {saved.get('base')}, not "
                        f"{now.get('base')}; start from the same model (model.from_hf / model.from_checkpoint)")


def _apply_activation_checkpointing(model: Transformer) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block)
