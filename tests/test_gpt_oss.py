"""gpt-oss against transformers' ``GptOssForCausalLM``: a tiny random model (alternating sliding and full
layers with a window of 4, YaRN, sinks, biased router and experts with the clamp active) gives the same
fp32 logits and gradients, the same greedy continuation past the window, packed documents equal to
separate runs, and an export transformers reads back as the same class with the same logits. Also: the
config.json mapping both ways (the published configs read as the named sizes, whose parameter counts
equal transformers'), the tensor layout, and MXFP4 checkpoints dequantized as transformers does."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmforge.errors import UserError  # noqa: E402
from lmforge.models.generate import generate  # noqa: E402
from lmforge.models.gpt_oss import GPT_OSS_SIZES, GptOssArgs, gpt_oss_args_for  # noqa: E402
from lmforge.models.gpt_oss.config_json import args_from_hf, hf_config  # noqa: E402
from lmforge.models.gpt_oss.mxfp4 import dequantize_mxfp4, dequantize_mxfp4_state  # noqa: E402
from lmforge.models.gpt_oss.state_dict import GPT_OSS_LAYOUT  # noqa: E402
from lmforge.models.hf import load_hf_config, load_hf_model, save_hf_model  # noqa: E402
from lmforge.models.model import Transformer  # noqa: E402
from lmforge.models.spec import spec_for_args  # noqa: E402

VOCAB, WINDOW = 96, 4
YARN = dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=16, rope_theta=10000.0)


def tiny_config(**over) -> "transformers.GptOssConfig":
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
               layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=64,
               rope_parameters=dict(YARN), swiglu_limit=1.5, rms_norm_eps=1e-5, tie_word_embeddings=False)
    return transformers.GptOssConfig(**{**cfg, **over})


def tiny_hf(seed: int = 0, **over) -> "transformers.PreTrainedModel":
    torch.manual_seed(seed)
    cfg = tiny_config(**over)
    cfg._attn_implementation = "eager"  # the reference: softmax over [scores, sink] written out
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():  # nothing left at 0 or 1, decisive routers, sinks that matter, clamps that bite
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("sinks"):
                p.normal_(0.0, 1.0)
            elif "router" in name:
                p.normal_(0.0, 1.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "experts" in name:
                p.normal_(0.0, 0.3)
    return model


def ids(T: int, B: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def ours_from(hf) -> Transformer:
    args = args_from_hf(hf.config.to_dict(), "config.json")
    model = Transformer(args).eval()
    model.load_state_dict(GPT_OSS_LAYOUT.from_hf(hf.state_dict(), args), strict=True)
    return model


# --- config.json ----------------------------------------------------------------------------------------------

REAL_20B = {  # https://huggingface.co/openai/gpt-oss-20b/raw/main/config.json
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}
REAL = {"gpt-oss-20b": REAL_20B,  # 120b: the same with 36 layers and 128 experts
        "gpt-oss-120b": {**REAL_20B, "num_hidden_layers": 36, "num_local_experts": 128,
                         "layer_types": ["sliding_attention", "full_attention"] * 18}}


@pytest.mark.parametrize("size", list(GPT_OSS_SIZES))
def test_published_configs_read_as_the_named_sizes(size):
    assert args_from_hf(REAL[size], "config.json") == gpt_oss_args_for(size, 201088)


@pytest.mark.parametrize("size", list(GPT_OSS_SIZES))
def test_named_sizes_have_transformers_parameter_counts(size):
    cfg = {k: v for k, v in REAL[size].items() if k != "quantization_config"}
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
        ours = Transformer(gpt_oss_args_for(size, 201088))
    want = sum(p.numel() for p in hf.parameters())
    assert ours.num_params() == want
    assert round(want / 1e9, 2) == {"gpt-oss-20b": 20.91, "gpt-oss-120b": 116.83}[size]


def test_config_round_trip_and_defaults():
    hf = tiny_config()
    args = args_from_hf(hf.to_dict(), "config.json")
    assert isinstance(args, GptOssArgs) and args.hf_model_type == "gpt_oss" and spec_for_args(args).name == "gpt_oss"
    assert args.layer_types == ["sliding_attention", "full_attention"] * 2 and args.sliding_window == WINDOW
    assert args.rope_scaling["rope_type"] == "yarn" and args.rope_scaling["factor"] == 4.0
    assert args.swiglu_limit == 1.5 and args.swiglu_alpha == 1.702 and not args.moe_norm_topk
    back = transformers.GptOssConfig(**hf_config(args, torch_dtype="float32"))
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "num_local_experts", "num_experts_per_tok", "sliding_window", "layer_types",
                "rope_parameters", "swiglu_limit", "swiglu_alpha", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(back, key) == getattr(hf, key), key
    # a terse config means what transformers' defaults mean
    terse = args_from_hf({"model_type": "gpt_oss", "num_hidden_layers": 2}, "config.json")
    full = transformers.GptOssConfig(num_hidden_layers=2)
    assert terse.layer_types == full.layer_types and terse.rope_scaling == {
        k: v for k, v in full.rope_parameters.items() if k != "rope_theta"}
    assert terse.rope_theta == full.rope_parameters["rope_theta"] and terse.n_experts == full.num_local_experts


@pytest.mark.parametrize("change,message", [
    ({"attention_bias": False}, "attention_bias=false"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quant_method 'bitsandbytes'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 8.0}}, "rope type .dynamic."),
    ({"layer_types": ["chunked_attention"] * 4}, "layer_types"),
])
def test_refused_in_one_line(change, message):
    with pytest.raises(UserError, match=message) as e:
        args_from_hf({**tiny_config().to_dict(), **change}, "x/config.json")
    assert "\n" not in str(e.value) and str(e.value).startswith("x/config.json: ")


def test_export_refuses_what_gpt_oss_cannot_express():
    args = args_from_hf(tiny_config().to_dict(), "config.json")
    for change in ({"attention_sinks": False}, {"router_bias": False}, {"moe_norm_topk": True}):
        bad = GptOssArgs.from_dict({**args.to_dict(), **change})
        with pytest.raises(UserError, match="cannot export"):
            hf_config(bad, torch_dtype="float32")


# --- tensors --------------------------------------------------------------------------------------------------

def test_layout_round_trip_and_meaning():
    hf = tiny_hf()
    args = args_from_hf(hf.config.to_dict(), "config.json")
    state = GPT_OSS_LAYOUT.from_hf(hf.state_dict(), args)
    again = GPT_OSS_LAYOUT.to_hf(state, args)
    assert set(again) == set(hf.state_dict())
    for k, v in hf.state_dict().items():
        assert torch.equal(again[k], v), k
    e = 1
    x = torch.randn(3, args.dim)
    gate_up = x @ hf.model.layers[0].mlp.experts.gate_up_proj[e] + hf.model.layers[0].mlp.experts.gate_up_proj_bias[e]
    w1, w3 = state["layers.0.feed_forward.experts.w1"][e], state["layers.0.feed_forward.experts.w3"][e]
    b1, b3 = state["layers.0.feed_forward.experts.b1"][e], state["layers.0.feed_forward.experts.b3"][e]
    torch.testing.assert_close(gate_up[:, ::2], x @ w1.T + b1)
    torch.testing.assert_close(gate_up[:, 1::2], x @ w3.T + b3)
    assert all(t.is_contiguous() for t in state.values())


def test_mxfp4_dequantize_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 10, 4), generator=g, dtype=torch.uint8)
    for dtype in (torch.bfloat16, torch.float32):
        want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [3, 128, 10]: transformers' orientation
        got = dequantize_mxfp4(blocks, scales, dtype, rows_per_chunk=7)
        assert got.dtype == dtype and torch.equal(got.transpose(1, 2), want)


def test_mxfp4_checkpoint_loads_as_its_dequantized_weights(tmp_path):
    """A checkpoint whose experts are MXFP4 (as published) gives the model transformers' dequantizer gives."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = tiny_hf()
    args = args_from_hf(hf.config.to_dict(), "config.json")
    g = torch.Generator().manual_seed(1)
    E, H, dim = args.n_experts, args.ffn_dim, args.dim
    quantized, dequantized = {}, {}
    for k, v in hf.state_dict().items():
        if k.endswith("gate_up_proj") or k.endswith("down_proj"):
            rows, cols = (2 * H, dim) if k.endswith("gate_up_proj") else (dim, H)
            blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(118, 128, (E, rows, cols // 32), generator=g, dtype=torch.uint8)
            quantized |= {k + "_blocks": blocks, k + "_scales": scales}
            dequantized[k] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            quantized[k] = dequantized[k] = v
    ours = GPT_OSS_LAYOUT.from_hf(quantized, args)
    want = GPT_OSS_LAYOUT.from_hf(dequantized, args)
    assert set(ours) == set(want) and all(torch.equal(ours[k], want[k]) for k in want)
    assert dequantize_mxfp4_state(dequantized).keys() == dequantized.keys()


# --- the model ------------------------------------------------------------------------------------------------

def test_logits_and_gradients_equal_transformers():
    hf = tiny_hf()
    model = ours_from(hf)
    tokens = ids(20)  # past the window (4) and YaRN's original context (16)
    want = hf(tokens).logits
    got = model(tokens)
    diff = (got - want).abs().max().item()
    assert diff < 1e-5, diff
    # gradients: the sinks, the router's bias and the experts' biases among them
    target = torch.randn(want.shape, generator=torch.Generator().manual_seed(5))
    (want * target).sum().backward()
    (got * target).sum().backward()
    ours = dict(model.named_parameters())
    hf_grads = GPT_OSS_LAYOUT.from_hf({k: p.grad for k, p in hf.named_parameters()}, model.args)
    for name, grad in hf_grads.items():  # relative to the tensor's largest gradient: fp32 sums in other orders
        err = (ours[name].grad - grad).abs().max() / grad.abs().max().clamp(min=1e-6)
        assert err < 2e-5, (name, err.item())
    assert ours["layers.0.attention.sinks"].grad.abs().max() > 0


def test_sinks_and_window_matter():
    """The comparison above means something only if the sinks and the window change the logits."""
    hf = tiny_hf()
    model = ours_from(hf)
    tokens = ids(20)
    with torch.no_grad():
        base = model(tokens)
        for layer in model.layers:
            layer.attention.sinks.fill_(-1e4)
        assert (model(tokens) - base).abs().max() > 1e-2
    full = ours_from(tiny_hf(layer_types=["full_attention"] * 4))
    with torch.no_grad():
        assert (full(tokens) - base).abs().max() > 1e-2


def test_greedy_generation_past_the_window_equals_transformers(tmp_path):
    hf = tiny_hf(seed=1)
    hf.save_pretrained(tmp_path)
    model = load_hf_model(tmp_path)
    prompt = ids(5, B=1, seed=2)
    new = 14  # 19 tokens: the window (4) is passed many times over during decoding
    ref = hf.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None,
                      attention_mask=torch.ones_like(prompt))
    ours = generate(model, prompt.tolist(), new, eos_id=None, pad_id=0, temperature=0.0)
    assert ours[0] == ref[0, prompt.shape[1]:].tolist()
    # left padding: each row batched equals the row alone
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (3, 11)]
    batched = generate(model, prompts, 10, eos_id=None, pad_id=0, temperature=0.0)
    assert batched == [generate(model, [p], 10, eos_id=None, pad_id=0, temperature=0.0)[0] for p in prompts]


def test_packed_documents_equal_separate_runs():
    model = ours_from(tiny_hf())
    lengths = [7, 3, 10]  # two longer than the window
    tokens = ids(sum(lengths), B=1, seed=6)
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with torch.no_grad():
        packed = model(tokens, position_ids=pos, document_ids=docs)
        separate = torch.cat([model(t) for t in tokens.split(lengths, dim=1)], dim=1)
    diff = (packed - separate).abs().max().item()
    assert diff < 1e-5, diff


def test_export_round_trip_through_transformers(tmp_path):
    hf = tiny_hf()
    hf.save_pretrained(tmp_path / "in")
    model = load_hf_model(tmp_path / "in")
    save_hf_model(model.state_dict(), model.args, tmp_path / "out", eos_token_id=[2, 3], pad_token_id=0)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "gpt_oss" and cfg["architectures"] == ["GptOssForCausalLM"]
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert type(again) is type(hf)
    tokens = ids(20, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, model(tokens), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(again(tokens).logits, hf(tokens).logits, atol=1e-5, rtol=1e-5)
    assert load_hf_config(tmp_path / "out") == model.args


def test_context_and_expert_parallel_equal_one_process(tmp_path):
    """2 gloo ranks: cp=2 (packed and causal batches; sinks and windows with keys gathered from both ranks),
    then ep=2 with FSDP2: losses, hidden states and every gradient equal one process's (_gpt_oss_dist_check.py)."""
    import subprocess
    import sys
    from pathlib import Path

    from _helpers import REPO, cli_env

    out = tmp_path / "errors.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--monitor-interval=0.2", str(Path(__file__).with_name("_gpt_oss_dist_check.py")), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=cli_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "gpt-oss distributed check passed" in proc.stdout
    errors = json.loads(out.read_text())
    assert errors and max(errors.values()) < 1e-5, errors


def test_mxfp4_directory_loads_as_transformers_loads_it(tmp_path):
    """A directory as published (expert weights as MXFP4 blocks and scales, ``quantization_config``): lmforge's
    model equals the one transformers builds from the same directory (it dequantizes on a CPU too)."""
    from safetensors.torch import save_file

    hf = tiny_hf(intermediate_size=64)  # MXFP4 blocks are 32 wide: dim 64, hidden 64
    hf.save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(1)
    state = {}
    for k, v in hf.state_dict().items():
        if k.endswith("gate_up_proj") or k.endswith("down_proj"):  # [E, in, out], stored as [E, out, in / 32, 16]
            E, cols, rows = v.shape
            state[k + "_blocks"] = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
            state[k + "_scales"] = torch.randint(118, 126, (E, rows, cols // 32), generator=g, dtype=torch.uint8)
        else:
            state[k] = v.contiguous()
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    ours = load_hf_model(tmp_path)
    tokens = ids(20)
    with torch.no_grad():
        diff = (theirs(tokens).logits - ours(tokens)).abs().max().item()
    assert diff < 1e-5, diff


@pytest.mark.parametrize("size", list(GPT_OSS_SIZES))
def test_plan_runs_for_the_named_sizes(size, capsys):
    from lmforge.cli import main

    rc = main(["plan", "--devices", "8", "--device-memory-gb", "80", f"--model.size={size}", "--model.tokenizer=byte",
               "--vocab-size", "201088", "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out[-2000:]
    rows = json.loads(out)
    assert rows and any(r["layout"]["ep"] > 1 for r in rows)
    assert all(r["layout"]["tp"] == 1 for r in rows)  # sinks: no tensor-parallel plan


def test_bf16_norm_scales_in_fp32_as_transformers_does():
    """gpt-oss's RMSNorm on bf16 input scales by the weight in fp32 and casts last (transformers'
    GptOssRMSNorm), bit for bit; its gradients equal autograd's through the same expression. Llama's
    convention (cast, then scale in bf16) gives other bits, so the test can tell them apart."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    from lmforge.models.configs import NormConfig
    from lmforge.models.layers.norm import RMSNorm

    torch.manual_seed(0)
    ref = GptOssRMSNorm(64, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        ref.weight.normal_(1.0, 0.3)
    ours, llama = RMSNorm(NormConfig(64, 1e-5, weight_in_fp32=True)), RMSNorm(NormConfig(64, 1e-5))
    for norm in (ours, llama):
        norm.to(torch.bfloat16).weight.data.copy_(ref.weight.data)
    x = (torch.randn(4, 16, 64) * 3).to(torch.bfloat16).requires_grad_(True)
    want = ref(x)
    assert torch.equal(ours(x), want) and not torch.equal(llama(x), want)
    grads = torch.autograd.grad(want.float().pow(2).sum(), (x, ref.weight))
    got = torch.autograd.grad(ours(x).float().pow(2).sum(), (x, ours.weight))
    for g, w in zip(got, grads):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=1e-2)
