"""Everything a trainer needs before its first step, built the same way for every trainer.

``build_runtime`` turns a validated config into a :class:`Runtime`: process group and device,
tokenizer, model (fresh, from a Hugging Face directory, or from an lmforge checkpoint), its
data-parallel wrapper, AdamW, the MetricLogger and the Checkpointer.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from lmforge.training import distributed as dist_utils
from lmforge.training.checkpoint import Checkpointer, load_model_weights, resolve_checkpoint
from lmforge.config import Config
from lmforge.errors import UserError
from lmforge.models.flops import flops_per_token, peak_flops_per_device
from lmforge.metrics import MetricLogger
from lmforge.models.model import ModelArgs, Transformer, model_args_for
from lmforge.metrics.progress import progress_bar
from lmforge.training.runlock import hold_run_lock
from lmforge.metrics.sinks import WandbSink
from lmforge.models.tokenizer import Tokenizer, load_tokenizer
from lmforge.training.train_step import build_optimizer

MODEL_ARGS_FILE = "model_args.json"


@dataclass
class Runtime:
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
    checkpointer: Checkpointer
    run_dir: Path
    extras: dict[str, Any] = field(default_factory=dict)
    step_hooks: list[Callable[[Any, Any], None]] = field(default_factory=list)
    """Called as ``hook(progress, loader)`` at the very end of every step of the shared loop."""

    def autocast(self) -> Any:
        if self.cfg.training.dtype == "bfloat16":
            return torch.autocast(self.dist.device.type, dtype=torch.bfloat16)
        return nullcontext()

    @property
    def tokens_per_sample(self) -> int:
        return self.cfg.data.seq_len


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


def build_model(cfg: Config) -> tuple[Transformer, ModelArgs, Tokenizer]:
    """Fresh model from a named size, or weights from a HF directory / an lmforge checkpoint."""
    m = cfg.model
    overrides = {k: v for k, v in {
        "dim": m.dim, "n_layers": m.n_layers, "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads,
        "ffn_hidden_dim": m.ffn_hidden_dim, "max_seq_len": m.max_seq_len, "tie_embeddings": m.tie_embeddings,
    }.items() if v is not None}
    if m.from_hf:
        from lmforge.models.hf import load_hf_model

        tokenizer = load_tokenizer(m.tokenizer if m.tokenizer != "byte" else m.from_hf)
        model = load_hf_model(m.from_hf)
        args = model.args
    elif m.from_checkpoint:
        ckpt = resolve_checkpoint(m.from_checkpoint)
        source_run = ckpt.parent.parent
        saved = read_model_args(source_run)
        tokenizer = load_tokenizer(saved.get("tokenizer", m.tokenizer))
        args = ModelArgs.from_dict(saved["model_args"])
        model = Transformer(args)
        load_model_weights(ckpt, model)
    else:
        tokenizer = load_tokenizer(m.tokenizer)
        args = model_args_for(m.size, tokenizer.vocab_size, **overrides)
        model = Transformer(args)
        model.init_weights(seed=cfg.training.seed)
    if tokenizer.vocab_size > args.vocab_size:
        raise UserError(f"tokenizer vocabulary ({tokenizer.vocab_size}) does not fit the model's "
                        f"vocab_size ({args.vocab_size}): model.tokenizer does not match the checkpoint")
    if cfg.data.seq_len > args.max_seq_len:
        raise UserError(f"data.seq_len={cfg.data.seq_len} is longer than the model allows "
                        f"(max_seq_len={args.max_seq_len})")
    return model, args, tokenizer


def read_model_args(run_dir: Path) -> dict[str, Any]:
    f = Path(run_dir) / MODEL_ARGS_FILE
    if not f.is_file():
        raise UserError(f"{run_dir}: not an lmforge run directory (no {MODEL_ARGS_FILE})")
    return json.loads(f.read_text())


def build_runtime(cfg: Config, trainer: str) -> Runtime:
    if cfg.training.threads:
        torch.set_num_threads(cfg.training.threads)
    info = dist_utils.init_distributed(cfg.training.device)
    run_dir = Path(cfg.run.dir)
    claim_run_dir(run_dir, info.is_main)
    torch.manual_seed(cfg.training.seed)
    model, args, tokenizer = build_model(cfg)
    _check_resume_compatible(run_dir, args)
    model.to(info.device)
    raw = model
    if cfg.training.activation_checkpointing:
        _apply_activation_checkpointing(model)
    if cfg.training.compile:
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block)
    wrapped = dist_utils.wrap_model(model, cfg.parallel.mode, info, bf16=cfg.training.dtype == "bfloat16")
    o = cfg.optimizer
    optimizer = build_optimizer(wrapped, o.lr, o.weight_decay, (o.beta1, o.beta2), o.eps)
    peak, peak_src = peak_flops_per_device(
        info.device, torch.bfloat16 if cfg.training.dtype == "bfloat16" else torch.float32,
        cfg.metrics.peak_tflops * 1e12 if cfg.metrics.peak_tflops else None)
    fpt = flops_per_token(args, cfg.data.seq_len)
    bar = progress_bar(cfg.metrics.progress, cfg.training.steps, cfg.training.max_tokens, is_main=info.is_main)
    metrics = MetricLogger(run_dir, rank=info.rank, world_size=info.world_size, log_every=cfg.metrics.log_every,
                           flops_per_token=fpt, peak_flops=peak, tensorboard=cfg.metrics.tensorboard,
                           console=bar.write if bar else None)
    metrics.progress = bar
    if cfg.metrics.wandb and info.is_main:
        metrics.sinks.append(WandbSink.start(run_dir, cfg.to_dict()))
    if info.is_main:
        (run_dir / "config.toml").write_text(cfg.to_toml())
        (run_dir / MODEL_ARGS_FILE).write_text(json.dumps(
            {"model_args": args.to_dict(), "tokenizer": _tokenizer_spec(cfg)}, indent=2))
    metrics.log_setup({
        "trainer": trainer, "parameters": raw.num_params(), "non_embedding_parameters":
        raw.num_params(exclude_embeddings=True), "flops_per_token": fpt, "peak_tflops_per_device": peak / 1e12,
        "peak_source": peak_src, "world_size": info.world_size, "device": str(info.device),
        "parallel": cfg.parallel.mode if info.world_size > 1 else "none", "dtype": cfg.training.dtype,
        "threads": torch.get_num_threads(), "run_dir": str(run_dir),
    }, cfg.to_toml())
    return Runtime(cfg=cfg, dist=info, tokenizer=tokenizer, model_args=args, raw_model=raw, model=wrapped,
                   optimizer=optimizer, metrics=metrics, checkpointer=Checkpointer(
                       run_dir, cfg.checkpoint.keep, on_damaged=cfg.checkpoint.on_damaged,
                       report=lambda line: metrics.record_event("checkpoint_damaged", 0, line)),
                   run_dir=run_dir)


def _tokenizer_spec(cfg: Config) -> str:
    if cfg.model.from_hf and cfg.model.tokenizer == "byte":
        return str(Path(cfg.model.from_hf).resolve())
    if cfg.model.from_checkpoint:
        ckpt = resolve_checkpoint(cfg.model.from_checkpoint)
        return read_model_args(ckpt.parent.parent).get("tokenizer", cfg.model.tokenizer)
    return cfg.model.tokenizer if cfg.model.tokenizer == "byte" else str(Path(cfg.model.tokenizer).resolve())


def _check_resume_compatible(run_dir: Path, args: ModelArgs) -> None:
    """Refuse to resume a run directory whose checkpoints were made for another model shape."""
    f = run_dir / MODEL_ARGS_FILE
    if not f.is_file() or not (run_dir / "checkpoints").is_dir():
        return
    saved = json.loads(f.read_text()).get("model_args", {})
    new = args.to_dict()
    diff = sorted((k for k in new if k in saved and saved[k] != new[k]), key=lambda k: k != "vocab_size")
    if diff and diff[0] == "vocab_size":
        raise UserError(f"run.dir={run_dir}: the tokenizer's vocabulary ({new['vocab_size']}) does not match the "
                        f"checkpoints' ({saved['vocab_size']}); model.tokenizer must be the one the run started with")
    if diff:
        k = diff[0]
        raise UserError(f"run.dir={run_dir} holds checkpoints of another model (model {k}: {saved[k]} there, "
                        f"{new[k]} now); use a new run.dir or checkpoint.resume=never")


def _apply_activation_checkpointing(model: Transformer) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block)
