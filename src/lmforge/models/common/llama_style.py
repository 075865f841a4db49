"""What the Llama-shaped families share: the tensor names and most of config.json (each family's folder
fills in a :class:`LlamaStyleConfig` and registers it).

Every built-in family is one decoder (:class:`~lmforge.models.model.Transformer`) with a few
switches, and their Hugging Face checkpoints name tensors much the same way. So a family module
here only fills in a :class:`LlamaStyleConfig` (its defaults, what it refuses, which switches it
sets, and a hook for its own keys: Gemma 3's layer types, an MoE's experts) and, where it has other
tensors, extends :data:`LLAMA_LAYOUT`.

Reading refuses, with one line naming the file and the key, every setting lmforge cannot
reproduce exactly (mixtures of experts, other activations, biases a family can switch on, RoPE
schemes other than default/llama3/linear, per-layer sliding windows...). Missing keys take the
defaults transformers itself uses for that family, so a terse config means the same to both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import TYPE_CHECKING, Any, Callable, Mapping

from lmforge.errors import UserError
from lmforge.models.args import ROPE_TYPES, ModelArgs
from lmforge.models.state_dict_adapter import StateDictAdapter

if TYPE_CHECKING:  # pragma: no cover
    from lmforge.models.spec import GGUFFormat, ModelSpec

__all__ = ["LLAMA_LAYOUT", "LlamaStyleConfig", "rope_settings"]

LLAMA_LAYOUT = StateDictAdapter(
    layer_names={
        "attention.wq.weight": "self_attn.q_proj.weight",
        "attention.wk.weight": "self_attn.k_proj.weight",
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "feed_forward.w1.weight": "mlp.gate_proj.weight",
        "feed_forward.w2.weight": "mlp.down_proj.weight",
        "feed_forward.w3.weight": "mlp.up_proj.weight",
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
    },
    global_names={
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    },
)
"""The dense decoder's parameters under Hugging Face's ``LlamaForCausalLM`` names, which every
built-in family uses; a family with more tensors extends it (:meth:`StateDictAdapter.extend`)."""

MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
"""Keys whose presence marks a mixture of experts, which no family here implements."""


def rope_settings(cfg: Mapping[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from either config layout.

    transformers >= 5 nests everything in ``rope_parameters``; older files use a top-level
    ``rope_theta`` plus an optional ``rope_scaling``.
    """
    rope = dict(cfg.get("rope_parameters") or {})
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise UserError(f"{where}: partial_rotary_factor is not supported (lmforge rotates the whole head)")
    if scaling is None:
        return theta, None
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return theta, None
    if kind not in ROPE_TYPES:
        raise UserError(f"{where}: rope_scaling type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    return theta, scaling


def _no_keys(args: ModelArgs) -> dict[str, Any]:
    return {}


def _no_extra(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    return {}


def _no_check(args: ModelArgs) -> str | None:
    return None


SWITCHES = ("qkv_bias", "qk_norm", "qk_norm_per_head", "norm_unit_offset", "embed_scale", "sandwich_norm")
"""Architecture switches a family fixes (see ``LlamaStyleConfig.switches``)."""
_SWITCH_DEFAULTS = {f.name: f.default for f in dataclass_fields(ModelArgs) if f.name in SWITCHES}

HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
"""Hugging Face activation names -> ``ModelArgs.hidden_act``."""


@dataclass(frozen=True)
class LlamaStyleConfig:
    """How one Llama-shaped family's ``config.json`` maps to ``ModelArgs`` and back.

    ``switches`` say what the family's architecture always has (``qkv_bias``, ``qk_norm``, Gemma's
    norms...), ``sliding_window`` what it may have; a model whose ``ModelArgs`` disagree cannot be
    exported as this family, and one read from its config always agrees.
    """

    model_type: str
    """Hugging Face ``model_type`` (what ``config.json`` says and ``ModelArgs.hf_model_type`` records)."""
    architecture: str
    """The ``*ForCausalLM`` class transformers builds for it (``config.json``'s ``architectures``)."""
    defaults: Mapping[str, Any]
    """transformers' values for keys a config.json may leave out: ``num_key_value_heads``,
    ``head_dim``, ``max_position_embeddings`` (and ``sliding_window`` where the family has one)."""
    refused_flags: tuple[str, ...] = ()
    """Boolean keys that switch on something lmforge does not implement for this family."""
    sliding_window: bool = False
    """Reads and writes ``sliding_window`` (Mistral). Families without it refuse sliding ``layer_types``."""
    export_keys: Callable[[ModelArgs], dict[str, Any]] = field(default=_no_keys)
    """Family keys written after the shared ones (e.g. Llama's ``attention_bias=False``)."""
    switches: Mapping[str, Any] = field(default_factory=dict)
    """``ModelArgs`` fields among :data:`SWITCHES` that the family always sets (Qwen2's ``qkv_bias``,
    Qwen3's ``qk_norm``, Gemma's norms, OLMoE's projection-wide q/k norm); the others must keep their
    defaults to export as this family."""
    activations: tuple[str, ...] = ("silu",)
    """The Hugging Face ``hidden_act`` / ``hidden_activation`` values the family may have."""
    moe: bool = False
    """Whether the family is a mixture of experts (otherwise expert keys are refused)."""
    read_extra: Callable[[Mapping[str, Any], str], dict[str, Any]] = field(default=_no_extra)
    """(config.json, file name) -> ``ModelArgs`` fields of the family's own keys, over the shared ones;
    UserError (naming the file and key) for what it cannot reproduce."""
    export_check: Callable[[ModelArgs], str | None] = field(default=_no_check)
    """What in ``args`` the family cannot express on export (None: nothing)."""

    def args_from_hf(self, cfg: Mapping[str, Any], where: str) -> ModelArgs:
        """``ModelArgs`` for a parsed ``config.json`` of this family; ``where`` names the file in errors."""
        if cfg.get("model_type") != self.model_type:
            raise UserError(f"{where}: model_type {cfg.get('model_type')!r} is not {self.model_type!r}")
        family = self.model_type
        for key in () if self.moe else MOE_KEYS:
            if cfg.get(key):
                raise UserError(f"{where}: {key} is set: model_type {family!r} has no mixture of experts")
        for key in self.refused_flags:
            if cfg.get(key):
                raise UserError(f"{where}: {key}=true is not supported for model_type {family!r}")
        act = cfg.get("hidden_act", cfg.get("hidden_activation", self.activations[0]))
        if act not in self.activations:
            raise UserError(f"{where}: hidden_act {act!r} is not supported for model_type {family!r} "
                            f"(need {' or '.join(self.activations)})")
        layer_types = cfg.get("layer_types") or []
        if not self.sliding_window and any(t != "full_attention" for t in layer_types):
            raise UserError(f"{where}: layer_types other than full_attention are not supported")

        def get(key: str) -> Any:
            return cfg[key] if key in cfg else self.defaults[key]

        theta, scaling = rope_settings(cfg, where)
        try:
            n_heads = int(cfg["num_attention_heads"])
            n_kv = get("num_key_value_heads")
            head_dim = get("head_dim")
            window = get("sliding_window") if self.sliding_window else None
            fields = dict(
                dim=int(cfg["hidden_size"]),
                n_layers=int(cfg["num_hidden_layers"]),
                n_heads=n_heads,
                n_kv_heads=int(n_kv) if n_kv else n_heads,
                vocab_size=int(cfg["vocab_size"]),
                ffn_hidden_dim=int(cfg["intermediate_size"]),
                norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                max_seq_len=int(get("max_position_embeddings")),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                rope_scaling=scaling,
                head_dim=int(head_dim) if head_dim else None,
                sliding_window=int(window) if window else None,
                hidden_act=HF_ACTIVATIONS[act],
                hf_model_type=family,
            )
            return ModelArgs(**{**fields, **self.switches, **self.read_extra(cfg, where)})
        except KeyError as e:
            raise UserError(f"{where}: missing field {e.args[0]!r}") from None
        except UserError as e:
            raise UserError(f"{where}: {e}") from None

    def register(self, layout: StateDictAdapter, fused_decode: bool,
                 sizes: Mapping[str, Mapping[str, Any]] | None = None, gguf: "GGUFFormat | None" = None) -> "ModelSpec":
        """Register this family's :class:`~lmforge.models.spec.ModelSpec` (named after its ``model_type``):
        these conversions, ``layout`` for the tensor names, the shared decoder as its model and the named
        ``sizes`` of its published models."""
        from lmforge.models.model import Transformer
        from lmforge.models.spec import ModelSpec, register_spec

        return register_spec(ModelSpec(
            name=self.model_type, hf_model_type=self.model_type, hf_architecture=self.architecture,
            args_from_hf=self.args_from_hf, hf_config=self.hf_config, check_exportable=self.check_exportable,
            state_dict_adapter=layout, build=Transformer, fused_decode=fused_decode, sizes=dict(sizes or {}),
            gguf=gguf,
        ))

    def check_exportable(self, args: ModelArgs) -> None:
        """UserError unless ``args`` is exactly what this family can express."""
        if args.sliding_window is not None and not self.sliding_window:
            raise UserError(f"cannot export as Hugging Face model_type {self.model_type!r}: it cannot have sliding_window")
        for key in SWITCHES:
            need = self.switches.get(key, _SWITCH_DEFAULTS[key])
            if getattr(args, key) != need and (key != "qk_norm_per_head" or args.qk_norm):
                raise UserError(f"cannot export as Hugging Face model_type {self.model_type!r}: "
                                f"it needs {key}={need}")
        if {v: k for k, v in HF_ACTIVATIONS.items()}[args.hidden_act] not in self.activations:
            raise UserError(f"cannot export as Hugging Face model_type {self.model_type!r}: "
                            f"it has no {args.hidden_act} activation")
        if (args.n_experts > 0) != self.moe:
            state = "requires" if self.moe else "cannot have"
            raise UserError(f"cannot export as Hugging Face model_type {self.model_type!r}: it {state} experts")
        problem = self.export_check(args)
        if problem:
            raise UserError(f"cannot export as Hugging Face model_type {self.model_type!r}: {problem}")

    def hf_config(
        self, args: ModelArgs, *, torch_dtype: str, bos_token_id: int | None = None,
        eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
    ) -> dict[str, Any]:
        """The ``config.json`` transformers needs to build ``args`` as this family with the same shapes."""
        self.check_exportable(args)
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
        if args.rope_scaling is not None:
            rope = {**args.rope_scaling, "rope_theta": args.rope_theta}
        config: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "hidden_size": args.dim,
            "intermediate_size": args.ffn_dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "vocab_size": args.vocab_size,
            "max_position_embeddings": args.max_seq_len,
            "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta,
            "rope_scaling": args.rope_scaling,
            "rope_parameters": rope,
            "tie_word_embeddings": args.tie_embeddings,
            "hidden_act": {v: k for k, v in HF_ACTIVATIONS.items()}[args.hidden_act],
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": torch_dtype,
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id,
        }
        config.update(self.export_keys(args))
        return config
