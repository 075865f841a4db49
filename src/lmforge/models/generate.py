"""Batched autoregressive generation with a preallocated KV cache.

Prompts of different lengths are left-padded so that every row's next token lands in the
same cache column; the cache remembers which columns hold padding and the attention mask
hides them. Each row's position ids start at 0 at its first real token, so results do not
depend on how much padding a row received.

The decode loop runs one forward of length 1 per step and touches the host only to check,
now and then, whether every row has finished (every step on CPU where a sync is free,
every ``_SYNC_EVERY`` steps on accelerators).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from lmforge.errors import UserError
from lmforge.models.kv_cache import KVCache
from lmforge.models.model import Transformer

_SYNC_EVERY = 16


def _sample(logits: Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> Tensor:
    """Next token per row from last-position logits [B, V]."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        # Drop a token when the mass strictly before it already reaches top_p: the smallest
        # prefix whose mass is >= top_p is kept, and the top token always survives.
        drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        choice = torch.multinomial(sorted_p, 1, generator=generator)
        return idx.gather(-1, choice).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _decode(
    model: Transformer, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int], pad_id: int,
    temperature: float, top_p: float, generator: torch.Generator | None, lockstep: bool = False,
) -> Tensor:
    """Prefill + decode loop; returns new tokens [B, steps] (rows padded after their stop token)."""
    B = len(prompts)
    P = max(len(p) for p in prompts)
    total = P + max_new_tokens
    device = model.tok_embeddings.weight.device

    rows = [[pad_id] * (P - len(p)) + list(p) for p in prompts]
    tokens = torch.tensor(rows, dtype=torch.long, device=device)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
    valid = torch.arange(P, device=device).unsqueeze(0) >= (P - lengths).unsqueeze(1)
    position_ids = (valid.long().cumsum(dim=1) - 1).clamp_(min=0)
    padded = any(len(p) != P for p in prompts)
    cache = KVCache.for_model(model, B, total, valid if padded else None)

    h = model.hidden_states(tokens, position_ids=position_ids, kv_cache=cache)
    logits = model.output(h[:, -1])
    next_pos = lengths.unsqueeze(1)
    out = torch.empty(B, max_new_tokens, dtype=torch.long, device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    sync_every = 1 if device.type == "cpu" else _SYNC_EVERY
    stops = torch.tensor(stop_ids, dtype=torch.long, device=device)
    steps = max_new_tokens
    for step in range(max_new_tokens):
        tok = _sample(logits, temperature, top_p, generator)
        if stop_ids:
            tok = tok.masked_fill(finished, pad_id)
            finished |= torch.isin(tok, stops)
        out[:, step] = tok
        if step + 1 == max_new_tokens:
            break
        if stop_ids and (step + 1) % sync_every == 0 and _all_finished(finished, lockstep):
            steps = step + 1
            break
        h = model.hidden_states(tok.unsqueeze(1), position_ids=next_pos, kv_cache=cache)
        logits = model.output(h[:, -1])
        next_pos = next_pos + 1
    return out[:, :steps]


def _all_finished(finished: Tensor, lockstep: bool) -> bool:
    """Whether every row is done; with ``lockstep`` on several ranks, every row of every rank."""
    if not (lockstep and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return bool(finished.all())
    pending = (~finished).any().float().reshape(1)
    torch.distributed.all_reduce(pending, op=torch.distributed.ReduceOp.MAX)
    return not bool(pending.item())


@torch.no_grad()
def generate(
    model: Transformer, prompts: list[list[int]], max_new_tokens: int, *,
    stop_ids: int | Sequence[int] | None = None, pad_id: int, temperature: float = 1.0, top_p: float = 1.0,
    generator: torch.Generator | None = None, eos_id: int | None = None, lockstep: bool = False,
) -> list[list[int]]:
    """Continue each prompt by up to ``max_new_tokens`` tokens; return only the new tokens.

    ``temperature == 0`` is greedy decoding; otherwise softmax sampling at ``temperature``
    restricted to the nucleus ``top_p``. A row stops after emitting any of ``stop_ids`` (included
    in its output; :func:`lmforge.data.chat.stop_token_ids` gives a tokenizer's full set, since a
    chat model's turn often ends with a token other than EOS). ``eos_id`` is one more stop id.
    Sampling is reproducible given a seeded ``generator`` on the model's device. The model is run
    in eval mode and its training flag restored afterwards. ``lockstep`` (with a process group of
    several ranks) decodes until every rank's rows are done, so all ranks run the same number of
    forwards (needed when a forward holds a collective); every rank must then call with the same
    ``max_new_tokens`` and stop ids.
    """
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise UserError("generate: every prompt needs at least one token")
    if temperature < 0 or not 0.0 < top_p <= 1.0:
        raise UserError(f"generate: need temperature >= 0 and 0 < top_p <= 1 (got {temperature}, {top_p})")
    if max_new_tokens <= 0:
        return [[] for _ in prompts]
    P = max(len(p) for p in prompts)
    if P + max_new_tokens > model.args.max_seq_len:
        raise UserError(
            f"generate: longest prompt ({P}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len "
            f"{model.args.max_seq_len}"
        )
    stops = [stop_ids] if isinstance(stop_ids, int) else list(stop_ids or [])
    stops = list(dict.fromkeys(stops + ([eos_id] if eos_id is not None else [])))
    was_training = model.training
    model.eval()
    try:
        # inference_mode skips autograd's version-counter bookkeeping: measurably cheaper
        # per step for small models, and nothing made here needs gradients.
        with torch.inference_mode():
            out = _decode(model, prompts, max_new_tokens, stops, pad_id, temperature, top_p, generator, lockstep)
    finally:
        model.train(was_training)

    result = out.tolist()
    if stops:
        stop_set = set(stops)
        for r in result:
            end = next((i for i, t in enumerate(r) if t in stop_set), None)
            if end is not None:
                del r[end + 1:]
    return result
