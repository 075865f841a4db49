"""Batched autoregressive generation with a preallocated KV cache.

Prompts of different lengths are left-padded so that every row's next token lands in the
same cache column; the cache remembers which columns hold padding and the attention mask
hides them. Each row's position ids start at 0 at its first real token, so results do not
depend on how much padding a row received.

What makes it fast (docs/performance.md has the measurements):

- prompts are split into batches of similar length (:func:`length_buckets`) when one long
  prompt would otherwise pad many short ones;
- identical prompts (GRPO samples each prompt several times) are prefilled once and their
  cache rows copied;
- each decode step of a plain model runs :func:`lmforge.models.decode_step.decode_step` (fused
  weights, no module calls, RoPE rows precomputed for every step); other models (adapters,
  FSDP, hooks) run their own forward one token at a time;
- sampling stays on the device; the host reads only whether every row has finished: every
  step on CPU, where that read is free, every ``_SYNC_EVERY`` steps on accelerators.

``lockstep=True`` makes that check a MAX all-reduce over the ranks, so that every rank runs the
same number of forward calls (FSDP's forward gathers parameters: one rank stopping early would
leave the others waiting for it).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lmforge.errors import UserError
from lmforge.models.decode_step import DecodeWeights, decode_step, decode_step_static, supports
from lmforge.models.layers.kv_cache import KVCache
from lmforge.models.model import Transformer

_SYNC_EVERY = 16
"""Decode steps between two host reads of the finished flags on an accelerator, or with lockstep."""

_TRANSPOSED_MIN_ROWS = 4
"""CPU batches from this many rows use transposed weights (see ``lmforge.models.decode_step``)."""

_COMPILE_LEN_STEP = 128
"""With ``compile=True`` the cache length is rounded up to a multiple of this (one graph per shape)."""

_STEP_ROWS = {"cpu": 20}
"""The fixed cost of one decode step, in rows of batch, per device type (used by
:func:`length_buckets`): a step of ``B`` rows costs about ``B + _STEP_ROWS`` rows. CPU: the
``small`` model's step matmuls took 3.1 ms at batch 8 and 9.0 ms at batch 64, i.e. a + b B with
a ~ 21 rows. Accelerators (default 256) run a small batch's step in about the same time for any B."""


def length_buckets(lengths: Sequence[int], max_new_tokens: int, step_rows: int = 20,
                   unique: Sequence[int] | None = None) -> list[list[int]]:
    """Row indices grouped into batches of similar prompt length, longest first.

    One batch pads every prompt to its longest, so a single long prompt makes every row's
    prefill long; but each extra batch runs its own decode loop, and a step has a fixed cost of
    about ``step_rows`` rows on top of its rows. The split minimises, exactly (dynamic
    programming over the distinct lengths), the sum over batches of prefill tokens (padding
    included; ``unique`` [i] = 1 marks the rows that are prefilled, default all) plus
    ``max_new_tokens * (rows + step_rows)``.
    """
    unique = [1] * len(lengths) if unique is None else unique
    distinct = sorted(set(lengths), reverse=True)
    rank = {n: i for i, n in enumerate(distinct)}
    rows = [0] * len(distinct)
    prefilled = [0] * len(distinct)
    for n, u in zip(lengths, unique):
        rows[rank[n]] += 1
        prefilled[rank[n]] += u
    # best[j]: cheapest split of the j longest lengths; a batch distinct[i:j] pads to distinct[i].
    best = [0] + [float("inf")] * len(distinct)
    cut = [0] * (len(distinct) + 1)
    for j in range(1, len(distinct) + 1):
        r = p = 0
        for i in range(j - 1, -1, -1):
            r, p = r + rows[i], p + prefilled[i]
            cost = best[i] + p * distinct[i] + max_new_tokens * (r + step_rows)
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(distinct)
    while j > 0:
        groups.append(set(distinct[cut[j]:j]))
        j = cut[j]
    return [[k for k, n in enumerate(lengths) if n in g] for g in reversed(groups)]


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


def _lockstep_active(lockstep: bool) -> bool:
    return lockstep and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_finished(finished: Tensor, lockstep: bool) -> bool:
    """Whether every row has finished; with ``lockstep``, on every rank (one MAX all-reduce)."""
    if not lockstep:
        return bool(finished.all())
    pending = (~finished).any().to(torch.int32)
    dist.all_reduce(pending, op=dist.ReduceOp.MAX)
    return not bool(pending)


def _last_logits(model: Transformer, tokens: Tensor, position_ids: Tensor, cache: KVCache) -> Tensor:
    """The model's own forward over ``tokens``, projecting only the last position.

    Through ``forward`` (not ``hidden_states``) so wrappers that act on a forward call (FSDP's
    parameter gathering) see every step.
    """
    return model(tokens, position_ids=position_ids, kv_cache=cache, head=lambda h, _w: model.output(h[:, -1]))


def _decode(
    model: Transformer, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int], pad_id: int,
    temperature: float, top_p: float, generator: torch.Generator | None, lockstep: bool, compile: bool,
) -> Tensor:
    """Prefill + decode loop; returns new tokens [B, steps] (rows padded after their stop token)."""
    device = model.tok_embeddings.weight.device
    # Prefill each distinct prompt once; `index` maps every row to its prefilled row.
    first: dict[tuple[int, ...], int] = {}
    inverse = [first.setdefault(tuple(p), len(first)) for p in prompts]
    unique = [list(p) for p in first]
    B, U = len(prompts), len(unique)
    P = max(len(p) for p in unique)
    tokens = torch.tensor([[pad_id] * (P - len(p)) + p for p in unique], dtype=torch.long, device=device)
    lengths = torch.tensor([len(p) for p in unique], dtype=torch.long, device=device)
    valid = torch.arange(P, device=device).unsqueeze(0) >= (P - lengths).unsqueeze(1)
    position_ids = (valid.long().cumsum(dim=1) - 1).clamp_(min=0)
    padded = any(len(p) != P for p in unique)
    total = P + max_new_tokens
    if compile:  # fewer distinct cache shapes, fewer recompiles
        total = min(-(-total // _COMPILE_LEN_STEP) * _COMPILE_LEN_STEP, model.args.max_seq_len)
    cache = KVCache.for_model(model, U, total, valid if padded else None)
    logits = _last_logits(model, tokens, position_ids, cache)
    if U < B:
        index = torch.tensor(inverse, dtype=torch.long, device=device)
        cache.select_rows(index)
        logits, lengths = logits.index_select(0, index), lengths.index_select(0, index)

    step_fn = _step_function(model, lengths, max_new_tokens, cache, compile)
    out = torch.empty(B, max_new_tokens, dtype=torch.long, device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    sync_every = 1 if device.type == "cpu" and not lockstep else _SYNC_EVERY
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
        logits = step_fn(step, tok)
    return out[:, :steps]


def _step_function(model: Transformer, lengths: Tensor, max_new_tokens: int, cache: KVCache,
                   compile: bool) -> Callable[[int, Tensor], Tensor]:
    """``(step, tokens [B]) -> logits [B, V]`` for the token sampled at decode step ``step``."""
    if not supports(model):
        return lambda step, tok: _last_logits(model, tok.unsqueeze(1), (lengths + step).unsqueeze(1), cache)
    # Compiled: unfused weights, so the step reads the parameters themselves, whose addresses
    # stay fixed across calls (a CUDA graph then never copies weights in).
    on_cpu = lengths.device.type == "cpu" and not torch.is_autocast_enabled("cpu")
    weights = DecodeWeights.from_model(model, fuse=not compile,
                                       transpose=on_cpu and len(lengths) >= _TRANSPOSED_MIN_ROWS)
    # Every step's RoPE rows, gathered once: row r's token of step s sits at position lengths[r] + s.
    pos = lengths.unsqueeze(1) + torch.arange(max(max_new_tokens - 1, 1), device=lengths.device)
    cos = model.rope.cos[pos].to(weights.embedding.dtype)
    sin = model.rope.sin[pos].to(weights.embedding.dtype)
    if not compile:
        return lambda step, tok: decode_step(weights, tok, cos[:, step, None], sin[:, step, None], cache)
    step_fn = _compiled_step(lengths.device.type)
    slot = torch.tensor(cache.pos, device=lengths.device)
    bias = cache.bias if cache.bias is not None else torch.zeros(
        len(lengths), cache.max_len, dtype=weights.embedding.dtype, device=lengths.device)
    for t in (*cache.k, *cache.v):
        # written in place by the step: a CUDA graph needs them at fixed addresses; no guard, so a
        # new cache (the next call) re-records the graph instead of recompiling.
        torch._dynamo.mark_static_address(t, guard=False)

    def run(step: int, tok: Tensor) -> Tensor:
        logits = step_fn(weights, tok, cos[:, step, None], sin[:, step, None], slot, cache.k, cache.v, bias)
        slot.add_(1)
        return logits

    return run


_COMPILED: dict[str, Callable[..., Tensor]] = {}


def _compiled_step(device_type: str) -> Callable[..., Tensor]:
    """``decode_step_static`` under ``torch.compile``: CUDA graphs (``reduce-overhead``) on CUDA."""
    if device_type not in _COMPILED:
        mode = "reduce-overhead" if device_type == "cuda" else None
        _COMPILED[device_type] = torch.compile(decode_step_static, mode=mode, dynamic=False)
    return _COMPILED[device_type]


@torch.no_grad()
def generate(
    model: Transformer, prompts: list[list[int]], max_new_tokens: int, *,
    stop_ids: int | Sequence[int] | None = None, pad_id: int, temperature: float = 1.0, top_p: float = 1.0,
    generator: torch.Generator | None = None, eos_id: int | None = None, lockstep: bool = False,
    compile: bool = False,
) -> list[list[int]]:
    """Continue each prompt by up to ``max_new_tokens`` tokens; return only the new tokens.

    ``temperature == 0`` is greedy decoding; otherwise softmax sampling at ``temperature``
    restricted to the nucleus ``top_p``. A row stops after emitting any of ``stop_ids`` (included
    in its output; :func:`lmforge.data.chat.stop_token_ids` gives a tokenizer's full set, since a
    chat model's turn often ends with a token other than EOS). ``eos_id`` is one more stop id.
    Sampling is reproducible given a seeded ``generator`` on the model's device. The model is run
    in eval mode and its training flag restored afterwards.

    ``lockstep=True``, when ``torch.distributed`` is initialized with more than one rank: every
    rank runs the same number of model forward calls (one prefill, then decode steps until the
    rows of *all* ranks have finished; finished rows emit ``pad_id``, which is cut off as usual),
    as a forward with collectives (FSDP) needs. The results equal ``lockstep=False``. Every rank
    must call it with the same ``max_new_tokens`` and at least one prompt.

    ``compile=True`` runs the decode step under ``torch.compile`` with fixed shapes; on CUDA as a
    CUDA graph (``mode="reduce-overhead"``), which removes the per-kernel launch cost that
    dominates small-batch decoding on a GPU. Off by default: the first call of each batch shape
    compiles for tens of seconds, and on the measured 2-vCPU CPU the compiled step was slower
    than the eager one (docs/performance.md). Models the fused step does not support ignore it.
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
    lockstep = _lockstep_active(lockstep)
    device = model.tok_embeddings.weight.device
    if lockstep:  # one batch per rank: buckets could differ in number between ranks
        buckets = [list(range(len(prompts)))]
    else:
        first_of = {tuple(p): i for i, p in reversed(list(enumerate(prompts)))}
        prefilled = [int(first_of[tuple(p)] == i) for i, p in enumerate(prompts)]
        buckets = length_buckets([len(p) for p in prompts], max_new_tokens, _STEP_ROWS.get(device.type, 256),
                                 prefilled)
    result: list[list[int]] = [[] for _ in prompts]
    was_training = model.training
    model.eval()
    try:
        # inference_mode skips autograd's version-counter bookkeeping: measurably cheaper
        # per step for small models, and nothing made here needs gradients.
        with torch.inference_mode():
            for rows in buckets:
                out = _decode(model, [prompts[i] for i in rows], max_new_tokens, stops, pad_id, temperature, top_p,
                              generator, lockstep, compile)
                for i, r in zip(rows, out.tolist()):
                    result[i] = r
    finally:
        model.train(was_training)

    if stops:
        stop_set = set(stops)
        for r in result:
            end = next((i for i, t in enumerate(r) if t in stop_set), None)
            if end is not None:
                del r[end + 1:]
    return result
