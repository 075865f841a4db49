"""Architecture hyper-parameters (``ModelArgs``) and the named sizes that fill them in.

One ``ModelArgs`` describes every family lmforge runs: Llama 2/3/3.x, SmolLM2 (Llama-shaped),
Qwen2/2.5 (bias on the q/k/v projections), Qwen3 (RMSNorm on q and k per head, explicit
``head_dim``), Mistral (sliding-window attention), Phi-3 (Llama's shape, fused projections in its
checkpoints), Gemma 3 (GeGLU, (1 + w) norms around both
sublayers, scaled embeddings, interleaved local/global layers with their own RoPE bases) and the
mixtures of experts Qwen3-MoE, Mixtral and OLMoE (``n_experts`` > 0). ``hf_model_type`` records which Hugging Face
family the weights belong to: it selects the family's :class:`~lmforge.models.spec.ModelSpec`
(``spec_for_args``), so exporting writes the same ``model_type`` back.

Checkpoints store ``ModelArgs.to_dict()``, so field names and meanings never change; a new field
needs a default that reproduces what older checkpoints meant.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from lmforge.errors import UserError
from lmforge.models.configs import (
    AttentionConfig, BlockConfig, DecoderConfig, MLPConfig, MoEConfig, NormConfig, RopeConfig, RouterConfig,
)

# RoPE frequency schemes that are computed once from the config (no run-time state).
ROPE_TYPES = ("default", "llama3", "linear", "yarn")
ACTIVATIONS = ("silu", "gelu_tanh")
"""The MLP gate's activation: SwiGLU's SiLU, or GeGLU's tanh-approximated GELU (Gemma)."""
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class ModelArgs:
    """Architecture hyper-parameters; ``vocab_size`` normally comes from the tokenizer."""

    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    vocab_size: int = 512
    ffn_hidden_dim: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    # Frequency scaling: {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"} (Llama 3.1+) or {"rope_type": "linear", "factor"};
    # None = plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    # Per-head size. None means dim // n_heads and is resolved on construction, so readers can
    # always use ``args.head_dim``; Qwen3 sets it explicitly (n_heads * head_dim != dim).
    head_dim: int | None = None
    qkv_bias: bool = False  # additive bias on the q, k, v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    # Each query attends to itself and the previous sliding_window - 1 positions (Mistral).
    sliding_window: int | None = None
    # Per layer: "full_attention" or "sliding_attention" (Gemma 3's 5 local : 1 global). None: every
    # layer is sliding when sliding_window is set (Mistral), else full.
    layer_types: list[str] | None = None
    # RoPE base of the sliding layers (Gemma 3's rope_local_base_freq, plain RoPE); None: rope_theta.
    local_rope_theta: float | None = None
    hidden_act: str = "silu"
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight), in fp32 (Gemma)
    embed_scale: bool = False  # embeddings multiplied by sqrt(dim) in the activation dtype (Gemma)
    sandwich_norm: bool = False  # extra RMSNorms on the attention and MLP outputs (Gemma)
    attn_scale: float | None = None  # softmax scale; None: 1/sqrt(head_dim) (Gemma: query_pre_attn_scalar^-0.5)
    qk_norm_per_head: bool = True  # qk_norm over each head (Qwen3, Gemma) or the whole projection (OLMoE)
    # Mixture of experts: n_experts > 0 replaces the MLP of the layers in moe_layers (None: all).
    n_experts: int = 0
    n_experts_per_token: int = 0
    moe_ffn_dim: int | None = None  # each expert's hidden size; None: ffn_dim
    moe_norm_topk: bool = True  # renormalise the top-k router probabilities to sum to 1 (Mixtral, Qwen3-MoE)
    moe_layers: list[int] | None = None
    router_aux_loss_coef: float = 0.0  # the family's load-balancing loss weight (training.router_aux_loss_coef overrides)
    hf_model_type: str = "llama"

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.dim % self.n_heads != 0:
                raise UserError(f"model dim {self.dim} is not divisible by n_heads {self.n_heads}")
            self.head_dim = self.dim // self.n_heads
        if self.head_dim % 2 != 0:
            raise UserError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.n_heads % self.kv_heads != 0:
            raise UserError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.kv_heads}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ROPE_TYPES:
                raise UserError(f"unsupported rope_scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise UserError(f"sliding_window must be a positive number of tokens, got {self.sliding_window}")
        if self.hidden_act not in ACTIVATIONS:
            raise UserError(f"unsupported hidden_act {self.hidden_act!r} (supported: {', '.join(ACTIVATIONS)})")
        if self.layer_types is not None:
            self.layer_types = list(self.layer_types)
            if len(self.layer_types) != self.n_layers or any(t not in LAYER_TYPES for t in self.layer_types):
                raise UserError(f"layer_types must name {self.n_layers} layers, each one of {', '.join(LAYER_TYPES)}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise UserError("layer_types has sliding_attention layers but sliding_window is not set")
        if self.n_experts:
            if not 1 <= self.n_experts_per_token <= self.n_experts:
                raise UserError(f"n_experts_per_token must be in [1, n_experts={self.n_experts}], "
                                f"got {self.n_experts_per_token}")
            if self.moe_layers is not None:
                self.moe_layers = sorted(int(i) for i in self.moe_layers)
                if any(not 0 <= i < self.n_layers for i in self.moe_layers):
                    raise UserError(f"moe_layers must be layer indices in [0, {self.n_layers})")

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (``n_kv_heads`` resolved; < n_heads means GQA)."""
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: full causal attention)."""
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def layer_uses_local_rope(self, layer: int) -> bool:
        """Whether ``layer`` rotates with ``local_rope_theta`` (Gemma 3's sliding layers)."""
        return self.local_rope_theta is not None and self.layer_window(layer) is not None

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_experts > 0 and (self.moe_layers is None or layer in self.moe_layers)

    @property
    def expert_ffn_dim(self) -> int:
        return self.moe_ffn_dim if self.moe_ffn_dim is not None else self.ffn_dim

    @property
    def ffn_dim(self) -> int:
        """SwiGLU hidden size: explicit, or Llama's 2/3 * 4 * dim rounded up to a multiple of 64.

        The 2/3 keeps the parameter count of a 3-matrix SwiGLU equal to a 4x GELU MLP.
        """
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        multiple_of = 64
        return multiple_of * ((hidden + multiple_of - 1) // multiple_of)

    def decoder_config(self) -> DecoderConfig:
        """The decoder these arguments describe, as per-module configs (what ``Transformer`` builds).

        The Llama-shaped families differ only in the switches above; a family with modules of its own
        (latent attention, another router) subclasses ``ModelArgs`` and overrides this."""
        norm = NormConfig(self.dim, self.norm_eps, self.norm_unit_offset)
        ropes = {"global": RopeConfig(self.head_dim, self.rope_theta, self.max_seq_len, self.rope_scaling)}
        if self.local_rope_theta is not None:
            ropes["local"] = RopeConfig(self.head_dim, self.local_rope_theta, self.max_seq_len)
        return DecoderConfig(
            vocab_size=self.vocab_size, dim=self.dim, norm=norm, ropes=ropes, max_seq_len=self.max_seq_len,
            tie_embeddings=self.tie_embeddings, embed_scale=self.embed_scale,
            blocks=tuple(BlockConfig(self._attention(i), self._feed_forward(i), norm, self.sandwich_norm)
                         for i in range(self.n_layers)),
        )

    def _attention(self, layer: int) -> AttentionConfig:
        return AttentionConfig(
            dim=self.dim, n_heads=self.n_heads, n_kv_heads=self.kv_heads, head_dim=self.head_dim,
            qkv_bias=self.qkv_bias, qk_norm=("head" if self.qk_norm_per_head else "projection") if self.qk_norm else None,
            norm=NormConfig(self.head_dim, self.norm_eps, self.norm_unit_offset), scale=self.attn_scale,
            window=self.layer_window(layer), rope="local" if self.layer_uses_local_rope(layer) else "global",
        )

    def _feed_forward(self, layer: int) -> MLPConfig | MoEConfig:
        if not self.is_moe_layer(layer):
            return MLPConfig(self.dim, self.ffn_dim, self.hidden_act)
        router = RouterConfig(self.n_experts, self.n_experts_per_token, "softmax", self.moe_norm_topk)
        return MoEConfig(self.dim, router, MLPConfig(self.dim, self.expert_ffn_dim, self.hidden_act))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelArgs:
        """Inverse of ``to_dict``; keys added after a checkpoint was written take their defaults.

        Called on ``ModelArgs`` itself, it builds the argument class of the family ``hf_model_type`` names
        (a family with modules of its own registers a subclass: :func:`register_args_class`)."""
        if cls is ModelArgs:
            load_families()
            cls = _ARGS_CLASSES.get(d.get("hf_model_type", "llama"), ModelArgs)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise UserError(f"unknown model argument(s) {unknown}; known: {sorted(known)}")
        return cls(**d)


# Generic Llama-shaped presets; each family registers the named sizes of its published models beside
# its config.json mapping (``ModelSpec.sizes``). vocab_size always comes from the tokenizer.
MODEL_SIZES: dict[str, dict[str, Any]] = {
    "debug": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=1024),
    "small": dict(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, max_seq_len=2048),
    "125m": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, max_seq_len=2048, tie_embeddings=True),
    "1b": dict(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden_dim=8192, tie_embeddings=True,
        rope_theta=500000.0, max_seq_len=8192,
    ),
    "8b": dict(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden_dim=14336, tie_embeddings=False,
        rope_theta=500000.0, max_seq_len=8192,
    ),
}


_ARGS_CLASSES: dict[str, type[ModelArgs]] = {}


def load_families() -> None:
    """Register the built-in families on first use, then those of installed packages (the
    ``lmforge.families`` entry point: a module that registers its spec when imported, see
    :mod:`lmforge.plugins`). Every registry lookup (sizes, argument classes, specs) calls this, so
    importing ``lmforge.models`` stays light (no torch) until a model is needed."""
    import lmforge.models.families  # noqa: F401
    from lmforge.plugins import load_entry_points

    load_entry_points("lmforge.families")


def register_args_class(model_type: str, cls: type[ModelArgs]) -> None:
    """Make ``ModelArgs.from_dict`` build ``cls`` for checkpoints of ``model_type`` (a family's own fields)."""
    if cls is not ModelArgs:
        _ARGS_CLASSES[model_type] = cls


def register_sizes(sizes: dict[str, dict[str, Any]]) -> None:
    """Add a family's named sizes (each a ``ModelArgs`` field dict with its ``hf_model_type``)."""
    clash = sorted(set(sizes) & set(MODEL_SIZES))
    if clash:
        raise ValueError(f"model size(s) {clash} already registered")
    MODEL_SIZES.update(sizes)


def model_args_for(size: str, vocab_size: int, **overrides: Any) -> ModelArgs:
    """Build ``ModelArgs`` from a named preset, the tokenizer's vocab size and overrides."""
    load_families()
    if size not in MODEL_SIZES:
        raise UserError(f"unknown model size {size!r}; known sizes: {', '.join(MODEL_SIZES)}")
    kwargs = {**MODEL_SIZES[size], "vocab_size": vocab_size, **overrides}
    for key in ("rope_scaling", "layer_types"):
        if kwargs.get(key) is not None:
            kwargs[key] = type(kwargs[key])(kwargs[key])  # never share the preset's dict or list
    return ModelArgs.from_dict(kwargs)
