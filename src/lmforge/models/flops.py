"""FLOP accounting for model FLOPs utilisation (MFU).

MFU = achieved model FLOP/s / peak FLOP/s of the hardware. The numerator counts only the
FLOPs the model mathematically needs (no recomputation from activation checkpointing),
so MFU stays comparable across memory-saving settings. The denominator is a fact of the device,
not of the model: :func:`lmforge.runtime.precision.peak_flops_per_device`.
"""

from __future__ import annotations

from typing import Iterable

from lmforge.models.args import ModelArgs
from lmforge.models.configs import AttentionConfig, LatentAttentionConfig, MLPConfig, MoEConfig


def _attention_params(att: AttentionConfig | LatentAttentionConfig) -> int:
    d = att.dim
    if isinstance(att, LatentAttentionConfig):  # q (through its low-rank bottleneck), kv latent + shared key, up, out
        H, qk = att.n_heads, att.qk_head_dim
        q = d * H * qk if att.q_lora_rank is None else d * att.q_lora_rank + att.q_lora_rank * H * qk
        kv = d * (att.kv_lora_rank + att.qk_rope_head_dim) + att.kv_lora_rank * H * (att.qk_nope_head_dim + att.v_head_dim)
        return q + kv + H * att.v_head_dim * d
    return d * att.n_heads * att.head_dim + 2 * d * att.n_kv_heads * att.head_dim + att.n_heads * att.head_dim * d


def _feed_forward_params(ff: MLPConfig | MoEConfig) -> int:
    if isinstance(ff, MLPConfig):
        return 3 * ff.dim * ff.hidden_dim
    active = ff.dim * ff.router.n_experts + ff.router.top_k * 3 * ff.dim * ff.expert.hidden_dim
    return active + (0 if ff.shared is None else 3 * ff.dim * ff.shared.hidden_dim)


def _score_dims(att: AttentionConfig | LatentAttentionConfig) -> int:
    """Features per query of ``QK^T`` plus ``AV`` (``2 * n_heads * head_dim`` for plain attention)."""
    if isinstance(att, LatentAttentionConfig):
        return att.n_heads * (att.qk_head_dim + att.v_head_dim)
    return 2 * att.n_heads * att.head_dim


def matmul_params(args: ModelArgs) -> int:
    """Parameters that take part in a matmul per token: all projections incl. the output head.

    Counted from the blocks' module configs (``args.decoder_config()``), so every family's own modules
    count as they compute. The embedding lookup is a gather, not a matmul, so it is excluded even when
    tied (the tied matrix is then counted once, as the output projection). Norm weights (incl. q/k
    norms), biases and sinks are elementwise and negligible. ``head_dim`` is taken as configured, which
    need not be ``dim / n_heads`` (Qwen3, Gemma). A mixture-of-experts layer counts its *active*
    parameters: the router plus the ``top_k`` experts each token runs through (and a shared expert),
    not all ``n_experts``; latent attention counts its low-rank projections.
    """
    cfg = args.decoder_config()
    blocks = sum(_attention_params(b.attention) + _feed_forward_params(b.feed_forward) for b in cfg.blocks)
    return blocks + cfg.dim * cfg.vocab_size


def weight_flops_per_token(args: ModelArgs, adapter_params: int | None = None) -> float:
    """Training FLOPs per token of the weight matmuls: ``6 * N`` (see :func:`flops_per_token`).

    With LoRA (``adapter_params`` trainable adapter parameters on a frozen base) the backward pass
    computes no gradients for the frozen weights, only for their inputs: ``4 * N`` for the base plus
    ``6 * adapter_params`` for the adapters' own two small matmuls per adapted layer. Counting
    ``6 * N`` there would credit LoRA runs with a third more work than they do.
    """
    if adapter_params is None:
        return 6.0 * matmul_params(args)
    return 4.0 * matmul_params(args) + 6.0 * adapter_params


def flops_per_token(args: ModelArgs, seq_len: int, adapter_params: int | None = None) -> float:
    """Training FLOPs per token (forward + backward) at sequence length ``seq_len``.

    * Weight matmuls: a token does 2 FLOPs (multiply + add) per matmul parameter in the
      forward pass and twice that in the backward pass (grads w.r.t. inputs and weights),
      so ``6 * N`` with ``N = matmul_params(args)``.
    * Attention scores: per layer a query does ``QK^T`` against ``T`` keys and ``AV``
      against ``T`` values, each ``2 * T * d`` FLOPs (``d = n_heads * head_dim``), i.e.
      ``4 * T * d`` forward and ``12 * T * d`` for training. With a causal mask a query
      only needs the keys up to itself, ``T/2`` on average, and flash / causal SDPA
      kernels really do skip the masked tiles, so we count the causal half:
      ``6 * n_layers * T * d``. Counting the full square would credit the run with work
      the kernel never performs and inflate MFU.
    * A sliding window (Mistral; Gemma 3's local layers) shrinks what a query needs further once
      ``T`` exceeds the window ``W``: the band's area per query is ``T/2 - (T - W)^2 / (2T)`` keys
      instead of ``T/2`` (the same continuous count as the causal half, and equal to it at ``T = W``).
      Each layer counts with its own window.
    """
    return weight_flops_per_token(args, adapter_params) + 6.0 * _score_flop_units(args, seq_len)


def _keys(window: int | None, T: float) -> float:
    return T / 2 if window is None or T <= window else T / 2 - (T - window) ** 2 / (2 * T)


def attended_keys(args: ModelArgs, seq_len: int) -> float:
    """Average number of keys a query needs at sequence length ``seq_len``, averaged over the layers
    (see ``flops_per_token``)."""
    blocks = args.decoder_config().blocks
    return sum(_keys(b.attention.window, float(seq_len)) for b in blocks) / len(blocks)


def _score_flop_units(args: ModelArgs, seq_len: int, layers: list[tuple[int | None, int]] | None = None) -> float:
    """Sum over layers of attended keys times score features per query (each unit is 2 FLOPs forward
    and 4 backward: ``6 *`` this is a token's training FLOPs in ``QK^T`` and ``AV``). ``layers``: each
    layer's (window, score features), when the caller has them already."""
    if layers is None:
        layers = [(b.attention.window, _score_dims(b.attention)) for b in args.decoder_config().blocks]
    return sum(_keys(window, float(seq_len)) * dims for window, dims in layers)


def training_flops(args: ModelArgs, document_lengths: Iterable[int], adapter_params: int | None = None) -> float:
    """Training FLOPs (forward + backward) of the real tokens of a batch, given as document lengths.

    Each document is a run of real tokens that attend causally among themselves only: a packed
    SFT example, a GRPO row's prompt + completion, or a whole pretraining window. Padding is not a
    document, so it costs nothing here even though the kernels run over it: MFU measures useful
    work. Per document of ``L`` tokens: ``6 * N * L`` for the weight matmuls plus
    ``12 * n_layers * d * L * attended_keys(L)`` for the attention scores, the same convention as
    :func:`flops_per_token` (a packed row of several documents costs less than one document of the
    row's length, since a query never looks past its own document). Pure host arithmetic on lengths
    known when the batch is built: no device sync.
    """
    tokens, units = 0, 0.0
    layers = [(b.attention.window, _score_dims(b.attention)) for b in args.decoder_config().blocks]
    for length in document_lengths:
        if length > 0:
            tokens += length
            units += length * _score_flop_units(args, length, layers)
    return weight_flops_per_token(args, adapter_params) * tokens + 6.0 * units
