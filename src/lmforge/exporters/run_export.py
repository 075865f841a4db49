"""Export a checkpoint as a Hugging Face model directory (config, safetensors, tokenizer files), a
llama.cpp GGUF file (weights, tokenizer and chat template in one file), or a LoRA run's adapters as
a PEFT adapter directory.

The byte tokenizer is exported as an equivalent ``tokenizer.json`` with the chat template, so
``transformers`` can tokenize, chat-format and decode exactly as lmforge does.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from lmforge.data.chat import BYTE_CHAT_TEMPLATE, stop_token_ids
from lmforge.errors import UserError
from lmforge.inference import load_for_inference
from lmforge.models.load import ModelSource
from lmforge.models.model import Transformer
from lmforge.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, byte_tokenizer_json


def write_tokenizer_files(tokenizer: Tokenizer, out: Path) -> None:
    if isinstance(tokenizer, HFTokenizer):
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            src = tokenizer.path / name
            if src.is_file():
                shutil.copyfile(src, out / name)
        return
    if not isinstance(tokenizer, ByteTokenizer):
        raise UserError(f"cannot export tokenizer {tokenizer!r}: only byte and tokenizer.json tokenizers")
    (out / "tokenizer.json").write_text(byte_tokenizer_json(tokenizer))
    lit = {name: tokenizer.decode([i], skip_special=False) for name, i in tokenizer.special_tokens.items()}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": lit["bos"], "eos_token": lit["eos"], "pad_token": lit["pad"],
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000, "chat_template": BYTE_CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def export_hf(run_or_ckpt: str | Path, out_dir: str | Path) -> Path:
    """Write a Hugging Face model directory for a run or checkpoint directory (see module doc); a LoRA
    run's adapters are merged into its base weights.

    Written next to ``out_dir`` under a temporary name and renamed into place when complete, so an
    interrupted or failed export never leaves a half-written directory (nor harms an earlier export).
    """
    out = _check_out(out_dir, "--hf", "config.json")
    model, tokenizer = load_for_inference(run_or_ckpt)
    return _write_atomically(out, "--hf", lambda d: write_hf_dir(model, tokenizer, d))


def write_hf_dir(model: Transformer, tokenizer: Tokenizer, out: Path) -> None:
    """config.json, generation_config.json, safetensors and tokenizer files of ``model`` into ``out``."""
    from lmforge.models.hf import save_hf_model

    # Every stop token (EOS, generation_config.json's, the template's end of turn), so transformers'
    # generate stops where lmforge does.
    stops = stop_token_ids(tokenizer)
    state = dict(model.state_dict())
    score = state.pop("score.weight", None)  # a reward model: written as *ForSequenceClassification
    save_hf_model(state, model.args, out, bos_token_id=tokenizer.bos_id,
                  eos_token_id=stops if len(stops) > 1 else stops[0], pad_token_id=tokenizer.pad_id, score=score)
    write_tokenizer_files(tokenizer, out)
    write_image_processor_files(model.args, tokenizer, out)


IMAGE_TOKEN_NAMES = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                     "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
"""Qwen's image tokens, by the args naming their ids: what the byte tokenizer's export adds at those ids."""


def write_image_processor_files(args: Any, tokenizer: Tokenizer, out: Path) -> None:
    """A vision-language model's ``preprocessor_config.json`` (the image processor training used, so
    transformers resizes and patches images the same way); with the byte tokenizer, its ``tokenizer.json``
    gains Qwen's image tokens at the model's ids (the ids between are reserved tokens), so the family's
    placeholder text tokenizes to the ids the model was trained on. Nothing for a text model."""
    from lmforge.data.image_tokens import image_encoding_for

    encoding = image_encoding_for(args, tokenizer)
    if encoding is None:
        return
    encoding.processor.save_pretrained(str(out))
    if not isinstance(tokenizer, ByteTokenizer):
        return
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTok

    wanted = {getattr(args, key): text for key, text in IMAGE_TOKEN_NAMES.items() if hasattr(args, key)}
    if not wanted:
        return
    tok = HFTok.from_file(str(out / "tokenizer.json"))
    for i in range(tok.get_vocab_size(), max(wanted) + 1):
        text = wanted.get(i, f"<|reserved_{i}|>")
        tok.add_special_tokens([AddedToken(text, special=True, normalized=False)])
        if tok.token_to_id(text) != i:
            raise UserError(f"export: the byte tokenizer cannot place {text} at id {i}")
    tok.save(str(out / "tokenizer.json"))


def export_gguf(source: str | Path, out_file: str | Path, gguf_type: str = "f16") -> Path:
    """Write a GGUF file (:mod:`lmforge.exporters.gguf_write`) for a run, checkpoint or Hugging Face
    directory; a LoRA run's adapters are merged into its base weights.

    ``out_file`` must not exist. The file is written under a new temporary name beside it
    (``.NAME.XXXXXXXX.partial``, never a name a user's file may have) and renamed when complete, so an
    interrupted or failed export never leaves a half-written file at ``out_file``.
    """
    from lmforge.exporters.gguf_write import GGUF_TYPES, gguf_architecture, write_gguf
    from lmforge.models.hf import hf_state_dict_from_lmforge
    from lmforge.models.hf_config import check_exportable

    if gguf_type not in GGUF_TYPES:
        raise UserError(f"--gguf-type {gguf_type!r}: choose from {', '.join(GGUF_TYPES)}")
    out = Path(os.path.abspath(Path(out_file).expanduser()))
    if out.exists():
        raise UserError(f"--gguf {out}: exists; choose a new file name")
    if not out.parent.is_dir():
        raise UserError(f"--gguf {out}: no such directory {out.parent}")
    model, tokenizer = load_for_inference(source)
    if hasattr(model, "score"):
        raise UserError(f"--gguf: {source} is a reward model; GGUF export writes language models only")
    gguf_architecture(model.args)  # refuse before writing anything
    check_exportable(model.args)
    name = Path(str(source)).expanduser().resolve().name
    partial = None
    try:
        # a name of its own, never one a user's file could have
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name[:100]}.", suffix=".partial", dir=out.parent)
        os.close(fd)
        partial = Path(tmp)
        write_gguf(hf_state_dict_from_lmforge(dict(model.state_dict()), model.args), model.args, partial,
                   tokenizer=tokenizer, gguf_type=gguf_type, name=name)
        os.replace(partial, out)
    except OSError as e:
        if partial is not None:
            partial.unlink(missing_ok=True)
        raise UserError(f"--gguf {out}: cannot write the export ({e.strerror or e})") from None
    except BaseException:
        if partial is not None:
            partial.unlink(missing_ok=True)
        raise
    return out


def export_adapter(run_or_ckpt: str | Path, adapter_dir: str | Path, base_dir: str | Path | None = None) -> Path:
    """A PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``) of a LoRA run.

    Tensor and module names are the Hugging Face ones (``model.layers.N.self_attn.q_proj`` ...), so
    ``peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), adapter_dir)`` gives
    the model lmforge trained. ``BASE`` is the run's base model: a Hugging Face directory it started
    from is named as it is (a Hub model by its name, with the commit as the adapter's ``revision``); any
    other base (an lmforge checkpoint, a fresh init) is written to ``base_dir`` as a Hugging Face
    directory, which is then required.
    """
    from lmforge.models.load import checkpoint_description, load_model

    source = ModelSource.at(run_or_ckpt)
    described = checkpoint_description(Path(source.where)) if source.kind == "checkpoint" else {}
    if "lora" not in described:
        raise UserError(f"--adapter: {run_or_ckpt} holds no LoRA adapters (a full model: export it with --hf)")
    base = ModelSource.parse(str(described.get("base", "")))
    if base_dir is None and base.kind not in ("hf", "hub"):
        raise UserError(f"--adapter: the base model ({base}) is not a Hugging Face directory; add --base DIR "
                        "to export it alongside the adapter")
    out = _check_out(adapter_dir, "--adapter", "adapter_config.json")
    loaded = load_model(source, merge_lora=False)
    base_path = Path(base.where).resolve() if base_dir is None else _check_out(base_dir, "--base", "config.json")
    base_name, revision = str(base_path), None
    if base_dir is not None:
        plain = load_model(base, tokenizer=loaded.tokenizer_spec, args=loaded.args)
        _write_atomically(base_path, "--base", lambda d: write_hf_dir(plain.model, plain.tokenizer, d))
    elif base.kind == "hub":  # named as on the Hub, at the commit the run started from
        base_name, _, revision = base.where.partition("@")
    return _write_atomically(out, "--adapter", lambda d: write_peft_adapter(loaded.model, described["lora"],
                                                                            base_name, d, revision))


def write_peft_adapter(model: Transformer, lora: dict, base_name: str, out: Path, revision: str | None = None) -> None:
    from peft import LoraConfig
    from safetensors.torch import save_file

    from lmforge.models.hf import hf_module_name
    from lmforge.models.lora import adapter_weights
    from lmforge.models.spec import lora_targets_for

    tensors = {}
    for name, (a, b) in adapter_weights(model).items():
        hf = f"base_model.model.{hf_module_name(name, model.args)}"
        tensors[f"{hf}.lora_A.weight"] = a.detach().float().contiguous().cpu()
        tensors[f"{hf}.lora_B.weight"] = b.detach().float().contiguous().cpu()
    targets = sorted(hf_module_name(f"layers.0.{path}", model.args).rpartition(".")[2]
                     for path in lora_targets_for(model.args, lora["target_modules"]).values())
    config = LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], target_modules=targets,
                        bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_name, revision=revision)
    config.save_pretrained(str(out))
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})


def _check_out(out_dir: str | Path, flag: str, marker: str) -> Path:
    """``out_dir`` (made absolute: ``.`` has no name to put a temporary sibling beside) if it is new,
    empty, or an earlier export of the same kind (has ``marker``)."""
    out = Path(os.path.abspath(Path(out_dir).expanduser()))
    if out.exists() and not out.is_dir():
        raise UserError(f"{flag} {out}: exists and is not a directory; choose an empty or new directory")
    if out.is_dir() and any(out.iterdir()) and not (out / marker).is_file():
        raise UserError(f"{flag} {out}: exists and is not an earlier export; choose an empty or new directory")
    return out


def _sibling(out: Path, kind: str) -> Path:
    """A new, empty directory beside ``out`` under a name no one else has (``.NAME.XXXXXXXX.kind``): a
    fixed name such as ``NAME.partial`` could be the user's own file or directory, which the export would
    then overwrite or delete."""
    return Path(tempfile.mkdtemp(prefix=f".{out.name[:100]}.", suffix=f".{kind}", dir=out.parent))


def _write_atomically(out: Path, flag: str, write: Callable[[Path], None]) -> Path:
    """Run ``write`` into a new temporary sibling directory, then put it in place: renamed over ``out``
    when ``out`` is new or an earlier export (swapped, so a failure keeps the earlier one whole); moved in
    file by file when ``out`` is an existing empty directory (it may be the working directory, which a
    rename would leave deleted under the user's shell), with ``marker``-bearing config files last."""
    partial: Path | None = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = _sibling(out, "partial")
        write(partial)
        if out.is_dir() and not any(out.iterdir()):
            for item in sorted(partial.iterdir(), key=lambda p: (p.name.endswith("config.json"), p.name)):
                os.replace(item, out / item.name)
            partial.rmdir()
            return out
        old = _sibling(out, "old") if out.exists() else None
        if old is not None:
            os.replace(out, old)  # over the new empty directory
        os.replace(partial, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        raise UserError(f"{flag} {out}: cannot write the export ({e.strerror or e})") from None
    except BaseException:
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    return out
