"""One way to get a model: from a :class:`ModelSource` (fresh, a Hugging Face directory, a model on the
Hugging Face Hub, a GGUF file, an lmforge run or checkpoint), used by the runtime, inference, generation,
export and GRPO's reference model.

A source has a one-line spelling, ``init:SEED``, ``hf:DIR``, ``hub:ORG/NAME@COMMIT``, ``gguf:FILE`` or
``checkpoint:DIR``, which GRPO keeps in its checkpoints to rebuild the same reference model on resume. A
Hub name is pinned to the commit its revision resolved to (:mod:`lmforge.models.hub`), so the spelling
always means the same weights. lmforge checkpoints describe their
own model (``trainer_state.json`` holds the model shape and tokenizer), so a checkpoint directory is
enough to rebuild it; older ones fall back to their run directory's ``model_args.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

from lmforge.checkpoint import (
    RunDir, STATE_FILE, list_checkpoints, load_model_weights, read_trainer_state, resolve_checkpoint,
)
from lmforge.errors import UserError
from lmforge.models.args import ModelArgs
from lmforge.models.heads import attach_head, head_of
from lmforge.models.hub import is_hub_name, resolve_hub_model
from lmforge.models.model import Transformer
from lmforge.models.spec import spec_for_args
from lmforge.models.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:  # pragma: no cover
    from lmforge.config import ModelSection

SourceKind = Literal["init", "hf", "hub", "gguf", "checkpoint"]


@dataclass(frozen=True)
class ModelSource:
    kind: SourceKind
    where: str
    """The seed (``init``), a Hugging Face directory (``hf``), ``org/name@commit`` (``hub``), a GGUF file
    (``gguf``) or a resolved checkpoint directory."""

    def __str__(self) -> str:
        return f"{self.kind}:{self.where}"

    @classmethod
    def parse(cls, spec: str) -> "ModelSource":
        kind, _, where = spec.partition(":")
        if kind not in ("init", "hf", "hub", "gguf", "checkpoint") or not where:
            raise UserError(f"model source {spec!r}: expected init:SEED, hf:DIR, hub:ORG/NAME@COMMIT, gguf:FILE "
                            "or checkpoint:DIR")
        return cls(kind, where)  # type: ignore[arg-type]

    @classmethod
    def hub(cls, name: str) -> "ModelSource":
        """The Hub model ``name`` (``org/name[@revision]``), resolved to a commit in the cache now."""
        return cls("hub", resolve_hub_model(name).pinned)

    @classmethod
    def from_hf(cls, value: str, key: str = "model.from_hf") -> "ModelSource":
        """What ``model.from_hf`` names: a local Hugging Face directory or ``.gguf`` file (a path that
        exists always wins), else a Hub model ``org/name[@revision]``."""
        p = Path(value).expanduser()
        if not p.exists() and is_hub_name(value):
            try:
                return cls.hub(value)
            except UserError as e:
                raise UserError(f"{key}={value}: no such local directory, and {e}") from None
        return cls("gguf" if value.lower().endswith(".gguf") else "hf", value)

    @classmethod
    def from_section(cls, m: "ModelSection", seed: int) -> "ModelSource":
        """Where a run's starting weights come from, as its ``[model]`` section names them: a Hugging Face
        directory or Hub model (pinned to its commit), an lmforge checkpoint, or a fresh initialization
        with the run's seed. Resolved once, before anything runs, so a wrong name is one line."""
        if m.from_hf:  # a Hugging Face directory, a llama.cpp .gguf file (lmforge.models.gguf) or a Hub name
            return cls.from_hf(m.from_hf)
        if m.from_checkpoint:
            p = Path(m.from_checkpoint)
            if not (p / STATE_FILE).is_file() and not list_checkpoints(RunDir(p).checkpoints):
                raise UserError(f"model.from_checkpoint={p}: no checkpoint there; train the starting model first "
                                f"(e.g. lmforge pretrain --config configs/debug.toml --run.dir={p})")
            return cls("checkpoint", str(resolve_checkpoint(p).resolve()))
        return cls("init", str(seed))

    @classmethod
    def at(cls, path: str | Path) -> "ModelSource":
        """The model stored at ``path``: a Hugging Face directory, a ``*.gguf`` file, or an lmforge run /
        checkpoint directory; a ``path`` that does not exist may name a Hub model (``org/name[@revision]``)."""
        p = Path(path).expanduser()
        if not p.exists() and is_hub_name(str(path)):
            try:
                return cls.hub(str(path))
            except UserError as e:
                raise UserError(f"{path}: no such run, checkpoint or model directory, and as a Hub model {e}") from None
        if not p.exists():
            raise UserError(f"{p}: no such run, checkpoint or model directory")
        if p.is_file() and p.suffix.lower() == ".gguf":
            return cls("gguf", str(p.resolve()))
        if is_hf_dir(p):
            return cls("hf", str(p))
        return cls("checkpoint", str(resolve_checkpoint(p).resolve()))


def is_hf_dir(p: Path) -> bool:
    return (p / "config.json").is_file() and not RunDir(p).is_run() and not (p / STATE_FILE).is_file()


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    tokenizer_spec: str
    """How to load the tokenizer again: ``byte`` or an absolute directory."""
    source: ModelSource

    @property
    def args(self) -> ModelArgs:
        return self.model.args

    def description(self) -> dict[str, Any]:
        """What a checkpoint stores to describe its model (see the module doc); ``head`` names an extra
        output head (:mod:`lmforge.models.heads`)."""
        head = head_of(self.model)
        return {"model_args": self.args.to_dict(), "tokenizer": self.tokenizer_spec} | ({"head": head} if head else {})


def checkpoint_description(checkpoint: Path) -> dict[str, Any]:
    """The model shape and tokenizer a checkpoint was saved with."""
    described = read_trainer_state(checkpoint).get("model")
    if isinstance(described, dict) and "model_args" in described:
        return described
    run = RunDir.of_checkpoint(checkpoint)
    if not run.model_args.is_file():
        raise UserError(f"{checkpoint}: no model description in the checkpoint and no {run.model_args}")
    try:
        return json.loads(run.model_args.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{run.model_args}: unreadable ({e})") from None


def load_model(source: ModelSource, *, tokenizer: str = "byte", args: ModelArgs | None = None,
               size: str = "debug", overrides: dict[str, Any] | None = None, merge_lora: bool = True) -> LoadedModel:
    """Build the model ``source`` names, with its tokenizer, in fp32 on the CPU.

    ``init`` sources are new models: ``args`` if given, else the named ``size`` with ``overrides``
    and the vocabulary of ``tokenizer``. ``hf``, ``hub`` and ``checkpoint`` sources bring their own shape
    and tokenizer (``tokenizer`` other than ``byte`` overrides a Hugging Face directory's own). A ``gguf``
    file brings its shape but needs ``tokenizer``: lmforge cannot load the tokenizer GGUF embeds.

    A LoRA checkpoint holds only its adapters and names its base model: the base is loaded (the same
    way, recursively), the adapters put on it and, with ``merge_lora``, folded into its weights.
    Each kind of source has its loader in :data:`MODEL_LOADERS`.
    """
    request = LoadRequest(tokenizer, args, size, overrides or {}, merge_lora)
    model, tok, spec = MODEL_LOADERS[source.kind](source, request)
    check_vocabulary(tok, model.args.vocab_size, str(source))
    return LoadedModel(model, tok, spec, source)


@dataclass(frozen=True)
class LoadRequest:
    """What the caller of :func:`load_model` asked for besides the source."""

    tokenizer: str
    args: ModelArgs | None
    size: str
    overrides: dict[str, Any]
    merge_lora: bool


def _new_model(source: ModelSource, r: LoadRequest) -> Loaded:
    spec = _tokenizer_spec(r.tokenizer)
    tok = load_tokenizer(spec)
    args = r.args
    if args is None:
        from lmforge.models.args import model_args_for

        args = model_args_for(r.size, tok.vocab_size, **r.overrides)
    model = spec_for_args(args).build(args)
    model.init_weights(seed=int(source.where))
    return model, tok, spec


def _hf_model(source: ModelSource, r: LoadRequest) -> Loaded:
    from lmforge.models.hf import load_hf_model

    directory = source.where if source.kind == "hf" else str(resolve_hub_model(source.where).directory)
    spec = _tokenizer_spec(r.tokenizer if r.tokenizer != "byte" else directory)
    tok = load_tokenizer(spec)
    return load_hf_model(directory), tok, spec


def _gguf_model(source: ModelSource, r: LoadRequest) -> Loaded:
    from lmforge.models.gguf import load_gguf_model

    if r.tokenizer == "byte":
        raise UserError(f"{source}: a GGUF file's own tokenizer cannot be loaded; name the model's Hugging Face "
                        "tokenizer files with model.tokenizer=DIR (lmforge generate: --tokenizer DIR)")
    spec = _tokenizer_spec(r.tokenizer)
    tok = load_tokenizer(spec)  # a wrong tokenizer path is said before the file is dequantized
    return load_gguf_model(source.where), tok, spec


def _checkpoint_model(source: ModelSource, r: LoadRequest) -> Loaded:
    ckpt = Path(source.where)
    described = checkpoint_description(ckpt)
    spec = described.get("tokenizer", "byte")
    tok = load_tokenizer(spec)
    if "lora" in described:
        return _load_adapted(ckpt, described, spec, r.merge_lora), tok, spec
    args = ModelArgs.from_dict(described["model_args"])
    model = spec_for_args(args).build(args)
    if described.get("head"):
        attach_head(model, described["head"])
    load_model_weights(ckpt, model)
    return model, tok, spec


Loaded = "tuple[Transformer, Tokenizer, str]"
ModelLoader = Callable[[ModelSource, LoadRequest], Loaded]
MODEL_LOADERS: dict[str, ModelLoader] = {
    "init": _new_model, "hf": _hf_model, "hub": _hf_model, "gguf": _gguf_model, "checkpoint": _checkpoint_model,
}
"""Each kind of :class:`ModelSource`'s loader: the model (fp32, CPU), its tokenizer and the tokenizer's spec."""


def check_vocabulary(tok: Tokenizer, vocab_size: int, where: str) -> None:
    """UserError unless every token ``tok`` can produce from text has a row in the model.

    Only control tokens may lie past ``vocab_size`` (Gemma 3's tokenizers add an image token after
    the model's 262,144 text rows; a chat format then refuses any of them its template writes).
    """
    extra = tok.vocab_size - vocab_size
    beyond = sum(1 for i in tok.control_tokens.values() if i >= vocab_size)
    if extra > 0 and beyond < extra:
        raise UserError(f"{where}: tokenizer vocabulary ({tok.vocab_size}) does not fit the model's "
                        f"vocab_size ({vocab_size}): model.tokenizer does not match the model")


def _load_adapted(ckpt: Path, described: dict[str, Any], tokenizer: str, merge: bool) -> Transformer:
    """A LoRA checkpoint's model: its base, its adapters loaded onto it, merged if asked."""
    from lmforge.config import LoraSection
    from lmforge.models.lora import apply_lora, base_weights_fingerprint, merge_adapters

    try:
        base_source = ModelSource.parse(str(described.get("base", "")))
        lora = LoraSection(**described["lora"])
    except (UserError, TypeError, ValueError) as e:
        raise UserError(f"{ckpt}: unreadable LoRA description in its trainer state ({e})") from None
    if base_source.kind not in ("init", "hub") and not Path(base_source.where).exists():
        raise UserError(f"{ckpt}: holds LoRA adapters for the base model {base_source}, which no longer exists")
    base = load_model(base_source, tokenizer=tokenizer, args=ModelArgs.from_dict(described["model_args"])).model
    found = base_weights_fingerprint(base) if "base_weights" in described else None
    if found != described.get("base_weights"):
        raise UserError(f"{ckpt}: holds LoRA adapters for the base model {base_source}, whose weights changed since "
                        f"(fingerprint {described['base_weights']}, now {found})")
    apply_lora(base, lora)
    if described.get("head"):
        attach_head(base, described["head"])
    load_model_weights(ckpt, base)
    return merge_adapters(base).requires_grad_(True) if merge else base


def _tokenizer_spec(spec: str) -> str:
    return spec if spec == "byte" else str(Path(spec).resolve())
