"""The model's memory model: where its parameters live, and what autograd saves per block.

What the planner (:mod:`lmforge.planning.planner`) needs to know of a model, computed from the blocks'
module configs (``args.decoder_config()``), so a family with modules of its own is counted by its
configs' types, never by names. Parameter counts are exact: one block of each distinct config is built
on the meta device and its parameters sorted by role. The saved-activation counts are formulas of
lmforge's own modules, measured for the gated decoders (``bench/plan_memory.py``); latent attention's and
the shared experts' are counted the same way but were not measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from lmforge.models.args import ModelArgs
from lmforge.models.configs import AttentionConfig, BlockConfig, LatentAttentionConfig, MLPConfig, MoEConfig

__all__ = ["ParamCounts", "block_activation_bytes", "mlp_transient", "param_counts"]


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts by where they live (tied output: ``output`` is 0)."""

    embedding: int
    output: int
    final_norm: int
    block_dense: list[int]
    """Per block: the matrices tensor parallelism splits (attention and dense MLP projections)."""
    block_experts: list[int]
    """Per block: the routed experts' weights (0 for a dense block)."""
    block_small: list[int]
    """Per block: what is replicated under tp (norms, biases, sinks, the router)."""
    buffers: int
    """Elements of the RoPE tables (fp32, not trained)."""

    @property
    def total(self) -> int:
        return (self.embedding + self.output + self.final_norm + sum(self.block_dense) + sum(self.block_experts)
                + sum(self.block_small))


@lru_cache(maxsize=64)
def _block_counts(cfg: BlockConfig) -> tuple[int, int, int]:
    """(dense, experts, small) parameters of one block, from a meta-device build of it."""
    from lmforge.models.layers.moe import GroupedExperts
    from lmforge.models.model import TransformerBlock

    with torch.device("meta"):
        block = TransformerBlock(0, cfg)
    dense = {id(p) for p in block.hidden_matrices()}
    experts = {id(p) for m in block.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    counts = [0, 0, 0]
    for p in block.parameters():
        counts[0 if id(p) in dense else 1 if id(p) in experts else 2] += p.numel()
    return counts[0], counts[1], counts[2]


def param_counts(args: ModelArgs) -> ParamCounts:
    cfg = args.decoder_config()
    dense, experts, small = zip(*(_block_counts(b) for b in cfg.blocks))
    d, vocab = cfg.dim, cfg.vocab_size
    return ParamCounts(embedding=vocab * d, output=0 if cfg.tie_embeddings else vocab * d, final_norm=d,
                       block_dense=list(dense), block_experts=list(experts), block_small=list(small),
                       buffers=sum(2 * r.max_seq_len * r.dim for r in cfg.ropes.values()))


def _norm_bytes(d: int, tokens_sp: float, tokens: float, consumers: int, a: int) -> float:
    """An RMSNorm on the fp32 residual stream saves its input and 1/rms (fp32, on the sequence-parallel
    shard; lmforge.models.layers.norm recomputes the normalised values in the backward); its output is
    saved by the linears that read it: once in fp32 (shared), or once per linear in bf16 (autocast casts
    on each call). Under tp the linears read the all-gathered output, so that copy is of every token."""
    own = (4 * d + 4) * tokens_sp
    return own + (4 * d if a == 4 else consumers * a * d) * tokens


def _attention_bytes(att: AttentionConfig | LatentAttentionConfig, tokens: float, sp: float, a: int, tp: int,
                     cp: int, row: int, explicit_len: int) -> float:
    d, H = att.dim, att.n_heads
    per_head = 2 * explicit_len if explicit_len else 4  # probabilities (bf16) or log-sum-exp (fp32)
    if isinstance(att, LatentAttentionConfig):
        # the norm's output read by the q and kv down-projections; the latents, their norms' inputs and
        # 1/rms; the up-projected q, k (nope | rope) and v; SDPA's output and log-sum-exp
        total = _norm_bytes(d, sp, tokens, 2, a)
        rq = att.q_lora_rank or 0
        total += (2 * a * (rq + att.kv_lora_rank) + a * att.qk_rope_head_dim + 8) * tokens
        total += (a * H * (2 * att.qk_head_dim + 2 * att.v_head_dim) + per_head * H) * tokens / tp
        if cp > 1:
            total += a * H * (att.qk_head_dim + att.v_head_dim) * tokens * (cp - 1) / tp
        return total
    kv, hd = att.n_kv_heads, att.head_dim
    total = _norm_bytes(d, sp, tokens, 3, a)  # attention_norm -> wq, wk, wv
    total += (a * 2 * (H + kv) * hd + per_head * H) * tokens / tp
    if cp > 1:  # the other ranks' keys and values (blockwise attention keeps no mask)
        total += a * 2 * kv * hd * tokens * (cp - 1) / tp
    if att.qk_norm is not None:  # the norm's input per q/k value and 1/rms per head (fp32)
        total += (a * hd + 4) * (H + kv) * tokens / tp
    return total


def block_activation_bytes(block: BlockConfig, tokens: float, a: int, tp: int = 1, cp: int = 1,
                           row: int = 0, explicit_len: int = 0) -> float:
    """Bytes autograd saves for one decoder block over ``tokens`` local tokens, compute dtype of ``a``
    bytes (4 fp32, 2 bf16 autocast), heads and hidden units split over ``tp`` (sequence parallel norms).

    Counted from lmforge's block (models/model.py, layers/*.py): per norm see :func:`_norm_bytes`; SDPA
    (the flash kernel on CPU and GPU) saves q, k, v, its output (which ``wo`` reads as it is) and a
    fp32 log-sum-exp per head; the explicit bf16 attention of short sequences on a CPU
    (``explicit_len`` keys per query, see lmforge.models.layers.causal_attention) saves q, k, v and each
    head's bf16 probabilities over the keys instead of the log-sum-exp; RoPE saves only the shared
    cos/sin tables (they need no gradient); the gated MLP saves both projections and their gated
    product (``w2``'s input; the activation is recomputed in the backward, lmforge.models.layers.mlp).
    Under context parallelism (``cp`` ranks, rows of ``row`` tokens) attention saves the keys and values
    gathered from every cp rank (the whole row's); its blockwise attention saves q, k, v, the output and
    the log-sum-exp as SDPA does, and builds masks per block only (lmforge.models.layers.blockwise_attention).
    Qwen3's q/k norms,
    Gemma's sandwich norms and the MoE routing are counted the same way but were not measured.
    """
    d = block.norm.dim
    sp = tokens / tp
    total = _attention_bytes(block.attention, tokens, sp, a, tp, cp, row, explicit_len)
    if block.sandwich_norm:  # post-attention and post-MLP norms: the sublayer output and 1/rms
        total += 2 * (a * d + 4) * sp
    ff = block.feed_forward
    if isinstance(ff, MoEConfig):
        k, fe, e = ff.router.top_k, ff.expert.hidden_dim, ff.router.n_experts
        total += _norm_bytes(d, sp, tokens, 1, a)  # ffn_norm -> router (the experts read it by index)
        total += 8 * e * tokens  # router probabilities and logits (fp32)
        total += k * (2 * a * d + 3 * a * fe / tp + 8) * tokens  # routed rows, expert MLP, weighted outputs
        if ff.shared is not None:  # the shared experts' MLP reads the same normed rows
            total += a * 3 * ff.shared.hidden_dim * tokens / tp
    else:
        total += _norm_bytes(d, sp, tokens, 2, a)  # ffn_norm -> w1, w3
        total += a * 3 * ff.hidden_dim * tokens / tp
    return total


def mlp_transient(block: BlockConfig, tokens: float, a: int, tp: int) -> float:
    """The gated MLP's backward: the product's gradient and both factors' gradients exist together
    (while the product's saved copy is already freed; the recomputed activation becomes the up
    projection's gradient in place), plus the fp32 gradient of the residual stream."""
    ff = block.feed_forward
    hidden = ff.hidden_dim if isinstance(ff, MLPConfig) else ff.router.top_k * ff.expert.hidden_dim
    return 2 * a * hidden * tokens / tp + 4 * block.norm.dim * tokens / tp
