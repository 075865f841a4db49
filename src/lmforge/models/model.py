"""The decoder-only transformer (``Transformer``) that every built-in family builds.

It is built from a :class:`~lmforge.models.configs.DecoderConfig` (``args.decoder_config()``): one
block per :class:`~lmforge.models.configs.BlockConfig`, each module chosen by its config's type from
:mod:`lmforge.models.layers` (grouped-query or latent attention; a gated MLP or a mixture of experts;
RMSNorm; rotary tables in the Hugging Face ``rotate_half`` convention), laid out so that Hugging Face
checkpoints map onto it tensor-for-tensor with no permutation (each family's
:class:`~lmforge.models.spec.ModelSpec` holds the renaming). What only the model can name lives here:
the blocks' tensor-parallel roles, Muon's matrices, pipeline stages and the init.

The forward decides the attention pattern once per distinct window (at most two: Gemma 3's local
and global layers): plain causal (``is_causal=True``, no mask tensor: the fast path on GPUs); a
banded mask only once a sliding-window sequence is longer than the window; per-document causal
SDPA for packed batches (``document_ids``), never a T x T mask. Reading the document boundaries is
the forward's only host sync (once per batch, outside any compiled block).

The layer names are re-exported here because code across lmforge imports them from this module.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import Tensor, nn

from lmforge.errors import UserError
from lmforge.models.args import MODEL_SIZES, ModelArgs, model_args_for
from lmforge.models.configs import (
    AttentionConfig, BlockConfig, DecoderConfig, LatentAttentionConfig, MLPConfig, MoEConfig,
)
from lmforge.models.layers.attention import Attention
from lmforge.models.layers.masks import document_mask, sliding_window_mask
from lmforge.models.layers.mlp import FeedForward
from lmforge.models.layers.moe import MoEFeedForward
from lmforge.models.layers.norm import RMSNorm, rms_norm
from lmforge.models.layers.packed_attention import PackedLayout, packed_layout
from lmforge.models.layers.rope import RotaryEmbedding, apply_rope

__all__ = [
    "MODEL_SIZES", "ModelArgs", "model_args_for", "Transformer", "TransformerBlock", "Attention", "FeedForward",
    "RMSNorm", "RotaryEmbedding", "apply_rope", "rms_norm", "document_mask", "sliding_window_mask",
]

if TYPE_CHECKING:  # pragma: no cover
    from lmforge.models.layers.kv_cache import KVCache

OutputHead = Callable[[Tensor, Tensor], Any]
"""(final-normed hidden states [B, T, dim], output weight [vocab, dim]) -> anything: see ``Transformer.forward``."""


def build_attention(cfg: AttentionConfig | LatentAttentionConfig) -> nn.Module:
    """The attention module a block config names, chosen by the config's type."""
    if isinstance(cfg, LatentAttentionConfig):
        from lmforge.models.layers.latent_attention import LatentAttention

        return LatentAttention(cfg)
    return Attention(cfg)


def build_feed_forward(cfg: MLPConfig | MoEConfig) -> nn.Module:
    """The feed-forward module a block config names: a gated MLP or a mixture of experts."""
    return MoEFeedForward(cfg) if isinstance(cfg, MoEConfig) else FeedForward(cfg)


def tp_sizes(block: BlockConfig) -> dict[str, int]:
    """The sizes tensor parallelism splits in a block (config key -> size), each divisible by ``tp``."""
    sizes: dict[str, int] = {}
    att, ff = block.attention, block.feed_forward
    sizes["n_heads"] = att.n_heads
    if isinstance(att, AttentionConfig):
        sizes["n_kv_heads"] = att.n_kv_heads
    if isinstance(ff, MLPConfig):
        sizes["ffn_hidden_dim"] = ff.hidden_dim
    return sizes


def tp_problem(block: BlockConfig) -> str | None:
    """Why a block cannot be split over tensor-parallel ranks (None: it can)."""
    att = block.attention
    if isinstance(att, LatentAttentionConfig):
        return "latent attention (DeepSeek-V3) has no tensor-parallel plan yet; use FSDP2 and expert parallelism"
    if att.qk_norm == "projection":
        return ("a q/k norm over the whole projection (qk_norm_per_head=False, OLMoE) spans the heads of every "
                "rank; tensor parallelism needs per-head q/k norms")
    if att.sinks:
        return "attention sinks (gpt-oss) have no tensor-parallel plan yet"
    return None


class TransformerBlock(nn.Module):
    """Pre-norm residual block: ``h = x + attention(norm(x))``, then ``h + feed_forward(norm(h))``.

    With ``sandwich_norm`` (Gemma) each sublayer's output is normalised too before it joins the
    residual stream: ``h = x + post_attention_norm(attention(norm(x)))``, and likewise for the MLP.
    """

    def __init__(self, layer_idx: int, cfg: BlockConfig) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.attention = build_attention(cfg.attention)
        self.feed_forward = build_feed_forward(cfg.feed_forward)
        self.attention_norm = RMSNorm(cfg.norm)
        self.ffn_norm = RMSNorm(cfg.norm)
        self.post_attention_norm = RMSNorm(cfg.norm) if cfg.sandwich_norm else None
        self.post_ffn_norm = RMSNorm(cfg.norm) if cfg.sandwich_norm else None

    def hidden_matrices(self) -> list[Tensor]:
        """The block's projection matrices from hidden states to hidden states (what Muon orthogonalizes):
        attention's and a dense or shared MLP's; not the router, the stacked experts or vectors."""
        ins, outs = self.attention.weight_groups()
        ff = self.feed_forward
        dense = ff if isinstance(ff, FeedForward) else getattr(ff, "shared_experts", None)
        if dense is not None:
            f_in, f_out = dense.weight_groups()
            ins, outs = ins + f_in, outs + f_out
        return ins + outs

    def tp_plan(self) -> dict[str, str]:
        """Tensor parallelism of this block, module path -> role (Megatron's layout; the roles are
        applied by :mod:`lmforge.parallel.tensor_parallel`): ``colwise`` / ``rowwise`` projections,
        ``norm`` on the residual stream, ``head_norm`` per head, ``input`` (the sublayer's input gathered
        once for its column-parallel projections) and ``replicated`` (the whole module on every rank: a
        mixture of experts)."""
        plan = {"attention_norm": "norm", "ffn_norm": "norm", "attention": "input",
                "attention.wq": "colwise", "attention.wk": "colwise", "attention.wv": "colwise",
                "attention.wo": "rowwise"}
        if self.post_attention_norm is not None:
            plan.update({"post_attention_norm": "norm", "post_ffn_norm": "norm"})
        if getattr(self.attention, "q_norm", None) is not None:
            plan.update({"attention.q_norm": "head_norm", "attention.k_norm": "head_norm"})
        if isinstance(self.feed_forward, MoEFeedForward):
            plan["feed_forward"] = "replicated"
        else:
            plan.update({"feed_forward": "input", "feed_forward.w1": "colwise", "feed_forward.w3": "colwise",
                         "feed_forward.w2": "rowwise"})
        return plan

    @torch.no_grad()
    def init_weights(self, std: float, resid_std: float, gen: torch.Generator | None) -> None:
        """N(0, std) for the matrices that read the block's input, N(0, resid_std) for those that write
        into the residual stream, identity norms, zero biases (and sinks, correction biases). Each
        sublayer names its own matrices (``weight_groups``); every input matrix is drawn before any
        output one, so a dense block draws in the order it always has."""
        groups = [part.weight_groups() for part in (self.attention, self.feed_forward)]
        inputs = [w for ins, _ in groups for w in ins]
        outputs = [w for _, outs in groups for w in outs]
        for w in inputs:
            nn.init.normal_(w, 0.0, std, generator=gen)
        for w in outputs:
            nn.init.normal_(w, 0.0, resid_std, generator=gen)
        drawn = {id(w) for w in inputs + outputs}
        norms = [m for m in self.modules() if isinstance(m, RMSNorm)]
        for norm in norms:
            norm.reset_parameters()
        normed = {id(n.weight) for n in norms}
        for tensor in [*self.parameters(), *self.buffers()]:
            if id(tensor) not in drawn and id(tensor) not in normed and tensor.is_floating_point():
                tensor.zero_()

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | PackedLayout | None = None, is_causal: bool = True,
        kv_cache: KVCache | None = None,
    ) -> Tensor:
        a = self.attention(self.attention_norm(x), cos, sin, mask, is_causal, kv_cache, self.layer_idx)
        h = x + (a if self.post_attention_norm is None else self.post_attention_norm(a))
        f = self.feed_forward(self.ffn_norm(h))
        return h + (f if self.post_ffn_norm is None else self.post_ffn_norm(f))


class Transformer(nn.Module):
    """Embedding, ``n_layers`` blocks, final RMSNorm and output projection (optionally tied to the embedding)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        cfg: DecoderConfig = args.decoder_config()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, block) for i, block in enumerate(cfg.blocks))
        self.norm = RMSNorm(cfg.norm)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Every rotary table the blocks name (Gemma 3's local layers rotate with their own base).
        self.ropes = nn.ModuleDict({name: RotaryEmbedding(rope) for name, rope in cfg.ropes.items()})
        # Per layer, decided once: (its sliding window, the name of its rotary table).
        self.layer_plan = [(b.attention.window, b.attention.rope) for b in cfg.blocks]
        # Set by lmforge.parallel.context_parallel.apply_cp: tokens are this rank's shard of longer rows.
        self.context_parallel: Any = None
        self.tie_weights()

    FIRST_STAGE_MODULES = ("tok_embeddings",)
    """What only a pipeline's first stage holds (before the blocks)."""
    LAST_STAGE_MODULES = ("norm", "output")
    """What only a pipeline's last stage holds (after the blocks)."""

    def pipeline_stage(self, layers: range, first: bool, last: bool) -> Transformer:
        """A pipeline stage: a new module of this class sharing this model's submodules (no copy), with
        the blocks in ``layers`` at their own indices of ``layers`` (None elsewhere), the embedding only
        on the ``first`` stage, the final norm and output only on the ``last``, the RoPE tables everywhere."""
        part = self.__class__.__new__(self.__class__)
        nn.Module.__init__(part)
        for key, value in vars(self).items():  # plain attributes: args, config, layer_plan, ...
            if key not in vars(part):
                setattr(part, key, value)
        part.train(self.training)
        for name, child in self.named_children():
            part._modules[name] = child
        kept = nn.ModuleList()
        for i, block in enumerate(self.layers):
            kept._modules[str(i)] = block if i in layers else None
        part._modules["layers"] = kept
        absent = (() if first else self.FIRST_STAGE_MODULES) + (() if last else self.LAST_STAGE_MODULES)
        for name in absent:
            part._modules[name] = None
        return part

    def tp_plan(self) -> dict[str, str]:
        """Tensor parallelism outside the blocks, module path -> role: the embedding and the output split
        over the vocabulary, the final norm on the residual stream (each block has its own ``tp_plan``)."""
        return {"tok_embeddings": "embedding", "norm": "final_norm", "output": "output"}

    @property
    def rope(self) -> RotaryEmbedding:
        """The rotary table of the global (full-attention) layers."""
        return self.ropes["global"]  # type: ignore[return-value]

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
        A pipeline stage (absent pieces are None) draws only its own pieces, so its values differ from
        those of the whole model with the same seed: initialise the whole model, then split it, to match.
        """
        device = next(self.parameters()).device
        gen = None
        if seed is not None and device.type != "meta":
            gen = torch.Generator(device=device).manual_seed(seed)
        std = 0.02
        resid_std = std / math.sqrt(2 * self.args.n_layers)
        if self.tok_embeddings is not None:  # None (and layers, norm, output below): a pipeline stage's absent pieces
            nn.init.normal_(self.tok_embeddings.weight, 0.0, std, generator=gen)
        for layer in self.layers:
            if layer is not None:
                layer.init_weights(std, resid_std, gen)
        if self.norm is not None:
            self.norm.reset_parameters()
        if not self.args.tie_embeddings and self.output is not None:
            nn.init.normal_(self.output.weight, 0.0, std, generator=gen)
        self.rebuild_rope(device)

    def rebuild_rope(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the RoPE tables, e.g. after building on the meta device."""
        for rope in self.ropes.values():
            rope.rebuild(device)

    def hidden_states(
        self, tokens: Tensor, position_ids: Tensor | None = None, document_ids: Tensor | None = None,
        kv_cache: KVCache | None = None, embeds: Tensor | None = None,
        after_layer: Callable[[int, Tensor], Tensor] | None = None,
        mask: Callable[[int | None], Tensor] | None = None,
    ) -> Tensor:
        """Final-normed hidden states [B, T, dim] (``forward`` minus the output projection).

        Exposed so callers can project only the positions they need (generation, chunked loss).
        ``embeds`` [B, T, dim] replaces the embedding of ``tokens`` (a vision-language model's text
        embeddings with image features in place of its image tokens); ``position_ids`` may then be a
        multimodal RoPE's [3, B, T]. ``after_layer(i, h)`` replaces block ``i``'s output ``h`` (Qwen3-VL
        adds image features to the first blocks' outputs at the image tokens). ``mask(window)`` gives the
        boolean SDPA mask [B, 1, T, T] of the layers with that sliding window (None: full attention) in place
        of causal attention (Gemma 3 attends bidirectionally within each image).
        """
        # a later pipeline stage under sequence parallelism gets 1/tp of the sequence: its positions say how long it is
        T = tokens.shape[1] if position_ids is None else position_ids.shape[-1]
        cp = self.context_parallel if kv_cache is None else None
        full_len = T if cp is None else T * cp.size  # under context parallelism, the whole rows' length
        if full_len > self.config.max_seq_len:
            raise UserError(
                f"sequence length {full_len} exceeds the model's max_seq_len {self.config.max_seq_len}; "
                "use shorter sequences or a larger max_seq_len"
            )
        start = 0 if kv_cache is None else kv_cache.pos
        if position_ids is None:
            position_ids = torch.arange(start, start + T, device=tokens.device).unsqueeze(0)
        # A pipeline stage without the embedding (lmforge.parallel.pipeline) gets hidden states [B, T, dim].
        embedded = self.tok_embeddings is not None
        if embeds is not None:
            h, embedded = embeds, False
        else:
            h = self.tok_embeddings(tokens) if embedded else tokens
        if self.config.embed_scale and embedded:  # Gemma: the scale rounded to the activation dtype, as transformers does
            h = h * torch.tensor(self.config.dim ** 0.5, dtype=h.dtype)
        ropes = {name: rope(position_ids, h.dtype) for name, rope in self.ropes.items()}
        if kv_cache is not None and document_ids is not None:
            raise ValueError("document_ids cannot be combined with a kv_cache")
        if cp is not None:  # this rank's queries over the keys of the whole rows
            layout = cp.layout(document_ids, tokens.shape[0], T, tokens.device)
        else:
            layout = packed_layout(document_ids) if document_ids is not None and kv_cache is None else None
        if mask is not None and (kv_cache is not None or layout is not None):
            raise ValueError("an attention mask cannot be combined with a kv_cache, document_ids or "
                             "context parallelism")
        attention = {window: (mask(window), False) if mask is not None else
                     self._attention_pattern(T, window, tokens.device, kv_cache, layout)
                     for window in {w for w, _ in self.layer_plan}}

        for i, (layer, (window, rope)) in enumerate(zip(self.layers, self.layer_plan)):
            if layer is None:  # owned by another pipeline stage
                continue
            h = layer(h, *ropes[rope], *attention[window], kv_cache)
            if after_layer is not None:
                h = after_layer(i, h)
        if kv_cache is not None:
            kv_cache.advance(T)
        return self.norm(h) if self.norm is not None else h

    @staticmethod
    def _attention_pattern(T: int, window: int | None, device: torch.device, kv_cache: KVCache | None,
                           layout: PackedLayout | None) -> tuple[Tensor | PackedLayout | None, bool]:
        """(mask, is_causal) for layers with sliding ``window`` (None: full attention)."""
        if kv_cache is not None:
            mask = kv_cache.attn_mask(T, window)
            return mask, mask is None and T > 1
        if layout is not None:  # per-document causal attention, window applied inside
            return layout.windowed(window), False
        if window is not None and T > window:  # shorter sequences: the band is the causal mask
            return sliding_window_mask(T, window, device), False
        return None, True

    def forward(
        self, tokens: Tensor, position_ids: Tensor | None = None, document_ids: Tensor | None = None,
        kv_cache: KVCache | None = None, head: OutputHead | None = None,
    ) -> Any:
        """Logits [B, T, vocab_size] (in the model's dtype), or ``head(hidden, output_weight)``.

        ``document_ids`` [B, T] switches to block-diagonal causal attention for packed
        sequences; the caller then supplies ``position_ids`` that restart at 0 per document.
        With a ``kv_cache`` the new keys/values are appended to the cache and attention
        covers everything cached so far (see ``lmforge.models.layers.kv_cache.KVCache``).

        ``head`` replaces the output projection: it gets the final-normed hidden states [B, T, dim]
        and the output weight [vocab_size, dim] and its result is returned (e.g. the chunked loss of
        ``lmforge.losses.chunked_loss``, which never holds all logits at once). It runs here, inside
        forward, rather than on ``hidden_states`` afterwards, because wrappers act only on a forward
        call: FSDP2 unshards the root's parameters (the output weight among them) for that call only.
        """
        h = self.hidden_states(tokens, position_ids, document_ids, kv_cache)
        if self.output is None:  # a pipeline stage before the last: its hidden states go to the next stage
            return h
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
