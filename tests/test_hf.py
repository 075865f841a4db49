"""Round trips between lmforge and Hugging Face Llama directories (all offline, tiny models)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from lmforge.errors import UserError
from lmforge.models.hf import (
    hf_state_dict_from_lmforge,
    lmforge_state_dict_from_hf,
    load_hf_config,
    load_hf_model,
    save_hf_model,
)
from lmforge.models.model import ModelArgs, Transformer

transformers = pytest.importorskip("transformers")


def tiny_hf(tie: bool, seed: int = 0) -> "transformers.LlamaForCausalLM":
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=120, max_position_embeddings=64, rope_theta=20000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights so a wrong mapping shows up
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    return model


TOKENS = torch.randint(0, 120, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("shard", [None, "40KB"])
def test_load_hf_model_logits_match(tmp_path, tie, shard):
    hf = tiny_hf(tie)
    kw = {"max_shard_size": shard} if shard else {}
    hf.save_pretrained(tmp_path, **kw)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    args = load_hf_config(tmp_path)
    assert (args.dim, args.n_layers, args.kv_heads, args.ffn_dim, args.vocab_size) == (64, 2, 2, 96, 120)
    assert args.rope_theta == 20000.0 and args.norm_eps == 1e-6 and args.tie_embeddings == tie
    model = load_hf_model(tmp_path)
    if tie:
        assert model.output.weight is model.tok_embeddings.weight
    with torch.no_grad():
        torch.testing.assert_close(model(TOKENS), hf(TOKENS).logits, atol=1e-5, rtol=1e-4)


def test_load_bf16(tmp_path):
    tiny_hf(False).save_pretrained(tmp_path)
    model = load_hf_model(tmp_path, dtype=torch.bfloat16)
    assert model.tok_embeddings.weight.dtype == torch.bfloat16
    assert model.rope.cos.dtype == torch.float32
    assert model(TOKENS).dtype == torch.bfloat16


@pytest.mark.parametrize("tie", [False, True])
def test_save_hf_model_loads_in_transformers(tmp_path, tie):
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=120, max_seq_len=64,
                     tie_embeddings=tie, rope_theta=50000.0)
    model = Transformer(args)
    model.init_weights(seed=3)
    save_hf_model(model.state_dict(), args, tmp_path, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["torch_dtype"] == "float32"
    assert cfg["eos_token_id"] == 2
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == 2
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.tie_word_embeddings == tie
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, model(TOKENS), atol=1e-5, rtol=1e-4)
    # ...and back again through lmforge's own loader.
    again = load_hf_model(tmp_path)
    assert again.args == dataclasses.replace(args, ffn_hidden_dim=args.ffn_dim)
    with torch.no_grad():
        torch.testing.assert_close(again(TOKENS), model(TOKENS), atol=0, rtol=0)


def test_state_dict_mapping_round_trip():
    args = ModelArgs(dim=32, n_layers=2, n_heads=2, vocab_size=50, tie_embeddings=True)
    model = Transformer(args)
    sd = model.state_dict()
    hf = hf_state_dict_from_lmforge(sd, args)
    assert "lm_head.weight" not in hf and "model.layers.1.mlp.down_proj.weight" in hf
    back = lmforge_state_dict_from_hf(hf, args)
    assert back.keys() == sd.keys()
    assert back["output.weight"] is back["tok_embeddings.weight"]
    # torch.compile's wrapper prefix is ignored
    compiled = {f"_orig_mod.{k}": v for k, v in sd.items()}
    assert hf_state_dict_from_lmforge(compiled, args).keys() == hf.keys()


def test_config_errors(tmp_path):
    with pytest.raises(UserError, match="config.json"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UserError, match="gpt2"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(UserError, match="missing"):
        load_hf_config(tmp_path)


def test_old_style_rope_config(tmp_path):
    """transformers < 5 wrote rope_theta / rope_scaling at the top level."""
    cfg = {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 120, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072, "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = load_hf_config(tmp_path)
    assert args.rope_theta == 500000.0 and args.rope_scaling["factor"] == 32.0 and args.tie_embeddings


@pytest.mark.parametrize("damage, words", [
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:200]),
     "not a readable safetensors file"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64), "not a readable safetensors file"),
])
def test_damaged_weights_file_is_one_line(tmp_path, damage, words):
    tiny_hf(False).save_pretrained(tmp_path)
    damage(tmp_path)
    with pytest.raises(UserError, match=words) as info:
        load_hf_model(tmp_path)
    assert "\n" not in str(info.value) and "model.safetensors" in str(info.value)
