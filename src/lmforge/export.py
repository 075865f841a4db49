"""Export a checkpoint as a Hugging Face model directory (config, safetensors, tokenizer files).

The byte tokenizer is exported as an equivalent ``tokenizer.json`` with the chat template, so
``transformers`` can tokenize, chat-format and decode exactly as lmforge does.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from lmforge.data.chat import BYTE_CHAT_TEMPLATE, stop_token_ids
from lmforge.errors import UserError
from lmforge.inference import load_for_inference
from lmforge.models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


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
    """Write a Hugging Face model directory for a run or checkpoint directory (see module doc).

    Written next to ``out_dir`` under a temporary name and renamed into place when complete, so an
    interrupted or failed export never leaves a half-written directory (nor harms an earlier export).
    """
    from lmforge.models.hf import save_hf_model

    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"--hf {out}: exists and is not a directory; choose an empty or new directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise UserError(f"--hf {out}: exists and is not a model directory; choose an empty or new directory")
    model, tokenizer = load_for_inference(run_or_ckpt)
    partial = out.with_name(f".{out.name}.partial")
    try:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        # Every stop token (EOS, generation_config.json's, the template's end of turn), so transformers'
        # generate stops where lmforge does.
        stops = stop_token_ids(tokenizer)
        save_hf_model(model.state_dict(), model.args, partial, bos_token_id=tokenizer.bos_id,
                      eos_token_id=stops if len(stops) > 1 else stops[0], pad_token_id=tokenizer.pad_id)
        _write_tokenizer(tokenizer, partial)
        old = out.with_name(f".{out.name}.old")
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
        os.replace(partial, out)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        shutil.rmtree(partial, ignore_errors=True)
        raise UserError(f"--hf {out}: cannot write the export ({e.strerror or e})") from None
    return out
