"""``lmforge plan``: the layouts of a mesh that fit a model's training step, best first.

The model, batch and dtype come from the same config keys as a training run (``--config FILE``,
``--model.size``, ``--model.*``, ``--model.from_hf=DIR``, ``--data.seq_len``,
``--training.micro_batch_size``, ``--training.global_batch_size``, ``--training.dtype``,
``--optimizer.name``), so a plan describes the run those keys would start. Only a Hugging Face
directory's ``config.json`` is read; no weights are loaded.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from lmforge.errors import UserError
from lmforge.models.args import ModelArgs
from lmforge.parallel.dims import ParallelDims
from lmforge.planning.planner import MemoryEstimate, candidate_layouts, estimate_memory

GB = 1e9


def _model_args(cfg: Any, vocab_size: int | None) -> ModelArgs:
    """The run's ``ModelArgs`` without building the model: a Hugging Face config.json, or the size with
    the ``model.*`` overrides and the tokenizer's vocabulary (``vocab_size`` wins over both)."""
    m = cfg.model
    if m.from_hf:
        from lmforge.models.hf_config import args_from_hf_config

        path = Path(m.from_hf) / "config.json"
        if not path.is_file():
            raise UserError(f"model.from_hf={m.from_hf}: no config.json there (lmforge plan reads a local directory)")
        try:
            hf = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as e:
            raise UserError(f"{path}: unreadable ({e})") from None
        if not isinstance(hf, dict):
            raise UserError(f"{path}: expected a JSON object of model settings, found a JSON {type(hf).__name__}")
        args = args_from_hf_config(hf, path)
        if vocab_size is not None:
            args = ModelArgs.from_dict({**args.to_dict(), "vocab_size": vocab_size})
        return args
    from lmforge.models.args import model_args_for
    from lmforge.models.tokenizer import load_tokenizer

    overrides = {k: v for k, v in {
        "dim": m.dim, "n_layers": m.n_layers, "n_heads": m.n_heads, "n_kv_heads": m.n_kv_heads,
        "ffn_hidden_dim": m.ffn_hidden_dim, "max_seq_len": m.max_seq_len, "tie_embeddings": m.tie_embeddings,
    }.items() if v is not None}
    vocab = vocab_size if vocab_size is not None else load_tokenizer(m.tokenizer).vocab_size
    return model_args_for(m.size, vocab, **overrides)


def _rank_key(row: dict[str, Any]) -> tuple:
    """Best first: fits without checkpointing, then with it; then the least model parallelism (pipeline
    bubbles and per-layer tensor/context collectives cost more than FSDP's overlapped gathers), then
    the smallest peak."""
    lay: ParallelDims = row["layout"]
    fits = 0 if row["fits"] else 1 if row["fits_checkpointed"] else 2
    return (fits, lay.tp * lay.cp * lay.pp, lay.pp, lay.cp, lay.tp, lay.dp_shard, row["total"].total)


def plan_rows(args: ModelArgs, devices: int, seq_len: int, micro_batch: int, global_batch: int, dtype: str,
              optimizer: str, device_bytes: float, chunk: int) -> list[dict[str, Any]]:
    """One row per candidate layout, with and without activation checkpointing, best first."""
    rows = []
    for lay in candidate_layouts(args, devices, seq_len):
        micro = max(1, global_batch // (lay.batch_shares * micro_batch))
        kw = dict(microbatches=micro, optimizer=optimizer, loss_chunk_tokens=chunk)
        plain: MemoryEstimate = estimate_memory(args, lay, seq_len, micro_batch, dtype, False, **kw)
        ckpt: MemoryEstimate = estimate_memory(args, lay, seq_len, micro_batch, dtype, True, **kw)
        rows.append({"layout": lay, "microbatches": micro, "total": plain, "checkpointed": ckpt,
                     "fits": plain.total <= device_bytes, "fits_checkpointed": ckpt.total <= device_bytes})
    return sorted(rows, key=_rank_key)


def _table(rows: list[dict[str, Any]]) -> str:
    head = ("layout", "dp_rep", "dp_shd", "tp", "cp", "pp", "ep", "params", "grads", "optim", "act", "act(ckpt)",
            "total", "total(ckpt)", "fits")
    lines = []
    for r in rows:
        lay, e, c = r["layout"], r["total"], r["checkpointed"]
        fits = "yes" if r["fits"] else "ckpt" if r["fits_checkpointed"] else "no"
        lines.append((lay.describe(), *(str(getattr(lay, n)) for n in ("dp_replicate", "dp_shard", "tp", "cp", "pp",
                                                                          "ep")),
                      *(f"{v / GB:.2f}" for v in (e.params, e.grads, e.optimizer, e.activations, c.activations,
                                                  e.total, c.total)), fits))
    widths = [max(len(x) for x in col) for col in zip(head, *lines)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([fmt(head), fmt(tuple("-" * w for w in widths)), *map(fmt, lines)])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="lmforge plan", description="Memory per device of every parallel layout of "
                                "--devices devices for a model's train step, and which fit, best first.",
                                epilog="Any config key can be given: --model.size=8b --data.seq_len=8192 "
                                       "--training.micro_batch_size=1 --training.dtype=bfloat16")
    p.add_argument("--config", help="TOML config file (configs/*.toml)")
    p.add_argument("--devices", type=int, required=True, help="devices in the mesh (the product of the degrees)")
    p.add_argument("--device-memory-gb", type=float, default=80.0, help="memory of one device in GB (default 80)")
    p.add_argument("--vocab-size", type=int, default=None, help="vocabulary size (default: the tokenizer's, or "
                   "the Hugging Face config's)")
    p.add_argument("--top", type=int, default=20, help="rows to print (default 20; 0: all)")
    p.add_argument("--json", action="store_true", help="print every row as JSON instead of a table")
    a, overrides = p.parse_known_args(argv)
    if a.devices < 1:
        raise UserError(f"--devices must be at least 1, got {a.devices}")
    if not math.isfinite(a.device_memory_gb) or a.device_memory_gb <= 0:  # argparse's float() reads nan and inf
        raise UserError(f"--device-memory-gb must be a positive finite number, got {a.device_memory_gb}")
    if a.top < 0:
        raise UserError(f"--top must be 0 (all rows) or more, got {a.top}")
    if a.vocab_size is not None and a.vocab_size < 1:
        raise UserError(f"--vocab-size must be at least 1, got {a.vocab_size}")
    from lmforge.config import Config, load_config

    cfg = load_config(Config, a.config, overrides)
    args = _model_args(cfg, a.vocab_size)
    t, seq_len = cfg.training, cfg.data.seq_len
    if seq_len > args.max_seq_len:
        raise UserError(f"data.seq_len={seq_len} is longer than the model allows (max_seq_len={args.max_seq_len})")
    dtype = "bfloat16" if t.dtype == "auto" else t.dtype  # auto is bf16 on every GPU that has it
    rows = plan_rows(args, a.devices, seq_len, t.micro_batch_size, t.global_batch_size, dtype, cfg.optimizer.name,
                     a.device_memory_gb * GB, t.loss_chunk_tokens)
    if a.json:
        print(json.dumps([{"layout": vars(r["layout"]) | {"describe": r["layout"].describe()},
                           "microbatches": r["microbatches"], "fits": r["fits"],
                           "fits_checkpointed": r["fits_checkpointed"], "bytes": r["total"].to_dict(),
                           "bytes_checkpointed": r["checkpointed"].to_dict()} for r in rows], indent=1))
        return 0
    fitting = sum(r["fits"] or r["fits_checkpointed"] for r in rows)
    print(f"model: {cfg.model.from_hf or cfg.model.size}, {sum_params(args) / 1e9:.2f}B parameters, vocab "
          f"{args.vocab_size}; seq_len {seq_len}, micro batch {t.micro_batch_size}, global batch "
          f"{t.global_batch_size}, {dtype}, {cfg.optimizer.name}; {a.devices} devices of {a.device_memory_gb:g} GB")
    print(f"{len(rows)} layouts, {fitting} fit (GB per device at the step's peak, worst pipeline stage; "
          f"ckpt: only with activation checkpointing)")
    if rows:
        print(_table(rows[:a.top] if a.top else rows))
    return 0


def sum_params(args: ModelArgs) -> int:
    from lmforge.planning.planner import param_counts

    return param_counts(args).total
