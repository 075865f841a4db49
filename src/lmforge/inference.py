"""Using a trained model: load it, sample from it, score it on the embedded tasks, export it.

A model is found from a path that is either an lmforge run directory / checkpoint directory (its
``model_args.json`` names the architecture and tokenizer) or a Hugging Face Llama directory
(``config.json`` + safetensors + ``tokenizer.json``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Sequence

import torch

from lmforge.training.checkpoint import STATE_FILE, load_model_weights, resolve_checkpoint
from lmforge.data.chat import BYTE_CHAT_TEMPLATE, chat_format_for
from lmforge.data.tasks import TaskExample, is_correct
from lmforge.errors import UserError
from lmforge.models.generate import generate
from lmforge.models.model import ModelArgs, Transformer
from lmforge.training.runtime import MODEL_ARGS_FILE, read_model_args
from lmforge.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = ["load_for_inference", "chat_prompt_ids", "sample_texts", "exact_match_accuracy", "export_hf",
           "task_accuracy", "byte_tokenizer_json"]

def _is_hf_dir(p: Path) -> bool:
    return (p / "config.json").is_file() and not (p / MODEL_ARGS_FILE).is_file() and not (p / STATE_FILE).is_file()


def load_for_inference(path: str | Path, device: str | torch.device = "cpu") -> tuple[Transformer, Tokenizer]:
    """The model (eval mode, fp32, on ``device``) and tokenizer stored at ``path``."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"{p}: no such run, checkpoint or model directory")
    if _is_hf_dir(p):
        from lmforge.models.hf import load_hf_model

        model, tokenizer = load_hf_model(p), load_tokenizer(str(p))
    else:
        ckpt = resolve_checkpoint(p)
        run_dir = ckpt.parent.parent
        saved = read_model_args(run_dir)
        tokenizer = load_tokenizer(saved.get("tokenizer", "byte"))
        model = Transformer(ModelArgs.from_dict(saved["model_args"]))
        load_model_weights(ckpt, model)
    if tokenizer.vocab_size > model.args.vocab_size:
        raise UserError(f"{p}: tokenizer vocabulary ({tokenizer.vocab_size}) is larger than the model's "
                        f"({model.args.vocab_size})")
    return model.to(device).eval(), tokenizer


def chat_prompt_ids(tokenizer: Tokenizer, user_text: str, system: str | None = None) -> list[int]:
    """``user_text`` (after an optional system message) in the chat format, ending in the generation prompt."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user_text}]
    try:
        return chat_format_for(tokenizer).prompt_ids(messages)
    except ValueError as e:  # a template's raise_exception
        raise UserError(str(e)) from None


def _prompt_ids(tokenizer: Tokenizer, prompts: Sequence[str], chat: bool) -> list[list[int]]:
    if chat:
        return [chat_prompt_ids(tokenizer, p) for p in prompts]
    # Plain prompts are encoded as-is (no BOS), as plain-text SFT and pretraining data are.
    ids = [tokenizer.encode(p) for p in prompts]
    return [i if i else [tokenizer.bos_id] for i in ids]


def sample_texts(model: Transformer, tokenizer: Tokenizer, prompts: list[str], *, max_new_tokens: int = 64,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, chat: bool = False,
                 batch_size: int = 64) -> list[str]:
    """Continue each prompt (greedy at temperature 0); returns the new text only, without the stop token."""
    device = model.tok_embeddings.weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = _prompt_ids(tokenizer, prompts, chat)
    budget = model.args.max_seq_len - max(len(i) for i in ids) if ids else max_new_tokens
    n = min(max_new_tokens, budget)
    texts: list[str] = []
    for lo in range(0, len(ids), batch_size):
        rows = generate(model, ids[lo: lo + batch_size], n, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                        temperature=temperature, top_p=top_p, generator=gen)
        texts += [tokenizer.decode(r, skip_special=True) for r in rows]
    return texts


def exact_match_accuracy(model: Transformer, tokenizer: Tokenizer, examples: list[TaskExample], *,
                         max_new_tokens: int = 32, batch_size: int = 32) -> float:
    """Fraction of ``examples`` whose greedy chat completion has exactly the expected answer."""
    return task_accuracy(model, tokenizer, examples, max_new_tokens=max_new_tokens, batch_size=batch_size)["all"]


def task_accuracy(model: Transformer, tokenizer: Tokenizer, examples: list[TaskExample], *,
                  max_new_tokens: int = 32, batch_size: int = 32) -> dict[str, float]:
    """Greedy exact-match accuracy overall (``"all"``) and per task, from one generation pass."""
    if not examples:
        return {"all": 0.0}
    completions = sample_texts(model, tokenizer, [e.prompt for e in examples], max_new_tokens=max_new_tokens,
                               temperature=0.0, chat=True, batch_size=batch_size)
    hits: dict[str, list[bool]] = {"all": []}
    for c, e in zip(completions, examples):
        ok = is_correct(c, e.answer)
        hits["all"].append(ok)
        hits.setdefault(e.task, []).append(ok)
    return {k: sum(v) / len(v) for k, v in hits.items()}


# ------------------------------------------------------------------------------------------ export
def _bytes_to_unicode() -> dict[int, str]:
    """Byte -> printable character table of byte-level BPE tokenizers (what ``ByteLevel`` expects).

    Printable Latin-1 bytes map to themselves; the rest are moved to code points from 256 upward.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def byte_tokenizer_json(tokenizer: ByteTokenizer) -> str:
    """A ``tokenizer.json`` that encodes and decodes exactly like :class:`ByteTokenizer`.

    Byte-level BPE with no merges: every byte is one token with id = byte value, then the special
    tokens at their lmforge ids.
    """
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers

    table = _bytes_to_unicode()
    tok = HFTok(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    literals = sorted(((i, tokenizer.decode([i], skip_special=False)) for i in tokenizer.special_tokens.values()))
    for expected, literal in literals:
        tok.add_special_tokens([AddedToken(literal, special=True, normalized=False)])
        if tok.token_to_id(literal) != expected:
            raise RuntimeError(f"byte tokenizer export: {literal} got id {tok.token_to_id(literal)}, not {expected}")
    return tok.to_str()


def _write_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
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
    """Write a Hugging Face Llama directory (config, safetensors, tokenizer files) for a checkpoint.

    The byte tokenizer is exported as an equivalent ``tokenizer.json`` with the chat template, so
    ``transformers`` can tokenize, chat-format and decode exactly as lmforge does.
    """
    from lmforge.models.hf import save_hf_model

    model, tokenizer = load_for_inference(run_or_ckpt)
    out = Path(out_dir).expanduser()
    if out.exists() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise UserError(f"{out} exists and is not a model directory; choose an empty or new directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {out}: {e.strerror or e}") from None
    save_hf_model(model.state_dict(), model.args, out, bos_token_id=tokenizer.bos_id,
                  eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    _write_tokenizer(tokenizer, out)
    return out
