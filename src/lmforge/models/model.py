"""Llama-style decoder-only transformer, with the options of its popular relatives.

The layout follows Llama exactly (RMSNorm, rotary embeddings in the Hugging Face
``rotate_half`` convention, grouped-query attention, SwiGLU MLP) so that Hugging Face
checkpoints map onto it tensor-for-tensor with no permutation (see ``lmforge.models.hf``).
The family options (``ModelArgs.qkv_bias``, ``qk_norm``, explicit ``head_dim``,
``sliding_window``) cover Qwen2/2.5, Qwen3 and Mistral with the same modules.

Attention always goes through ``F.scaled_dot_product_attention`` (``lmforge.models.attention``)
so PyTorch can pick flash / memory-efficient kernels; the plain causal case passes
``is_causal=True`` (no mask tensor at all), which is the fast path on GPUs; a sliding window
only adds a banded mask once the sequence is longer than the window. Packed batches
(``document_ids``) run causal SDPA per document, never a T x T mask; reading the document
boundaries is the forward's only host sync (once per batch, outside any compiled block).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lmforge.errors import UserError
from lmforge.models.args import MODEL_SIZES, ModelArgs, model_args_for
from lmforge.models.attention import (
    PackedLayout,
    attend,
    packed_layout,
    sliding_window_mask,
)

__all__ = [
    "MODEL_SIZES", "ModelArgs", "model_args_for", "Transformer", "TransformerBlock", "Attention", "FeedForward",
    "RMSNorm", "RotaryEmbedding", "apply_rope", "rms_norm", "document_mask", "sliding_window_mask",
]

if TYPE_CHECKING:  # pragma: no cover
    from lmforge.models.kv_cache import KVCache

OutputHead = Callable[[Tensor, Tensor], Any]
"""(final-normed hidden states [B, T, dim], output weight [vocab, dim]) -> anything: see ``Transformer.forward``."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension (``RMSNorm.forward``; also used by the decode step)."""
    # Normalise in fp32 and cast back before the weight, as Llama does; this keeps
    # bf16 numerics identical to reference implementations.
    dtype = x.dtype
    if dtype == torch.float32:  # same math, one fused kernel
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _rope_inv_freq(args: ModelArgs, device: torch.device | str | None) -> Tensor:
    hd = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=device).float() / hd))
    sc = args.rope_scaling
    kind = None if sc is None else sc.get("rope_type", sc.get("type"))
    if kind is None or kind == "default":
        return inv
    if kind == "linear":  # positions divided by `factor`, i.e. every frequency slowed down
        return inv / float(sc["factor"])
    # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, and the band
    # in between interpolated smoothly.
    factor = float(sc["factor"])
    low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old_ctx = float(sc["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions ``[0, max_seq_len)``, always kept in fp32.

    The tables are non-persistent buffers (never checkpointed). ``_apply`` is overridden so
    that ``model.to(torch.bfloat16)`` does not round them: they are rebuilt in fp32 instead.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.rebuild()

    def rebuild(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the tables, e.g. after ``to_empty`` from the meta device."""
        device = self.cos.device if device is None else device
        if torch.device(device).type == "meta":
            shape = (self.args.max_seq_len, self.args.head_dim)
            self.cos = torch.empty(shape, device="meta")
            self.sin = torch.empty(shape, device="meta")
            return
        inv = _rope_inv_freq(self.args, device)
        pos = torch.arange(self.args.max_seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(pos, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        # sin carries rotate_half's sign (first half negated), so applying RoPE needs only
        # a roll of x instead of split + negate + concat: x*cos + roll(x, hd/2)*sin.
        half = emb.shape[-1] // 2
        sin = emb.sin()
        sin[:, :half].neg_()
        self.cos, self.sin = emb.cos(), sin

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        super()._apply(fn, recurse)
        if self.cos.dtype != torch.float32:
            self.rebuild(self.cos.device)
        return self

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Gather tables for ``position_ids`` [B, T] -> cos, signed sin [B, 1, T, head_dim] in ``dtype``.

        The cast to the activation dtype matches Hugging Face, so bf16 runs agree with it too.
        """
        cos = self.cos[position_ids].unsqueeze(1).to(dtype)
        sin = self.sin[position_ids].unsqueeze(1).to(dtype)
        return cos, sin


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotate [B, H, T, head_dim] by the given angles (Hugging Face ``rotate_half`` layout).

    Equals ``x * cos + rotate_half(x) * sin`` exactly, with ``signed_sin`` as produced by
    ``RotaryEmbedding`` (its first half negated).
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)
        # Qwen3: per-head RMSNorm of q and k (over head_dim, weights shared by all heads).
        self.q_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | PackedLayout | None, is_causal: bool,
        kv_cache: KVCache | None = None, layer_idx: int = 0,
    ) -> Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(layer_idx, k, v)
        out = attend(q, k, v, mask, is_causal, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(out.reshape(B, T, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)`` (w1 = gate, w3 = up, w2 = down)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_idx: int, args: ModelArgs) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | PackedLayout | None = None, is_causal: bool = True,
        kv_cache: KVCache | None = None,
    ) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, is_causal, kv_cache, self.layer_idx)
        return h + self.feed_forward(self.ffn_norm(h))


def document_mask(document_ids: Tensor) -> Tensor:
    """Block-diagonal causal mask [B, 1, T, T]: i attends j iff j <= i and same document.

    The dense reference for packed attention; the model itself uses ``packed_layout``, whose
    memory grows with the tokens per document instead of T^2.
    """
    T = document_ids.shape[1]
    same = document_ids.unsqueeze(2) == document_ids.unsqueeze(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
    return (same & causal).unsqueeze(1)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.rope = RotaryEmbedding(args)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the output projection with the embedding table when ``tie_embeddings``.

        Call again after anything that replaces parameters (e.g. ``load_state_dict(assign=True)``).
        """
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Deterministic init: N(0, 0.02), residual output projections scaled by 1/sqrt(2 L).

        The scaling keeps the residual stream's variance from growing with depth (GPT-2).
        A per-call generator (not the global RNG) makes the result depend only on ``seed``.
        Also rebuilds the RoPE tables, so this completes a meta-device ``to_empty`` init.
        """
        device = self.tok_embeddings.weight.device
        gen = None
        if seed is not None and device.type != "meta":
            gen = torch.Generator(device=device).manual_seed(seed)
        std = 0.02
        resid_std = std / math.sqrt(2 * self.args.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, 0.0, std, generator=gen)
        for layer in self.layers:
            for lin in (layer.attention.wq, layer.attention.wk, layer.attention.wv,
                        layer.feed_forward.w1, layer.feed_forward.w3):
                nn.init.normal_(lin.weight, 0.0, std, generator=gen)
            for lin in (layer.attention.wo, layer.feed_forward.w2):
                nn.init.normal_(lin.weight, 0.0, resid_std, generator=gen)
            for lin in (layer.attention.wq, layer.attention.wk, layer.attention.wv):
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)
            for norm in (layer.attention_norm, layer.ffn_norm, layer.attention.q_norm, layer.attention.k_norm):
                if norm is not None:
                    nn.init.ones_(norm.weight)
        nn.init.ones_(self.norm.weight)
        if not self.args.tie_embeddings:
            nn.init.normal_(self.output.weight, 0.0, std, generator=gen)
        self.rope.rebuild(device)

    def hidden_states(
        self, tokens: Tensor, position_ids: Tensor | None = None, document_ids: Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> Tensor:
        """Final-normed hidden states [B, T, dim] (``forward`` minus the output projection).

        Exposed so callers can project only the positions they need (generation, chunked loss).
        """
        _, T = tokens.shape
        if T > self.args.max_seq_len:
            raise UserError(
                f"sequence length {T} exceeds the model's max_seq_len {self.args.max_seq_len}; "
                "use shorter sequences or a larger max_seq_len"
            )
        start = 0 if kv_cache is None else kv_cache.pos
        if position_ids is None:
            position_ids = torch.arange(start, start + T, device=tokens.device).unsqueeze(0)
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope(position_ids, h.dtype)

        mask: Tensor | PackedLayout | None = None
        is_causal = True
        if kv_cache is not None:
            if document_ids is not None:
                raise ValueError("document_ids cannot be combined with a kv_cache")
            mask = kv_cache.attn_mask(T)
            is_causal = mask is None and T > 1
        else:
            window = self.args.sliding_window
            if document_ids is not None:  # per-document causal attention, window applied inside
                mask, is_causal = packed_layout(document_ids, window), False
            elif window is not None and T > window:  # shorter sequences: the band is the causal mask
                mask, is_causal = sliding_window_mask(T, window, tokens.device), False

        for layer in self.layers:
            h = layer(h, cos, sin, mask, is_causal, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(T)
        return self.norm(h)

    def forward(
        self, tokens: Tensor, position_ids: Tensor | None = None, document_ids: Tensor | None = None,
        kv_cache: KVCache | None = None, head: OutputHead | None = None,
    ) -> Any:
        """Logits [B, T, vocab_size] (in the model's dtype), or ``head(hidden, output_weight)``.

        ``document_ids`` [B, T] switches to block-diagonal causal attention for packed
        sequences; the caller then supplies ``position_ids`` that restart at 0 per document.
        With a ``kv_cache`` the new keys/values are appended to the cache and attention
        covers everything cached so far (see ``lmforge.models.kv_cache.KVCache``).

        ``head`` replaces the output projection: it gets the final-normed hidden states [B, T, dim]
        and the output weight [vocab_size, dim] and its result is returned (e.g. the chunked loss of
        ``lmforge.training.chunked_loss``, which never holds all logits at once). It runs here, inside
        forward, rather than on ``hidden_states`` afterwards, because wrappers act only on a forward
        call: FSDP2 unshards the root's parameters (the output weight among them) for that call only.
        """
        h = self.hidden_states(tokens, position_ids, document_ids, kv_cache)
        if head is not None:
            return head(h, self.output.weight)
        return self.output(h)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Unique parameter count (tied weights counted once).

        ``exclude_embeddings`` subtracts the embedding table (the usual "non-embedding"
        count); an untied output projection stays in. FLOP accounting lives in
        ``lmforge.models.flops`` and always counts the output matmul.
        """
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.tok_embeddings.weight.numel()
        return n
