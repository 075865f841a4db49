"""lmforge from Python: train a recipe, load a model, sample from it, export it.

``lmforge.train(recipe, config, overrides)`` runs exactly what ``lmforge RECIPE --config FILE
--key=value`` runs (the CLI is a thin layer over it) and returns a :class:`Run`. :class:`Trainer`
also takes the parts a Python user holds in memory (a model, record lists or ``datasets.Dataset``
objects, reward functions, callbacks); each is written into or registered for the run, so the run
itself reads them exactly as it reads files named in a config.

A training changes process-wide state (torch threads and RNG, the default dtype, environment
variables, ``sys.path``, the run directory's lock, a process group it created); all of it is put back
afterwards, so two trainings in one process give the results of two separate CLI runs.

Errors in the user's input raise :class:`lmforge.errors.UserError` (a bad config:
:class:`~lmforge.errors.ConfigError`), never ``SystemExit``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

from lmforge.errors import ConfigError, UserError

if TYPE_CHECKING:
    from lmforge.config import Config
    from lmforge.models.model import Transformer
    from lmforge.models.tokenizer import Tokenizer
    from lmforge.recipes.base import Recipe

__all__ = ["Run", "Trainer", "Loaded", "train", "load", "generate", "export"]


@dataclass
class Run:
    """What a training left: its directory and its final metrics (read back from ``metrics.jsonl``)."""

    recipe: str
    run_dir: Path
    step: int
    """The last optimizer step the run completed."""
    train: dict[str, Any] | None = None
    """The last ``train`` line (loss, learning rate, throughput, ...), None if none was logged."""
    eval: dict[str, Any] | None = None
    """The last ``eval`` line, None if the run never evaluated."""

    @property
    def metrics(self) -> dict[str, dict[str, Any] | None]:
        return {"train": self.train, "eval": self.eval}

    def records(self, kind: str | None = None) -> list[dict[str, Any]]:
        """Every line of the run's ``metrics.jsonl`` (of ``kind``: setup, train, eval, stop, ...)."""
        from lmforge.metrics.records import read_records

        return list(read_records(self.run_dir, kind))


def train(recipe: str, config: str | Path | Mapping[str, Any] | None = None,
          overrides: Mapping[str, Any] | None = None, *, started: float | None = None) -> Run:
    """Run ``recipe`` (``pretrain``, ``sft``, ``dpo``, ``grpo``, ...: ``lmforge.recipes.recipes()``).

    ``config`` is a TOML file or a dict of sections (``{"training": {"steps": 3}}``); ``overrides``
    go on top, as dotted keys (``{"training.steps": 3}``) or nested dicts, with the values the TOML
    would hold. The same as ``lmforge RECIPE --config FILE --training.steps=3``. ``started`` (default:
    this call) is when goodput's ``setup`` begins; the CLI passes its process's start, so the
    interpreter's start and the imports count as the run's setup.
    """
    return Trainer(recipe, config=config, overrides=overrides).train(started=started)


class Trainer:
    """A recipe's run with in-memory parts; ``.train()`` runs it and returns a :class:`Run`.

    * ``model``: where training starts. A path (a Hugging Face directory, a ``.gguf`` file, a Hub name,
      an lmforge run or checkpoint), a ``transformers.PreTrainedModel`` or an lmforge ``Transformer``.
      An in-memory model is saved as a Hugging Face directory inside the run directory
      (``RUN_DIR/start_model``) and read through ``model.from_hf`` like any other, so checkpoints, a
      frozen reference (DPO, GRPO's KL) and ``export`` find it again. ``tokenizer`` goes with it: a
      ``transformers`` tokenizer, an lmforge tokenizer, or None for ``model.tokenizer`` (byte-level by
      default).
    * ``train_dataset`` / ``eval_dataset``: lists of records (dicts in lmforge's record formats:
      docs/data.md) or ``datasets.Dataset`` objects, written as JSONL into ``RUN_DIR/inputs/`` and named
      by ``data.train`` / ``data.validation``.
    * ``reward_funcs`` (GRPO): callables ``f(prompts, completions, **fields) -> list[float | None]``
      (:mod:`lmforge.rl.rewards`), built-in reward names, or a dict name -> callable; they replace
      ``grpo.rewards`` and are registered under their names only while the run lasts.
    * ``callbacks``: called with every ``train`` metrics line (a dict, as written to ``metrics.jsonl``).
    """

    def __init__(self, recipe: str, config: str | Path | Mapping[str, Any] | None = None,
                 overrides: Mapping[str, Any] | None = None, *, model: Any = None, tokenizer: Any = None,
                 train_dataset: Any = None, eval_dataset: Any = None,
                 reward_funcs: Any = None, callbacks: Iterable[Callable[[dict[str, Any]], None]] = ()) -> None:
        from lmforge.recipes import get_recipe

        self.recipe: Recipe = get_recipe(recipe)
        from lmforge.config import merge_config

        self.data = merge_config(_config_data(config), _nest(overrides or {}))
        self.source = str(config) if isinstance(config, (str, Path)) else "command line" if config is None else "config"
        self.model, self.tokenizer = model, tokenizer
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.rewards = _reward_table(reward_funcs)
        self.callbacks = list(callbacks)
        if self.rewards and self.recipe.name != "grpo":
            raise UserError(f"reward_funcs are for the grpo recipe, not {self.recipe.name!r}")
        self.cfg: Config = self._validate()  # every key is checked now, before anything is written

    def _config_dict(self) -> dict[str, Any]:
        data = json.loads(json.dumps(self.data, default=str))  # a copy: nothing below changes self.data
        if self.rewards:
            data.setdefault("grpo", {})["rewards"] = list(self.rewards)
        return data

    def _validate(self, data: dict[str, Any] | None = None) -> Config:
        from lmforge.config import validate_config

        return validate_config(self.recipe.config, self._config_dict() if data is None else data, self.source)

    def train(self, *, started: float | None = None) -> Run:
        """Write the in-memory parts into the run directory, run the recipe, put process state back
        (``started``: as for :func:`train`)."""
        started = time.time() if started is None else started
        run_dir = Path(self.cfg.run.dir)
        data = self._config_dict()
        inputs = run_dir / "inputs"
        if self.train_dataset is not None:
            data.setdefault("data", {})["train"] = str(write_jsonl(self.train_dataset, inputs / "train.jsonl"))
        if self.eval_dataset is not None:
            data.setdefault("data", {})["validation"] = str(write_jsonl(self.eval_dataset, inputs / "validation.jsonl"))
        if self.model is not None:
            data.setdefault("model", {}).update(_model_keys(self.model, self.tokenizer, run_dir / "start_model",
                                                            data.get("model", {}).get("tokenizer", "byte")))
        cfg = self._validate(data)
        return run_recipe_isolated(self.recipe, cfg, self.rewards, self.callbacks, started)


def run_recipe_isolated(recipe: Recipe, cfg: Config, rewards: Mapping[str, Callable[..., Any]] = {},
                        callbacks: Sequence[Callable[[dict[str, Any]], None]] = (),
                        started: float | None = None) -> Run:
    """``run_recipe(recipe, cfg)`` with ``rewards`` registered and ``callbacks`` hooked for its
    duration, inside :func:`process_state_restored`; the :class:`Run` read back from its metrics.
    ``started`` (default: now) is when goodput's ``setup`` begins."""
    from lmforge.metrics import logger
    from lmforge.recipes.skeleton import run_recipe
    from lmforge.rl.rewards import BUILTIN_REWARDS

    started = time.time() if started is None else started

    def on_record(record: dict[str, Any]) -> None:
        if record.get("kind") == "train":
            for fn in callbacks:
                fn(dict(record))

    with ExitStack() as stack:
        stack.enter_context(process_state_restored(cfg.run.dir))
        stack.enter_context(_registered(BUILTIN_REWARDS, dict(rewards)))
        # goodput's setup starts with this call, not with the process (an earlier run is not this one's setup)
        stack.enter_context(_registered(vars(logger), {"PROCESS_START": started}))
        if callbacks:
            stack.enter_context(_appended(logger.RECORD_HOOKS, on_record))
        rt = run_recipe(recipe, cfg)
        run_dir = Path(rt.world.run_dir)
        # Free the model while the process group is still registered: a DDP reducer that holds the last
        # reference to a gloo group would destroy it with the GIL held, joining worker threads that may
        # need the GIL to free their finished work, and the rank would hang at exit.
        del rt
        gc.collect()
    return read_run(recipe.name, run_dir)


def read_run(recipe: str, run_dir: Path) -> Run:
    """The :class:`Run` of ``run_dir`` from its ``metrics.jsonl``: the last train and eval lines, the step
    of the last stop record (else of the last train line)."""
    from lmforge.metrics.records import read_records

    last: dict[str, dict[str, Any]] = {}
    for record in read_records(run_dir):
        last[record.get("kind", "")] = record
    stop = last.get("stop") or last.get("train") or {}
    return Run(recipe, run_dir, int(stop.get("step", 0)), last.get("train"), last.get("eval"))


@contextmanager
def process_state_restored(run_dir: str | Path) -> Iterator[None]:
    """Put back what a training changes for the whole process: torch's thread count, default dtype,
    float32 matmul precision and RNG states (CPU and CUDA; Python's and NumPy's too), environment
    variables, ``sys.path``, the working directory, the run directory's lock (if the run took it) and
    the process group (if the run created it).

    The ranks a run sums over are held by its world (``rt.world.dist.reduce``), not by the process, so
    nothing of them outlives the run.

    Not undone: allocator settings of ``training.release_host_memory`` (they change speed and memory,
    never results), compiled graphs cached by ``torch.compile`` and the registry of model families.
    """
    import random

    import numpy as np
    import torch
    import torch.distributed as dist

    from lmforge import distributed as dist_utils
    from lmforge.checkpoint.runlock import holds_run_lock, release_run_lock

    threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    matmul = torch.get_float32_matmul_precision()
    rng, py_rng, np_rng = torch.get_rng_state(), random.getstate(), np.random.get_state()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    cuda_rng = torch.cuda.get_rng_state_all() if cuda else None
    cuda_device = torch.cuda.current_device() if cuda else None
    env, path, cwd = dict(os.environ), list(sys.path), os.getcwd()
    had_group = dist.is_available() and dist.is_initialized()

    def holds() -> bool:
        try:
            return holds_run_lock(run_dir)
        except OSError:  # a run.dir the file system refuses (the run itself says so, in one line)
            return False

    had_lock = holds()
    try:
        yield
    finally:
        if not had_group and dist.is_available() and dist.is_initialized():
            dist_utils.shutdown()
        if not had_lock and holds():
            release_run_lock(run_dir)
        torch.set_num_threads(threads)
        torch.set_default_dtype(dtype)
        torch.set_float32_matmul_precision(matmul)
        torch.set_rng_state(rng)
        random.setstate(py_rng)
        np.random.set_state(np_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
            torch.cuda.set_device(cuda_device)
        for key in set(os.environ) - set(env):
            del os.environ[key]
        os.environ.update({k: v for k, v in env.items() if os.environ.get(k) != v})
        sys.path[:] = path
        if os.getcwd() != cwd:
            os.chdir(cwd)


class Loaded(NamedTuple):
    """A model ready to sample from, with its tokenizer (unpacks as ``model, tokenizer = ...``)."""

    model: Transformer
    tokenizer: Tokenizer


def load(path: str | Path, *, device: str = "cpu", tokenizer: str = "byte") -> Loaded:
    """The model (eval mode, fp32, on ``device``) and tokenizer at ``path``: a run or checkpoint
    directory, a Hugging Face directory or Hub name, or a ``.gguf`` file (``tokenizer``: its Hugging
    Face tokenizer directory). What ``lmforge generate`` loads."""
    from lmforge.inference import load_for_inference

    return Loaded(*load_for_inference(path, device=device, tokenizer=tokenizer))


def generate(model: Any, prompts: str | Sequence[str], *, tokenizer: Any = None, max_new_tokens: int = 64,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, chat: bool = False) -> Any:
    """Continue ``prompts`` (greedy at temperature 0) and return the new text, a list for a list.

    ``model`` is a path (:func:`load` reads it), what :func:`load` returned, or an lmforge
    ``Transformer`` with its ``tokenizer``. ``chat`` wraps each prompt in the model's chat template.
    The same as ``lmforge generate PATH --prompt ... --max-new-tokens ... --temperature ...``.
    """
    from lmforge.inference import sample_texts

    if isinstance(model, (str, Path)):
        model, tokenizer = load(model, tokenizer=tokenizer or "byte")
    elif isinstance(model, tuple):
        model, tokenizer = model
    if tokenizer is None:
        raise UserError("generate: give the tokenizer with an in-memory model (or pass what lmforge.load returned)")
    one = isinstance(prompts, str)
    texts = sample_texts(model, tokenizer, [prompts] if one else list(prompts), max_new_tokens=max_new_tokens,
                         temperature=temperature, top_p=top_p, seed=seed, chat=chat)
    return texts[0] if one else texts


def export(run_dir: str | Path, *, hf: str | Path | None = None, gguf: str | Path | None = None,
           gguf_type: str = "f16", adapter: str | Path | None = None,
           base: str | Path | None = None) -> dict[str, Path]:
    """Write a run or checkpoint as a Hugging Face directory (``hf``), a GGUF file (``gguf``) and/or a
    LoRA run's PEFT adapter (``adapter``, its base model into ``base``); returns what was written by
    kind. The same as ``lmforge export``."""
    if not hf and not gguf and not adapter:
        raise UserError("export: give hf=OUT_DIR, gguf=FILE and/or adapter=OUT_DIR")
    if base and not adapter:
        raise UserError("export: base goes with adapter")
    from lmforge.exporters import export_adapter, export_gguf, export_hf

    out: dict[str, Path] = {}
    if gguf:  # first: it checks its arguments (type, file) before anything is written
        out["gguf"] = export_gguf(run_dir, gguf, gguf_type)
    if hf:
        out["hf"] = export_hf(run_dir, hf)
    if adapter:
        out["adapter"] = export_adapter(run_dir, adapter, base)
        if base:
            out["base"] = Path(base)
    return out


# ---------------------------------------------------------------------------------------------- helpers
def _config_data(config: str | Path | Mapping[str, Any] | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, (str, Path)):
        from lmforge.config import read_toml

        return read_toml(config)
    if isinstance(config, Mapping):
        return _nest(config)
    raise ConfigError(f"config must be a TOML path or a dict of sections, got a {type(config).__name__}")


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"training.steps": 3, "data": {"seq_len": 64}}`` -> nested dicts of sections."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"config key {key!r}: keys are strings such as 'training.steps'")
        node = out
        parts = key.replace("-", "_").split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config key `{key}` conflicts with another key")
        if isinstance(value, Mapping):
            _merge_into(node.setdefault(parts[-1], {}), _nest(value))
        else:
            node[parts[-1]] = value
    return out


def _merge_into(base: dict[str, Any], extra: Mapping[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge_into(base[key], value)
        else:
            base[key] = value


def write_jsonl(records: Any, path: Path) -> Path:
    """A list of record dicts or a ``datasets.Dataset`` as one JSON object per line (absolute path)."""
    rows = records.to_list() if hasattr(records, "to_list") and not isinstance(records, list) else records
    if not isinstance(rows, (list, tuple)) or not all(isinstance(r, Mapping) for r in rows):
        raise UserError("a dataset must be a list of dicts (records, docs/data.md) or a datasets.Dataset")
    if not rows:
        raise UserError("a dataset given to lmforge.Trainer is empty")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(dict(row), ensure_ascii=False, default=str) + "\n")
    os.replace(tmp, path)
    return path.resolve()


def _model_keys(model: Any, tokenizer: Any, out: Path, tokenizer_spec: str) -> dict[str, Any]:
    """The ``model.*`` keys that start a run from ``model`` (see :class:`Trainer`)."""
    if isinstance(model, (str, Path)):
        from lmforge.models.load import ModelSource

        if ModelSource.at(model).kind == "checkpoint":
            return {"from_checkpoint": str(model), "from_hf": None}
        return {"from_hf": str(model), "from_checkpoint": None}
    from lmforge.models.model import Transformer

    out.mkdir(parents=True, exist_ok=True)
    if isinstance(model, Transformer):
        from lmforge.exporters import write_hf_dir
        from lmforge.models.tokenizer import load_tokenizer

        write_hf_dir(model, tokenizer if tokenizer is not None else load_tokenizer(tokenizer_spec), out)
    elif hasattr(model, "save_pretrained"):
        model.save_pretrained(out, safe_serialization=True)
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(out)
        else:
            from lmforge.exporters import write_tokenizer_files
            from lmforge.models.tokenizer import load_tokenizer

            write_tokenizer_files(tokenizer if tokenizer is not None else load_tokenizer(tokenizer_spec), out)
    else:
        raise UserError(f"model: expected a path, a transformers PreTrainedModel or an lmforge Transformer, "
                        f"got a {type(model).__name__}")
    return {"from_hf": str(out.resolve()), "from_checkpoint": None}


def _reward_table(reward_funcs: Any) -> dict[str, Any]:
    """Reward names -> callables (None for built-in names), in order."""
    if reward_funcs is None:
        return {}
    if isinstance(reward_funcs, Mapping):
        items = list(reward_funcs.items())
    else:
        funcs = [reward_funcs] if callable(reward_funcs) or isinstance(reward_funcs, str) else list(reward_funcs)
        items = []
        for i, fn in enumerate(funcs):
            if isinstance(fn, str):
                items.append((fn, None))
                continue
            name = getattr(fn, "__name__", "")
            items.append((name if name.isidentifier() else f"reward_{i}", fn))
    from lmforge.rl.rewards import BUILTIN_REWARDS

    table: dict[str, Any] = {}
    for name, fn in items:
        if fn is not None and not callable(fn):
            raise UserError(f"reward_funcs: {name!r} is not callable")
        if name in table or (fn is not None and name in BUILTIN_REWARDS):
            raise UserError(f"reward_funcs: the name {name!r} is taken (built-in or given twice); pass a dict "
                            "name -> function to choose names")
        table[name] = fn
    return table


@contextmanager
def _registered(registry: dict[str, Any], entries: Mapping[str, Any]) -> Iterator[None]:
    """``entries`` (those not None) in ``registry`` for the block; what they replaced comes back after."""
    added = {k: v for k, v in entries.items() if v is not None}
    replaced = {k: registry[k] for k in added if k in registry}
    registry.update(added)
    try:
        yield
    finally:
        for key in added:
            registry.pop(key, None)
        registry.update(replaced)


@contextmanager
def _appended(hooks: list[Any], hook: Any) -> Iterator[None]:
    hooks.append(hook)
    try:
        yield
    finally:
        hooks.remove(hook)

