"""DeepSeek-V3's FLOP counts (for MFU), in :mod:`lmforge.models.flops`' conventions: ``6 N`` per token for
the weight matmuls (``N`` counting the experts a token runs through, not all of them) plus the attention
scores over the causal half of the keys, where a query-key pair costs ``qk_head_dim`` for the score and
``v_head_dim`` for the value per head.

Latent attention's matmuls are counted as the module runs them during training: keys and values are
expanded from the latent for every token (``wkv_b``), not absorbed into the query and output."""

from __future__ import annotations

from typing import Iterable

from lmforge.models.args import ModelArgs
from lmforge.models.deepseek_v3.args import DeepseekV3Args
from lmforge.models.flops import attended_keys

__all__ = ["flops_per_token", "matmul_params", "training_flops"]


def _ds(args: ModelArgs) -> DeepseekV3Args:
    if not isinstance(args, DeepseekV3Args):
        raise TypeError(f"DeepSeek-V3 FLOPs need DeepseekV3Args, got {type(args).__name__}")
    return args


def matmul_params(args: ModelArgs) -> int:
    """Parameters in a matmul per token: latent attention's projections, the dense MLPs or (MoE layers) the
    router, the ``n_experts_per_token`` routed experts and the shared MLP, and the output head."""
    a = _ds(args)
    d, H = a.dim, a.n_heads
    q = d * H * a.qk_head_dim if a.q_lora_rank is None else d * a.q_lora_rank + a.q_lora_rank * H * a.qk_head_dim
    attn = q + d * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * H * (a.qk_nope_head_dim + a.v_head_dim) \
        + H * a.v_head_dim * d
    mlp = 0
    for layer in range(a.n_layers):
        if a.is_moe_layer(layer):
            mlp += d * a.n_experts + (a.n_experts_per_token + a.n_shared_experts) * 3 * d * a.expert_ffn_dim
        else:
            mlp += 3 * d * a.ffn_dim
    return a.n_layers * attn + mlp + d * a.vocab_size


def _weight_flops(args: ModelArgs, adapter_params: int | None) -> float:
    if adapter_params is None:
        return 6.0 * matmul_params(args)
    return 4.0 * matmul_params(args) + 6.0 * adapter_params


def _pair_flops(args: ModelArgs) -> float:
    """Training FLOPs of one query-key pair over all layers: ``6 * H * (qk_head_dim + v_head_dim)`` each."""
    a = _ds(args)
    return 6.0 * a.n_layers * a.n_heads * (a.qk_head_dim + a.v_head_dim)


def flops_per_token(args: ModelArgs, seq_len: int, adapter_params: int | None = None) -> float:
    """Training FLOPs per token at ``seq_len`` (see :func:`lmforge.models.flops.flops_per_token`)."""
    return _weight_flops(args, adapter_params) + _pair_flops(args) * attended_keys(args, seq_len)


def training_flops(args: ModelArgs, document_lengths: Iterable[int], adapter_params: int | None = None) -> float:
    """Training FLOPs of a batch's real tokens given its document lengths (see
    :func:`lmforge.models.flops.training_flops`)."""
    tokens, pairs = 0, 0.0
    for length in document_lengths:
        if length > 0:
            tokens += length
            pairs += length * attended_keys(args, length)
    return _weight_flops(args, adapter_params) * tokens + _pair_flops(args) * pairs
