"""Llama / Qwen2 / Qwen3 / Mistral / SmolLM2 against transformers: logits, export, generation, refusals.

Every family is a tiny random fp32 model built by transformers itself, so each comparison is
against the reference implementation, never against stored numbers.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lmforge.errors import UserError
from lmforge.models.flops import attended_keys, flops_per_token, matmul_params
from lmforge.models.generate import generate
from lmforge.models.hf import load_hf_config, load_hf_model, save_hf_model
from lmforge.models.layers.masks import sliding_window_mask
from lmforge.models.model import ModelArgs, Transformer, model_args_for

transformers = pytest.importorskip("transformers")

VOCAB = 256
COMMON = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
    pad_token_id=0,
)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)
WINDOW = 8  # Mistral's sliding window in these tests: shorter than the sequences used


def hf_config(family: str) -> "transformers.PretrainedConfig":
    if family == "llama":
        return transformers.LlamaConfig(**COMMON, rope_parameters=dict(rope_type="default", rope_theta=20000.0))
    if family == "llama3":  # Llama 3.1-3.3 frequency scaling, tied like Llama-3.2-1B
        return transformers.LlamaConfig(**COMMON, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True)
    if family == "llama_linear":  # linear position interpolation (e.g. long-context Llama 2 fine-tunes)
        return transformers.LlamaConfig(**COMMON, rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=1e4))
    if family == "qwen2_yarn":  # YaRN context extension (Qwen2.5's long-context setting), with its attention factor
        return transformers.Qwen2Config(**COMMON, rope_parameters=dict(
            rope_type="yarn", factor=4.0, rope_theta=1e4, original_max_position_embeddings=16))
    if family == "smollm2":  # Llama-shaped, tied embeddings, 3 query heads per kv head
        cfg = {**COMMON, "hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1}
        return transformers.LlamaConfig(**cfg, tie_word_embeddings=True,
                                        rope_parameters=dict(rope_type="default", rope_theta=100000.0))
    if family == "qwen2":
        return transformers.Qwen2Config(**COMMON, rope_parameters=dict(rope_type="default", rope_theta=1e6),
                                        tie_word_embeddings=True)
    if family == "qwen3":  # head_dim 24 != 64 / 4
        return transformers.Qwen3Config(**COMMON, head_dim=24,
                                        rope_parameters=dict(rope_type="default", rope_theta=1e6))
    if family == "mistral":
        return transformers.MistralConfig(**COMMON, sliding_window=WINDOW,
                                          rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    if family == "phi3":  # fused qkv and gate_up projections, a sliding window
        return transformers.Phi3Config(**COMMON, sliding_window=WINDOW,
                                       rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    if family == "gemma3":  # local/global layers with their own RoPE, scaled global RoPE, non-default scale
        cfg = {k: v for k, v in COMMON.items() if k != "rms_norm_eps"}
        return transformers.Gemma3TextConfig(
            **cfg, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6),
                             "sliding_attention": dict(rope_type="default", rope_theta=1e4)})
    if family == "qwen3_moe":  # layer 1 keeps a dense MLP
        return transformers.Qwen3MoeConfig(**COMMON, head_dim=24, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
                                           rope_parameters=dict(rope_type="default", rope_theta=1e6))
    if family == "mixtral":
        return transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                                          rope_parameters=dict(rope_type="default", rope_theta=1e6))
    if family == "olmoe":  # top-k not renormalised, q/k norms over the whole projection
        return transformers.OlmoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2,
                                        rope_parameters=dict(rope_type="default", rope_theta=1e4))
    if family == "deepseek_v3":  # latent attention, grouped sigmoid router, shared experts (tests/test_deepseek_v3.py)
        return transformers.DeepseekV3Config(
            **{**COMMON, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
            n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12,
            qk_rope_head_dim=8, v_head_dim=10, num_nextn_predict_layers=0,
            rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=16,
                                 mscale=1.0, mscale_all_dim=1.0))
    if family == "gpt_oss":  # sinks, alternating sliding/full layers, YaRN, biased router and experts, clamped SwiGLU
        return transformers.GptOssConfig(**COMMON, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                         sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                                         swiglu_limit=1.5, rope_parameters=dict(
                                             rope_type="yarn", factor=4.0, rope_theta=1e4, beta_fast=32.0, beta_slow=1.0,
                                             truncate=False, original_max_position_embeddings=16))
    raise AssertionError(family)


FAMILIES = ["llama", "llama3", "llama_linear", "qwen2_yarn", "smollm2", "qwen2", "qwen3", "mistral", "phi3", "gemma3", "qwen3_moe",
            "mixtral", "olmoe", "deepseek_v3", "gpt_oss"]
MOE_FAMILIES = ["qwen3_moe", "mixtral", "olmoe"]


def tiny_hf(family: str, seed: int = 0) -> "transformers.PreTrainedModel":
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family)).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a wrong mapping cannot hide behind 1s and 0s
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith(".gate.weight"):  # decisive routers: no near-ties for rounding to flip
                p.normal_(0.0, 1.0)
    return model


def ids(T: int, B: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_family_loads_with_same_logits(tmp_path, family):
    hf = tiny_hf(family)
    hf.save_pretrained(tmp_path)
    model = load_hf_model(tmp_path)
    assert model.args.hf_model_type == hf.config.model_type
    tokens = ids(24)  # longer than Mistral's window of 8
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-5, rtol=1e-5)


def test_family_options_are_read():
    qwen3 = ModelArgs.from_dict(_args_dict("qwen3"))
    assert qwen3.head_dim == 24 and qwen3.qk_norm and not qwen3.qkv_bias and qwen3.hf_model_type == "qwen3"
    qwen2 = ModelArgs.from_dict(_args_dict("qwen2"))
    assert qwen2.qkv_bias and not qwen2.qk_norm and qwen2.head_dim == 16 and qwen2.tie_embeddings
    mistral = ModelArgs.from_dict(_args_dict("mistral"))
    assert mistral.sliding_window == WINDOW and mistral.hf_model_type == "mistral"
    assert ModelArgs.from_dict(_args_dict("llama3")).rope_scaling["rope_type"] == "llama3"


def _args_dict(family: str) -> dict:
    from lmforge.models.hf_config import args_from_hf_config

    return args_from_hf_config(hf_config(family).to_dict(), "config.json").to_dict()


def test_sliding_window_really_applies():
    """The Mistral comparison above means something only if the window changes the logits."""
    hf = tiny_hf("mistral")
    args = ModelArgs.from_dict(_args_dict("mistral"))
    model = Transformer(args).eval()
    from lmforge.models.hf import lmforge_state_dict_from_hf

    model.load_state_dict(lmforge_state_dict_from_hf(hf.state_dict(), args))
    unwindowed = Transformer(ModelArgs.from_dict({**args.to_dict(), "sliding_window": None})).eval()
    unwindowed.load_state_dict(model.state_dict())
    tokens = ids(24)
    with torch.no_grad():
        a, b = model(tokens), unwindowed(tokens)
    torch.testing.assert_close(a[:, :WINDOW], b[:, :WINDOW], atol=1e-6, rtol=1e-6)
    assert (a[:, WINDOW:] - b[:, WINDOW:]).abs().max() > 1e-3
    mask = sliding_window_mask(5, 2)[0, 0]
    assert mask.tolist()[4] == [False, False, False, True, True]


@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trip_through_transformers(tmp_path, family):
    hf = tiny_hf(family)
    hf.save_pretrained(tmp_path / "in")
    model = load_hf_model(tmp_path / "in")
    save_hf_model(model.state_dict(), model.args, tmp_path / "out", eos_token_id=[2, 3], pad_token_id=0)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == hf.config.model_type and cfg["architectures"] == [type(hf).__name__]
    assert cfg["eos_token_id"] == [2, 3]
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["eos_token_id"] == [2, 3]
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(again) is type(hf)
    assert again.config.tie_word_embeddings == hf.config.tie_word_embeddings
    tokens = ids(24, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, model(tokens), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(again(tokens).logits, hf(tokens).logits, atol=1e-5, rtol=1e-5)
    assert load_hf_config(tmp_path / "out") == model.args


@pytest.mark.parametrize("family", ["qwen3", "mistral", "qwen2", "phi3", "gemma3", "qwen3_moe", "mixtral", "olmoe"])
def test_greedy_generation_matches_transformers(tmp_path, family):
    hf = tiny_hf(family, seed=1)
    hf.save_pretrained(tmp_path)
    model = load_hf_model(tmp_path)
    prompt = ids(5, B=1, seed=2)
    new = 14  # 19 tokens in all: Mistral's window (8) is passed during decoding
    ref = hf.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None,
                      attention_mask=torch.ones_like(prompt))
    ours = generate(model, prompt.tolist(), new, eos_id=None, pad_id=0, temperature=0.0)
    assert ours[0] == ref[0, prompt.shape[1]:].tolist()


@pytest.mark.parametrize("family", ["mistral", "gemma3", "mixtral"])
def test_sliding_window_generation_with_padding_equals_single_rows(tmp_path, family):
    """Left padding shifts cache slots, not distances: each row sees the same window alone or batched
    (Gemma 3: local and global layers each with their own mask)."""
    hf = tiny_hf(family, seed=3)
    hf.save_pretrained(tmp_path)
    model = load_hf_model(tmp_path)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (3, 11)]
    batched = generate(model, prompts, 10, eos_id=None, pad_id=0, temperature=0.0)
    single = [generate(model, [p], 10, eos_id=None, pad_id=0, temperature=0.0)[0] for p in prompts]
    assert batched == single
    # ...and the cached decode equals a full forward without a cache (argmax per step).
    seq = list(prompts[1])
    with torch.no_grad():
        for _ in range(10):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert single[1] == seq[len(prompts[1]):]


BASE_LLAMA = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 120,
}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"model_type": "gemma3"}, "gemma3"),  # the multimodal family without its text_config
        ({"model_type": "qwen2_moe"}, "qwen2_moe"),
        ({"model_type": "qwen2", "num_experts": 8}, "num_experts"),
        ({"num_local_experts": 8}, "num_local_experts"),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"model_type": "qwen3", "attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}}, "rope_scaling"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
        ({"model_type": "qwen2", "layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ({"num_attention_heads": 5, "head_dim": None}, "divisible"),
        ({"vocab_size": None}, "vocab_size"),
    ],
)
def test_unsupported_configs_are_refused_in_one_line(tmp_path, change, named):
    cfg = {k: v for k, v in {**BASE_LLAMA, **change}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError) as err:
        load_hf_config(tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and "config.json" in msg and named in msg


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_family_defaults_follow_transformers(tmp_path, family):
    """Keys a config.json leaves out mean what transformers makes of them (Qwen3: head_dim 128...)."""
    d = {k: v for k, v in BASE_LLAMA.items() if k != "num_key_value_heads"}
    d.update(model_type=family, hidden_size=256, num_attention_heads=32)
    (tmp_path / "config.json").write_text(json.dumps(d))
    ours = load_hf_config(tmp_path)
    ref = transformers.AutoConfig.for_model(**d)
    assert ours.head_dim == (getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads)
    assert (ours.kv_heads, ours.max_seq_len) == (ref.num_key_value_heads, ref.max_position_embeddings)
    assert ours.sliding_window == (ref.sliding_window if family == "mistral" else None)


def test_export_refuses_what_the_family_cannot_express(tmp_path):
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=40, qkv_bias=True)  # a Llama with q/k/v bias
    with pytest.raises(UserError, match="'llama'.*qkv_bias"):
        save_hf_model(Transformer(args).state_dict(), args, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=40, hf_model_type="qwen3")  # no QK-norm
    with pytest.raises(UserError, match="qk_norm"):
        save_hf_model(Transformer(args).state_dict(), args, tmp_path / "y")


def test_old_model_args_without_family_keys_still_load():
    old = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 97, "ffn_hidden_dim": None,
           "norm_eps": 1e-5, "rope_theta": 10000.0, "max_seq_len": 64, "tie_embeddings": False, "rope_scaling": None}
    args = ModelArgs.from_dict(old)
    assert (args.head_dim, args.qkv_bias, args.qk_norm, args.sliding_window, args.hf_model_type) == (
        16, False, False, None, "llama")
    assert ModelArgs.from_dict(args.to_dict()) == args


# Published config.json values (Hugging Face Hub: HuggingFaceTB/SmolLM2-135M, Qwen/Qwen2.5-0.5B,
# Qwen/Qwen3-0.6B, meta-llama/Llama-3.2-1B, mistralai/Mistral-7B-v0.1, microsoft/Phi-3-mini-4k-instruct,
# google/gemma-3-270m,
# google/gemma-3-1b-pt, Qwen/Qwen3-30B-A3B, mistralai/Mixtral-8x7B-v0.1, allenai/OLMoE-1B-7B-0924)
# and the parameter counts their model cards publish.
PUBLISHED = {
    "smollm2-135m": (135e6, dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                 num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                 tie_word_embeddings=True)),
    "qwen2.5-0.5b": (0.49e9, dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                  num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                  tie_word_embeddings=True)),
    "qwen3-0.6b": (0.6e9, dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                               num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                               tie_word_embeddings=True)),
    "llama-3.2-1b": (1.23e9, dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                  tie_word_embeddings=True)),
    "mistral-7b": (7.24e9, dict(model_type="mistral", hidden_size=4096, intermediate_size=14336,
                                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                                tie_word_embeddings=False, sliding_window=4096)),
    "phi3-mini": (3.82e9, dict(model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
                               tie_word_embeddings=False, sliding_window=2047)),
    "gemma3-270m": (268e6, dict(model_type="gemma3_text", hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                                num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                                sliding_window=512, tie_word_embeddings=True)),
    "gemma3-1b": (1.0e9, dict(model_type="gemma3_text", hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                              sliding_window=512, tie_word_embeddings=True)),
    "qwen3-30b-a3b": (30.5e9, dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                                   moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                                   num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                   vocab_size=151936, tie_word_embeddings=False)),
    "mixtral-8x7b": (46.7e9, dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                                  num_experts_per_tok=2, vocab_size=32000, tie_word_embeddings=False)),
    "olmoe-1b-7b": (6.92e9, dict(model_type="olmoe", hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                                 num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                                 vocab_size=50304, tie_word_embeddings=False)),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_named_real_sizes_match_published_models(name):
    published, cfg = PUBLISHED[name]
    args = model_args_for(name, cfg["vocab_size"])
    with torch.device("meta"):
        ours = Transformer(args).num_params()
        ref = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    assert ours == ref.num_parameters()
    assert abs(ours - published) / published < 0.01
    assert args.hf_model_type == cfg["model_type"] and args.tie_embeddings == cfg["tie_word_embeddings"]
    assert args.head_dim == cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    assert args.sliding_window == cfg.get("sliding_window")


def test_flops_with_explicit_head_dim_and_bias_match_torch_counter():
    """Qwen3-style head_dim != dim / n_heads plus q/k/v bias: 6N for weights, causal half for attention."""
    args = ModelArgs(dim=48, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=20, vocab_size=64, max_seq_len=64,
                     qkv_bias=True, qk_norm=True)
    model = Transformer(args)
    B, T = 2, 32
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        model(torch.randint(0, 64, (B, T))).float().sum().backward()
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    weights = counts.pop("aten.mm", 0) + counts.pop("aten.addmm", 0)
    attention = counts.pop("aten.bmm")
    assert not counts, f"unexpected FLOP-counted ops: {counts}"
    assert weights == 6 * matmul_params(args) * B * T
    assert attention == 2 * (flops_per_token(args, T) - 6 * matmul_params(args)) * B * T


def test_sliding_window_flops_count_the_band():
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=40, sliding_window=16)
    for T in (8, 16, 64, 256):
        band = sliding_window_mask(T, 16)[0, 0].sum().item() / T  # keys per query, diagonal included
        causal_offset = 0.5 if T <= 16 else 0.5 * 16 / T  # the continuous count halves the diagonal
        assert attended_keys(args, T) == pytest.approx(band - causal_offset)
    assert flops_per_token(args, 16) == flops_per_token(ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=40), 16)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_packed_documents_with_sliding_window_equal_separate_runs(family):
    args = ModelArgs(dim=32, n_layers=2, n_heads=2, vocab_size=VOCAB, max_seq_len=64, sliding_window=WINDOW,
                     hf_model_type="mistral")
    if family == "gemma3":  # a local layer with its own RoPE base, then a global one
        args = ModelArgs.from_dict({**args.to_dict(), **_args_dict("gemma3"), "max_seq_len": 64})
    model = Transformer(args)
    model.init_weights(seed=0)
    model.eval()
    a, b = ids(11, B=1, seed=5), ids(17, B=1, seed=6)
    doc = torch.tensor([[0] * 11 + [1] * 17])
    pos = torch.cat([torch.arange(11), torch.arange(17)]).unsqueeze(0)
    with torch.no_grad():
        packed = model(torch.cat([a, b], dim=1), position_ids=pos, document_ids=doc)
        torch.testing.assert_close(packed[:, :11], model(a), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed[:, 11:], model(b), atol=1e-5, rtol=1e-5)
