"""Configuration: TOML files plus ``--section.key=value`` overrides, validated by pydantic.

Every trainer has one config class (``Config`` here, extended by each recipe but pretraining with its
own section). Validation errors become one ``ConfigError`` (a ``UserError``) line that names the key, the file and, for
unknown keys, the closest known key.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from types import UnionType
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from lmforge.errors import ConfigError

from lmforge.config_files import dump_toml, merge_config, parse_overrides, read_toml  # noqa: F401 - also lmforge.config's


def comma_separated(v: Any) -> Any:
    """``"a, b"`` (as a command-line override gives it) -> ``["a", "b"]``; lists pass through."""
    return [x.strip() for x in v.split(",") if x.strip()] if isinstance(v, str) else v


def _numeric(annotation: Any) -> bool:
    """Whether a field takes numbers and no booleans (``int``, ``float``, ``int | None`` ...)."""
    args = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    return bool(set(args) & {int, float}) and bool not in args


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        """pydantic reads ``true`` as 1 for an ``int`` key: ``parallel.tp=true`` would mean a degree of 1.
        A boolean where a number is expected is refused, for every numeric key of every section."""
        if isinstance(v, bool) and info.field_name and _numeric(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expected a number, got the boolean {str(v).lower()}")
        return v


class ModelSection(Section):
    size: str = "debug"
    """Named preset from ``lmforge.models.model.MODEL_SIZES``; the fields below override it."""
    dim: int | None = Field(None, gt=0)
    n_layers: int | None = Field(None, gt=0)
    n_heads: int | None = Field(None, gt=0)
    n_kv_heads: int | None = Field(None, gt=0)
    ffn_hidden_dim: int | None = Field(None, gt=0)
    max_seq_len: int | None = Field(None, gt=0)
    tie_embeddings: bool | None = None
    tokenizer: str = "byte"
    """``byte`` (needs no files) or a local directory holding ``tokenizer.json``."""
    from_hf: str | None = None
    """A Hugging Face model to start from (Llama, Qwen2/2.5/3, Mistral, ...: weights, config, tokenizer): a
    local directory, a ``.gguf`` file, or a Hub name ``org/name[@revision]`` read from the Hugging Face cache
    and downloaded into it unless ``HF_HUB_OFFLINE=1`` (``lmforge.models.hub``; a local path that exists
    wins). Checkpoints record the commit a Hub name resolved to."""
    from_checkpoint: str | None = None
    """An lmforge run directory or checkpoint to take the starting weights from (model only)."""
    freeze: list[str] = []
    """Parts that do not train, by the family's parameter groups (a vision-language model's ``vision_tower``,
    ``projector``, ``language_model``); empty: every weight trains (LoRA: every adapter)."""

    @field_validator("freeze", mode="before")
    @classmethod
    def _freeze_list(cls, v: Any) -> Any:
        return comma_separated(v)


class DataSourceSection(Section):
    """One entry of ``data.sources``: a prepared directory or raw data, and its share of the samples."""

    path: str
    weight: float = Field(1.0, gt=0)


class DataSection(Section):
    train: str = "embedded"
    """``embedded`` (the built-in corpus), a directory written by ``lmforge prepare``, or a local
    .txt/.jsonl/.parquet file, directory or ``datasets`` directory (prepared on first use into
    ``data.cache_dir``)."""
    sources: list[DataSourceSection] = []
    """Pretraining data mixed by weight, instead of ``data.train``: ``[{path = "...", weight = 0.7}, ...]``
    (``lmforge.data.mixture``)."""
    cache_dir: str = ""
    """Where raw pretraining files are prepared into token shards ("": ``$LMFORGE_CACHE`` or
    ``~/.cache/lmforge/prepared``)."""
    validation: str = "embedded"
    text_field: str = "text"
    format: str = "auto"
    """Record format of SFT files: ``auto`` detects it from each record's keys, a file's first record
    settling records that fit several; or a registered format's name (``lmforge.data.record_formats``)."""
    seq_len: int = Field(256, gt=1)
    overlong: Literal["skip", "truncate"] = "truncate"
    """Records longer than a row (SFT and distillation: ``seq_len + 1`` tokens; a preference pair: both
    sequences together in one row): ``truncate`` cuts the prompt from the left first and keeps the
    response whole where it fits, cutting the response's end only when it alone is too long
    (``lmforge.data.overlong``); ``skip`` drops them. The data summary line gives their count and share
    either way, and how many responses were cut. Truncation is the default because silently losing a
    large share of a dataset (long chats are common) surprises more than a cut context, and this
    truncation keeps what is trained on, the response, whole in the usual case of a long prompt; use
    ``skip`` when a cut context would make an answer wrong."""
    shuffle: bool = True
    prefetch: int = Field(2, ge=0)


class TrainingSection(Section):
    steps: int = Field(300, ge=0)
    global_batch_size: int = Field(16, gt=0)
    """Sequences per optimizer step across all ranks; gradient accumulation fills the gap."""
    micro_batch_size: int = Field(8, gt=0)
    seed: int = Field(0, ge=0, lt=2**32)
    """Seeds torch, numpy and the data order (numpy's range: 0 to 2**32 - 1)."""
    max_tokens: int = Field(0, ge=0)
    """Stop once this many target tokens were trained on (0: no token budget)."""
    max_seconds: float = Field(0.0, ge=0)
    """Stop once the training clock passes this many seconds (0: no time budget)."""
    target_eval_loss: float = Field(0.0, ge=0)
    """Stop as soon as an eval loss is at or below this (0: off)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Autocast dtype for the forward pass; parameters and optimizer state stay fp32. ``auto``: bf16
    where it is faster (a GPU with bf16; a CPU with native bf16 and a model large enough, see
    lmforge.runtime.precision), else fp32; the setup line says which and why."""
    compile: bool | Literal["auto"] = False
    """``torch.compile`` each decoder block, with Inductor's caches in ``~/.cache/lmforge/compile`` so a
    second run of the same shapes loads its kernels. ``auto``: compile when the run is estimated to
    save more time than compiling costs (lmforge.runtime.compile_cache); the setup line says which and why."""

    @field_validator("compile", mode="before")
    @classmethod
    def _compile_value(cls, v: Any) -> Any:
        """One message naming the three values, rather than pydantic's one per member of the union."""
        if isinstance(v, bool) or v == "auto":
            return v
        if isinstance(v, str) and v.lower() in ("true", "false"):
            return v.lower() == "true"
        raise ValueError('expected true, false or "auto"')
    activation_checkpointing: bool = False
    activation_offload: bool = False
    """Keep each decoder block's saved activations in (pinned) host memory between forward and
    backward. On a GPU it frees device memory; on a CPU activations already live in host memory, so
    it is off there (the setup line says so)."""
    loss_chunk_tokens: int = Field(1024, gt=0)
    """Target tokens whose logits the loss computes at once (forward and backward): bounds the loss's
    memory to chunk x vocab fp32 values (``lmforge.losses.chunked_loss``)."""
    router_aux_loss_coef: float | None = Field(None, ge=0)
    """Mixture of experts: weight of the load-balancing loss (none: the model's own, config.json's
    ``router_aux_loss_coef``; 0: off). Dense models ignore it."""
    router_z_loss_coef: float = Field(0.0, ge=0)
    """Mixture of experts: weight of the router z-loss (ST-MoE; 0: off)."""
    threads: int = Field(0, ge=0)
    """torch intra-op threads on CPU (0: leave torch's default)."""
    release_host_memory: bool = False
    """Give tensor buffers of 1 MiB and more their own memory mappings, returned to the OS when freed
    (glibc; ``lmforge.runtime.host_memory``), so the process's resident memory follows its live
    tensors: 11% less peak RSS on a SmolLM2-135M SFT step, for ~6x the page faults (kernel time to
    zero fresh pages). Off: glibc's default, whose heap keeps freed buffers for reuse."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    nonfinite: Literal["stop", "skip"] = "stop"
    """On a non-finite loss or grad norm: stop with a message, or skip that update."""
    spike_factor: float = Field(3.0, ge=0)
    """Warn when a loss exceeds this factor of its running mean (0: off)."""


class OptimizerSection(Section):
    name: Literal["adamw", "adamw8bit", "muon"] = "adamw"
    """``adamw``; ``adamw8bit`` (AdamW with 8-bit moments, bitsandbytes: ``pip install 'lmforge[quant]'``);
    ``muon`` (Muon on the decoder blocks' 2-D projection matrices, AdamW on everything else): see
    docs/optimizers.md."""
    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0)
    """Max global grad norm (0: no clipping; the norm is still reported)."""
    muon_momentum: float = Field(0.95, ge=0, lt=1)
    """Muon's (Nesterov) momentum."""
    muon_ns_steps: int = Field(5, gt=0, lt=100)
    """Newton-Schulz iterations that orthogonalize each Muon update."""
    muon_lr_ratio: float = Field(1.0, gt=0)
    """Muon's learning rate as a multiple of ``lr`` (the schedule scales both). Muon's updates are
    scaled to AdamW's RMS (``match_rms_adamw``), so 1.0 reuses an lr tuned for AdamW."""


class ScheduleSection(Section):
    kind: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    warmup_steps: int = Field(20, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    decay_fraction: float = Field(0.2, gt=0, le=1)
    """For ``wsd``: the last fraction of steps that decays to min_lr."""


class EvalSection(Section):
    interval: int = Field(50, ge=0)
    """Evaluate every this many steps and at the end (0: never)."""
    steps: int = Field(8, gt=0)
    batch_size: int = Field(16, gt=0)
    at_start: bool = False
    """Also evaluate the starting model before the first step (the "before" of a fine-tuning run)."""
    tasks: list[str] = []
    """lm-evaluation-harness tasks or groups scored during training (e.g. ``["lmforge_tasks"]``; needs
    ``lmforge[eval]``), logged as ``eval/<task>/<metric>``."""
    tasks_interval: int = Field(0, ge=0)
    """Score ``tasks`` at the evals of steps that are multiples of this, and at the end (0: every eval)."""
    tasks_limit: int = Field(0, ge=0)
    """Examples per task (0: all of them)."""

    @field_validator("tasks", mode="before")
    @classmethod
    def _task_list(cls, v: Any) -> Any:
        return comma_separated(v)


class StartEvalSection(EvalSection):
    """The eval section of the trainers that start from a trained model (every recipe but pretraining):
    the starting model is scored too."""

    at_start: bool = True


TASK_NAMES: tuple[str, ...] = ("add", "reverse", "sort")
"""The embedded tasks (generated by :mod:`lmforge.data.tasks`), named here so ``tasks.names`` is checked
when the config is read."""
IMAGE_TASK_NAMES: tuple[str, ...] = ("shapes",)
"""The embedded image task (:mod:`lmforge.data.shape_task`): SFT of a vision-language model, trained alone."""


class TasksSection(Section):
    """The embedded tasks (add, reverse, sort) that SFT and GRPO train on when ``data.train`` is
    ``embedded``, and their held-out greedy exact-match eval (run with every eval of the recipes that
    have this section: SFT, GRPO and the preference recipes)."""

    names: list[str] = list(TASK_NAMES)
    train_examples: int = Field(0, ge=0)
    """Embedded training examples to use (0: the whole train split)."""
    eval_examples: int = Field(300, ge=0)
    """Held-out examples scored by greedy exact match at each eval (0: off)."""
    eval_max_new_tokens: int = Field(16, gt=0)
    """Generation budget of the exact-match eval."""

    @field_validator("names", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        return comma_separated(v)

    @field_validator("names")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        unknown = [t for t in v if t not in TASK_NAMES + IMAGE_TASK_NAMES]
        if unknown or not v:
            known = ", ".join(TASK_NAMES + IMAGE_TASK_NAMES)
            raise ValueError(f"unknown task(s) {unknown or '(none)'}; known: {known}")
        if any(t in IMAGE_TASK_NAMES for t in v) and len(v) > 1:
            raise ValueError(f"{', '.join(IMAGE_TASK_NAMES)} is an image task: train it alone (names = [\"shapes\"])")
        return v

    @property
    def images(self) -> bool:
        """Whether the tasks are the image task (a vision-language model's SFT)."""
        return self.names[0] in IMAGE_TASK_NAMES


class CheckpointSection(Section):
    interval: int = Field(100, ge=0)
    """Save every this many steps (0: only at the end) ."""
    keep: int = Field(2, ge=1)
    enabled: bool = True
    resume: Literal["auto", "never"] = "auto"
    """``auto``: a run started on a run directory with checkpoints continues from the newest."""
    on_damaged: Literal["fallback", "stop"] = "fallback"
    on_data_change: Literal["stop", "continue"] = "stop"
    """On resume, a checkpoint trained on other data (files, ``data.seq_len`` or tokenizer): refuse
    (``stop``) or warn and continue at the saved position (``continue``)."""


class MetricsSection(Section):
    log_every: int = Field(10, gt=0)
    tensorboard: bool = True
    wandb: bool = False
    progress: Literal["auto", "on", "off"] = "auto"
    peak_tflops: float = Field(0.0, ge=0)
    """Peak TFLOP/s per device for MFU (0: a GPU table, or a measured matmul peak on CPU)."""


class RunSection(Section):
    dir: str = "runs/debug"
    """Run directory: metrics, TensorBoard events, checkpoints, resolved config."""


class LoraSection(Section):
    """Low-rank adapters (``peft``) on the attention and MLP projections: only they train."""

    enabled: bool = False
    rank: int = Field(8, gt=0)
    alpha: float = Field(16.0, gt=0)
    """Scale of the adapter's output: alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | None = None
    """The model's module names to adapt (its family's LoRA targets: ``lmforge.models.spec.ModelSpec.lora_targets``;
    for the gated decoders ``wq wk wv wo`` attention, ``w1 w2 w3`` MLP); none: all of them."""
    quantize: Literal["none", "nf4"] = "none"
    """``nf4``: QLoRA, the frozen base's attention and MLP projections held as 4-bit NormalFloat
    (bitsandbytes: ``pip install 'lmforge[quant]'``); see docs/lora.md."""

    @field_validator("target_modules", mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        return comma_separated(v)

    @model_validator(mode="after")
    def _targets_named(self) -> "LoraSection":
        if self.enabled and self.target_modules == []:  # peft refuses it deep in model building
            raise ValueError("lora.target_modules is empty: name at least one of the model's LoRA targets, "
                             "or leave the key out to adapt all of them")
        return self


class ParallelSection(Section):
    """How the ranks divide the work (``lmforge.parallel.dims``): the product of the degrees used is
    the world size."""

    mode: Literal["ddp", "fsdp"] = "ddp"
    """Shorthand for the data dimensions: ``ddp`` replicates the model on every rank, ``fsdp`` shards it."""
    dp_replicate: int = Field(0, ge=0)
    """Ranks holding whole copies (0: from ``mode``); with ``dp_shard`` > 1 too, HSDP."""
    dp_shard: int = Field(0, ge=-1)
    """Ranks sharding parameters, gradients and optimizer state with FSDP2 (0 or -1: what the other
    degrees leave of the world size)."""
    tp: int = Field(1, ge=1)
    """Tensor-parallel degree: attention heads, MLP columns and the vocabulary split over ``tp`` ranks."""
    sequence_parallel: bool = True
    """With ``tp`` > 1, norms and residuals run on sequence shards too (activation memory / tp)."""
    cp: int = Field(1, ge=1)
    """Context-parallel degree: every sequence split over ``cp`` ranks, attention exact across them."""
    ep: int = Field(1, ge=1)
    """Expert-parallel degree (MoE): experts split over ``ep`` of the data-shard ranks."""
    pp: int = Field(1, ge=1)
    """Pipeline-parallel degree: the layers split into ``pp`` stages, microbatches pipelined."""
    pp_schedule: Literal["1f1b", "interleaved_1f1b", "gpipe"] = "1f1b"
    """The pipeline schedule; ``interleaved_1f1b`` runs ``pp_stages_per_rank`` stages per rank."""
    pp_stages_per_rank: int = Field(1, ge=1)
    """Virtual stages per pipeline rank (2 or more for ``interleaved_1f1b``)."""


class ElasticSection(Section):
    """Elastic, fault-tolerant training (:mod:`lmforge.modes.elastic`), a mode of any trainer run under
    torchrun's elastic agent: fast snapshots, the global batch kept at another world size, faults to test
    recovery with."""

    enabled: bool = False
    snapshot_interval: int = Field(5, ge=0)
    """Fast snapshot every this many steps (0: durable checkpoints only)."""
    snapshot_dir: str = ""
    """Where snapshots go ('' : /dev/shm/lmforge-<run id> when all ranks share one machine)."""
    snapshot_keep: int = Field(1, ge=1)
    adapt_micro_batch: bool = True
    """If the global batch does not split over the new world size, lower micro_batch_size until it does."""
    fault_rank: int = Field(0, ge=0)
    fault_step: int = Field(0, ge=0)
    """Inject a fault at the end of this step (0: none); ``LMFORGE_FAULT`` overrides (lmforge.modes.faults)."""
    fault_mode: Literal["kill", "raise"] = "kill"
    fault_attempt: int = Field(0, ge=0)
    """Fire only on this attempt (torchrun restart count), so the restarted group survives."""
    fault_when: Literal["end", "mid"] = "end"
    """At the end of the step, or in its middle (its first forward pass)."""


class Config(Section):
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    training: TrainingSection = TrainingSection()
    optimizer: OptimizerSection = OptimizerSection()
    schedule: ScheduleSection = ScheduleSection()
    eval: EvalSection = EvalSection()
    checkpoint: CheckpointSection = CheckpointSection()
    metrics: MetricsSection = MetricsSection()
    run: RunSection = RunSection()
    parallel: ParallelSection = ParallelSection()
    lora: LoraSection = LoraSection()
    elastic: ElasticSection = ElasticSection()

    def to_dict(self) -> dict[str, Any]:
        return json.loads(self.model_dump_json())

    def to_toml(self) -> str:
        return dump_toml(self.to_dict())


C = TypeVar("C", bound=Config)


def load_config(cls: type[C], path: str | Path | None, overrides: list[str] | None = None) -> C:
    """Read ``path`` (optional), apply CLI overrides, validate; raise ConfigError on any problem."""
    source = str(path) if path else "command line"
    data = read_toml(path) if path else {}
    data = merge_config(data, parse_overrides(overrides or []))
    return validate_config(cls, data, source)


def validate_config(cls: type[C], data: dict[str, Any], source: str = "config") -> C:
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(cls, e, source)) from None


RENAMED = {"sft.too_long": "data.overlong"}
"""Keys that moved, named in the unknown-key error."""


def _describe(cls: type[BaseModel], err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    loc = [str(x) for x in first["loc"]]
    key = ".".join(loc)
    if first["type"] == "extra_forbidden" and key in RENAMED:
        return f"{source}: config key `{key}` is now `{RENAMED[key]}` (skip or truncate, for every trainer)"
    if first["type"] == "extra_forbidden":
        known = _known_keys(cls, loc[:-1])
        prefix = ".".join(loc[:-1])
        candidates = [f"{prefix}.{k}" if prefix else k for k in known]
        # the exact key name in another section (steps -> training.steps) beats a near spelling
        close = [k for k in _all_keys(cls) if k.split(".")[-1] == loc[-1]][:1]
        close = close or difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
        hint = f" (did you mean `{close[0]}`?)" if close else ""
        return f"{source}: unknown config key `{key}`{hint}"
    value = first.get("input")
    shown = f" (got {value!r})" if not isinstance(value, dict) else ""
    return f"{source}: config key `{key}`: {first['msg']}{shown}"


def _known_keys(cls: type[BaseModel], loc: list[str]) -> list[str]:
    model: Any = cls
    for part in loc:
        field = model.model_fields.get(part)
        if field is None or not isinstance(field.annotation, type) or not issubclass(field.annotation, BaseModel):
            return []
        model = field.annotation
    return list(model.model_fields)


def _all_keys(cls: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in cls.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += _all_keys(ann, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys
