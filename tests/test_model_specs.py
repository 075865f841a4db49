"""The model-family registry: every spec's config and tensor names round-trip, lookups refuse in one
line, and the registered families are exactly the ones ``test_families.py`` compares to transformers."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import lmforge.models.spec as spec_module
from lmforge.errors import UserError
from lmforge.models.args import ModelArgs
from lmforge.models.decode_step import supports
from lmforge.models.generate import generate
from lmforge.models.hf import hf_module_name
from lmforge.models.hf_config import args_from_hf_config, hf_config_from_args
from lmforge.models.spec import (
    ModelSpec, get_spec, register_spec, registered_model_types, registered_specs, spec_for_args, spec_for_hf_config,
)

VISION_LANGUAGE = {"qwen2_5_vl": ("test_qwen_vl", ("qwen2_5_vl",)), "qwen3_vl": ("test_qwen_vl", ("qwen3_vl",)),
                   "gemma3": ("test_gemma3_vl", ())}
"""Vision-language families, compared to transformers (images in the batch, config and names both ways) in
their own test files; the text-decoder checks here do not describe their configs."""
SPECS = tuple(s for s in registered_specs() if s.name not in VISION_LANGUAGE)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
# Settings that differ from every family's defaults, so a key an export forgets cannot come back by luck.
VARIANTS = {
    "plain": {},
    "tied": {"tie_word_embeddings": True},
    "llama3_rope": {"rope_scaling": LLAMA3_ROPE},
    "linear_rope": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
    "no_window": {"sliding_window": None},
}


FAMILY_KEYS = {  # what a family's config.json must add to the shared keys
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [0]},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2},
}


def family_config(spec: ModelSpec, **changes) -> dict:
    cfg = {
        "model_type": spec.hf_model_type, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "vocab_size": 50,
        "max_position_embeddings": 96, "rms_norm_eps": 1e-5, "rope_theta": 20000.0, "sliding_window": 8,
        "tie_word_embeddings": False, **FAMILY_KEYS.get(spec.hf_model_type, {}),
    }
    if spec.hf_model_type in ("gemma3_text", "gpt_oss") and changes.get("sliding_window", 8) is None:
        cfg["layer_types"] = ["full_attention"] * 2  # no window: no local layers either
    return {**cfg, **changes}


def family_args(spec: ModelSpec, **changes) -> ModelArgs:
    return spec.args_from_hf(family_config(spec, **changes), "config.json")


def test_registry_holds_exactly_the_families_test_families_covers():
    """A new family must also get transformers comparisons: add it to test_families.FAMILIES."""
    pytest.importorskip("transformers")
    import test_families

    tested = {test_families.hf_config(f).model_type for f in test_families.FAMILIES}
    for family, (module, args) in VISION_LANGUAGE.items():  # each one's own file builds it with transformers
        assert __import__(module).hf_config(*args).model_type == family
    assert set(registered_model_types()) == tested | set(VISION_LANGUAGE)
    assert len(registered_model_types()) == len(SPECS) + len(VISION_LANGUAGE)
    assert {s.name for s in SPECS} == tested  # built-in specs are named after their model_type


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_config_round_trips(spec, variant):
    args = family_args(spec, **VARIANTS[variant])
    assert spec_for_args(args) is spec
    written = json.loads(json.dumps(spec.hf_config(args, torch_dtype="float32", eos_token_id=[1, 2])))
    assert written["model_type"] == spec.hf_model_type and written["architectures"] == [spec.hf_architecture]
    assert spec.args_from_hf(written, "config.json") == args
    # ...and the same through the dispatching functions the loaders use.
    assert args_from_hf_config(written, "config.json") == args
    assert hf_config_from_args(args, torch_dtype="float32", eos_token_id=[1, 2]) == written


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_state_dict_adapter_round_trips_names(spec):
    for tied in (False, True):
        args = family_args(spec, tie_word_embeddings=tied)
        model = spec.build(args)
        state = model.state_dict()
        hf = spec.state_dict_adapter.to_hf(state, args)
        assert ("lm_head.weight" in hf) is not tied
        adapter = spec.state_dict_adapter
        # one Hugging Face tensor per expert
        stacked = [k for k in state if k.split(".", 2)[-1] in adapter.expert_names]
        fused = [k for k in state if any(k.endswith(p) for ps in adapter.fused_names.values() for p in ps)]
        packed = [k for k in state if any(k.endswith(p) for pk in adapter.packed_names.values() for p in pk.parts)]
        assert len(hf) == (len(state) - tied + (args.n_experts - 1) * len(stacked)
                           - len(fused) + args.n_layers * len(adapter.fused_names) * bool(fused)
                           - len(packed) + args.n_layers * len(adapter.packed_names) * bool(packed))  # distinct names
        back = adapter.from_hf(hf, args)
        assert back.keys() == state.keys()
        copied = set(stacked) | set(fused) | set(packed)  # stacked or split: equal values, not the same tensors
        assert all(back[k] is state[k] for k in state if not (tied and k == "output.weight") and k not in copied)
        assert all(torch.equal(back[k], state[k]) for k in copied)
        assert back["output.weight"] is (back["tok_embeddings.weight"] if tied else state["output.weight"])
        # torch.compile's prefix is dropped
        assert spec.state_dict_adapter.to_hf({f"_orig_mod.{k}": v for k, v in state.items()}, args).keys() == hf.keys()
    assert hf_module_name("layers.1.attention.wo", args) == "model.layers.1.self_attn.o_proj"
    if not args.is_moe_layer(1):
        assert hf_module_name("layers.1.feed_forward.w2", args) == "model.layers.1.mlp.down_proj"


def test_an_adapter_refuses_tensors_its_family_lacks():
    qwen2, llama = get_spec("qwen2"), get_spec("llama")
    args = family_args(qwen2)
    hf = qwen2.state_dict_adapter.to_hf(qwen2.build(args).state_dict(), args)
    with pytest.raises(UserError, match=r"self_attn\.q_proj\.bias"):
        llama.state_dict_adapter.from_hf(hf, family_args(llama))


@pytest.mark.parametrize("cfg", [{"model_type": "gpt2"}, {"model_type": "qwen2_moe"}, {}, {"model_type": 3}])
def test_unknown_model_type_is_refused_in_one_line_naming_the_file(cfg):
    with pytest.raises(UserError) as err:
        spec_for_hf_config(cfg, "/models/x/config.json")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("/models/x/config.json: model_type")
    assert repr(cfg.get("model_type")) in msg and all(t in msg for t in registered_model_types())


def test_a_config_json_that_is_not_an_object_is_one_line(tmp_path):
    from lmforge.models.hf_config import args_from_hf_config

    with pytest.raises(UserError, match=r"^/m/config.json: expected a JSON object of model settings, got a list$"):
        args_from_hf_config(json.loads("[1, 2]"), "/m/config.json")


def test_lookups_by_name_and_model_type_refuse_unknowns():
    with pytest.raises(UserError, match="unknown model family 'gpt2'.*llama"):
        get_spec("gpt2")
    # the argument class does not read the registry; the spec lookup refuses
    with pytest.raises(UserError, match="unknown hf_model_type 'gpt2'.*qwen3"):
        spec_for_args(ModelArgs(hf_model_type="gpt2"))


def test_names_and_model_types_are_unique():
    llama = get_spec("llama")
    with pytest.raises(ValueError, match="already registered"):
        register_spec(llama)
    with pytest.raises(ValueError, match="already belongs to spec 'llama'"):
        register_spec(dataclasses.replace(llama, name="llama-again"))
    assert tuple(s for s in registered_specs() if s.name not in VISION_LANGUAGE) == SPECS


def test_generation_uses_the_fused_step_only_where_the_spec_allows(monkeypatch):
    llama = get_spec("llama")
    model = llama.build(family_args(llama)).eval()
    prompts = [[3, 4, 5], [6, 7]]
    assert supports(model)
    fused = generate(model, prompts, 6, eos_id=None, pad_id=0, temperature=0.0)
    monkeypatch.setitem(spec_module._BY_MODEL_TYPE, "llama", dataclasses.replace(llama, fused_decode=False))
    assert not supports(model)
    assert generate(model, prompts, 6, eos_id=None, pad_id=0, temperature=0.0) == fused


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_flops_hooks_count_the_built_model(spec):
    """The hooks see the same shapes as the model: the weight part is 6 x its matmul parameters."""
    args = family_args(spec)
    model = spec.build(args)
    matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "tok_embeddings" not in n)
    per_token = spec.flops_per_token(args, 16, None)
    attention = per_token - 6 * matmul
    assert 0 < attention < per_token
    assert spec.training_flops(args, [16, 16], None) == pytest.approx(32 * per_token)
    with torch.device("meta"):
        assert isinstance(spec.build(args), torch.nn.Module)


def test_a_fused_projection_has_no_peft_module_name():
    """Phi-3 keeps q/k/v in one qkv_proj: a PEFT adapter on wq alone cannot be named, so it is refused."""
    args = family_args(get_spec("phi3"))
    assert hf_module_name("layers.0.attention.wo", args) == "model.layers.0.self_attn.o_proj"
    with pytest.raises(UserError, match=r"fused Hugging Face projection self_attn\.qkv_proj"):
        hf_module_name("layers.0.attention.wq", args)


def test_the_fused_step_refuses_switches_it_does_not_compute():
    """A Llama-family model with a Gemma switch set must not take the SwiGLU/Llama-norm fused step."""
    llama = get_spec("llama")
    args = family_args(llama)
    assert supports(llama.build(args))
    for change in ({"hidden_act": "gelu_tanh"}, {"sandwich_norm": True}, {"attn_scale": 0.1}):
        odd = ModelArgs.from_dict({**args.to_dict(), **change})
        assert not supports(llama.build(odd)), change
