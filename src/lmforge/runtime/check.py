"""Phase 1 of a run: check everything the config alone can settle, and the run directory against the
run about to start. Pure: nothing is written, no process group exists yet; a mistake is one line here
instead of a failure after the model is loaded.

A run directory that holds checkpoints continues from them (``checkpoint.resume=auto``); the checks here
refuse, in one line naming the key to change, a start that would resume the wrong thing: a fresh start
(``resume=never``) whose saves would interleave with the old ones (:func:`check_run`, from the config
alone), checkpoints of another model shape or tokenizer, other LoRA adapters or another base
(:func:`check_resume_compatible`, called by the model phase once the model's shape is known).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.checkpoint import STATE_FILE, RunDir, list_checkpoints
from lmforge.config import Config
from lmforge.errors import UserError
from lmforge.models.args import ModelArgs
from lmforge.models.load import ModelSource
from lmforge.models.qlora import check_qlora
from lmforge.optim.optimizers import check_optimizer
from lmforge.parallel.dims import ParallelDims


@dataclass(frozen=True)
class RunPlan:
    """What the config settles before anything runs."""

    layout: ParallelDims
    """How the launched processes divide the work."""
    source: ModelSource
    """Where the starting weights come from."""
    run: RunDir
    """The run directory (``run.dir``), checked for a fresh start; claimed by the world."""
    config_toml: str
    """The run's config as TOML: what the setup line records and ``config.toml`` in the run directory holds."""


def check_run(cfg: Config) -> RunPlan:
    """The run's plan: its layout over the launched processes, its model's source, its run directory and
    its config's text, once every start-up rule that needs no process group and no model holds (a fresh
    start in a directory of checkpoints, the LoRA and optimizer rules that depend on the layout).

    The world size is read from torchrun's environment (``WORLD_SIZE``), so the layout is checked
    before any process group exists; the later phases take the plan instead of working it out again.
    """
    run = RunDir(cfg.run.dir)
    check_fresh_start(cfg.checkpoint.resume, run)
    layout = ParallelDims.from_config(cfg.parallel, int(os.environ.get("WORLD_SIZE", "1")))
    source = ModelSource.from_section(cfg.model, cfg.training.seed)
    check_qlora(cfg.lora, sharded=bool(layout.shards))
    check_optimizer(cfg.optimizer, lora=cfg.lora.enabled, sharded=bool(layout.shards))
    return RunPlan(layout, source, run, cfg.to_toml())


def check_fresh_start(resume: str, run: RunDir) -> None:
    """``checkpoint.resume=never`` starts from step 0; in a directory that already holds checkpoints
    the new run's saves would interleave with the old ones (and the newer old ones would win the next
    resume), so it is refused instead of guessing which to delete."""
    if resume != "never":
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


def check_resume_compatible(run: RunDir, args: ModelArgs, description: dict[str, Any]) -> None:
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
    saved_lora = {"quantize": "none"} | saved["lora"]  # checkpoints from before lora.quantize existed
    if saved_lora != now["lora"]:
        k = next(k for k in now["lora"] if saved_lora.get(k) != now["lora"][k])
        raise UserError(f"run.dir={run_dir} holds adapters with lora.{k}={saved_lora.get(k)!r}, "
                        f"not {now['lora'][k]!r}; use the same [lora] settings or a new run.dir")
    if "base_weights" in saved:  # the weights decide, not the path: a moved base is the same base
        if saved["base_weights"] != now.get("base_weights"):
            raise UserError(f"run.dir={run_dir} holds adapters for the base model {saved.get('base')} (weights "
                            f"{saved['base_weights']}); {now.get('base')} has other weights "
                            f"({now.get('base_weights')}): start from the same base weights")
    elif saved.get("base") != now.get("base"):
        raise UserError(f"run.dir={run_dir} holds adapters for the base model {saved.get('base')}, not "
                        f"{now.get('base')}; start from the same model (model.from_hf / model.from_checkpoint)")
