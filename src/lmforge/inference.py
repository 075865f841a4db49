"""Using a trained model: load it with its tokenizer and continue prompts (plain or chat-formatted).

A model is found from a path that is an lmforge run directory, a checkpoint directory, a Hugging
Face model directory or a GGUF file (see :class:`lmforge.models.load.ModelSource`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from lmforge.data.chat import chat_format_for, stop_token_ids
from lmforge.errors import UserError
from lmforge.models.generate import generate
from lmforge.models.load import ModelSource, load_model
from lmforge.models.model import Transformer
from lmforge.models.tokenizer import Tokenizer


def load_for_inference(path: str | Path, device: str | torch.device = "cpu",
                       tokenizer: str = "byte") -> tuple[Transformer, Tokenizer]:
    """The model (eval mode, fp32, on ``device``) and tokenizer stored at ``path``. ``tokenizer`` names
    Hugging Face tokenizer files for a model without its own (a GGUF file) or overrides a Hugging Face
    directory's."""
    loaded = load_model(ModelSource.at(path), tokenizer=tokenizer)
    return loaded.model.to(device).eval(), loaded.tokenizer


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
    """Continue each prompt (greedy at temperature 0); returns the new text only, without the stop token.

    A row stops at any of the tokenizer's stop tokens (:func:`lmforge.data.chat.stop_token_ids`).
    """
    device = next(model.parameters()).device
    stops = stop_token_ids(tokenizer)
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = _prompt_ids(tokenizer, prompts, chat)
    budget = model.args.max_seq_len - max(len(i) for i in ids) if ids else max_new_tokens
    n = min(max_new_tokens, budget)
    texts: list[str] = []
    for lo in range(0, len(ids), batch_size):
        rows = generate(model, ids[lo: lo + batch_size], n, stop_ids=stops, pad_id=tokenizer.pad_id,
                        temperature=temperature, top_p=top_p, generator=gen)
        texts += [tokenizer.decode(r, skip_special=True) for r in rows]
    return texts


def sample_with_images(model: Transformer, tokenizer: Tokenizer, prompt: str, images: Sequence[str], *,
                       max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> str:
    """A vision-language model's reply to one user turn of ``images`` (files, shown before the text) and
    ``prompt``, in the chat format, as SFT on image records renders it; the new text only. A missing or
    unreadable image, or a text model, is one line."""
    from lmforge.data.chat import validate_messages
    from lmforge.data.image_chat import image_chat
    from lmforge.data.image_tokens import expand_markers, image_encoding_for
    from lmforge.models.vision.generate import generate_with_images

    encoding = image_encoding_for(model.args, tokenizer)
    if encoding is None:
        raise UserError(f"--image needs a vision-language model (qwen2_5_vl, qwen3_vl, gemma3); this one is "
                        f"{getattr(model.args, 'hf_model_type', 'a text model')}")
    content = [*({"type": "image", "path": str(p)} for p in images), {"type": "text", "text": prompt}]
    try:
        prepared = image_chat(validate_messages([{"role": "user", "content": content}], images=True), {},
                              Path.cwd(), encoding)
        ids = chat_format_for(tokenizer).prompt_ids(prepared.messages)
        ids, _ = expand_markers(ids, [False] * len(ids), encoding, prepared.counts)
    except ValueError as e:  # ImageError, ImageTooLarge, a template's raise_exception
        raise UserError(str(e)) from None
    pixels, grid = encoding.process(prepared.images)
    n = min(max_new_tokens, model.args.max_seq_len - len(ids))
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    new = generate_with_images(model, ids, pixels, grid, n, stop_token_ids(tokenizer), temperature, top_p, gen)
    return tokenizer.decode(new, skip_special=True)
