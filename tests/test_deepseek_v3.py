"""DeepSeek-V3 against transformers: latent attention, logits, latent-cache generation, packed documents,
export, config refusals and the named sizes.

Every model is a tiny random fp32 ``DeepseekV3ForCausalLM`` built by transformers itself: three layers
(the first dense), 8 experts in 4 groups of which a token keeps 2, two shared experts, YaRN with both
mscales, a random correction bias, with and without the query bottleneck.
"""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.errors import UserError
from lmforge.models.configs import LatentAttentionConfig, NormConfig
from lmforge.models.args import ModelArgs, model_args_for
from lmforge.models.deepseek_v3 import DEEPSEEK_V3_SIZES, DeepseekV3Args
from lmforge.models.deepseek_v3.args import yarn_softmax_scale
from lmforge.models.generate import generate
from lmforge.models.hf import load_hf_config, load_hf_model, save_hf_model
from lmforge.models.hf_config import args_from_hf_config
from lmforge.models.layers.kv_cache import KVCache
from lmforge.models.layers.latent_attention import LatentAttention

transformers = pytest.importorskip("transformers")

VOCAB = 256
YARN = dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=16, mscale=1.0,
            mscale_all_dim=0.8)
VARIANTS = {
    # DeepSeek-V3's own shape: query bottleneck, interleaved rotary features, YaRN
    "q_lora_yarn": dict(q_lora_rank=24, rope_interleave=True, rope_parameters=YARN),
    # DeepSeek-V2-Lite-like: one query projection, rotate-half features, plain RoPE
    "no_q_lora": dict(q_lora_rank=None, rope_interleave=False, rope_parameters=dict(rope_type="default", rope_theta=1e4)),
}


def hf_config(variant: str, **overrides) -> "transformers.DeepseekV3Config":
    cfg = dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        n_shared_experts=2, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        first_k_dense_replace=1, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
        routed_scaling_factor=2.5, vocab_size=VOCAB, max_position_embeddings=64, num_nextn_predict_layers=0,
        rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )
    return transformers.DeepseekV3Config(**{**cfg, **VARIANTS[variant], **overrides})


def tiny_hf(variant: str, seed: int = 0) -> "transformers.PreTrainedModel":
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(variant)).eval()
    with torch.no_grad():  # non-trivial norms and correction biases; decisive routers (no near-ties)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith(".gate.weight"):
                p.normal_(0.0, 1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    return model


def ids(T: int, B: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    """(transformers model, its directory, lmforge's model loaded from it)."""
    hf = tiny_hf(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, path, load_hf_model(path).eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_latent_attention_equals_transformers_module(variant):
    """The attention module alone, weights copied, on the rotary table transformers computes (YaRN's
    attention factor inside), with the softmax scale computed as transformers does."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as M

    cfg = hf_config(variant)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1)
    ref = M.DeepseekV3Attention(cfg, 0).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.normal_(1.0, 0.2) if "norm" in name else p.normal_(0.0, 0.1)
    x = torch.randn(2, 20, 64)
    cos, sin = M.DeepseekV3RotaryEmbedding(cfg)(x, torch.arange(20)[None].expand(2, -1))
    scale = yarn_softmax_scale(20, None if variant == "no_q_lora" else YARN)
    assert scale == pytest.approx(ref.scaling, rel=1e-12)
    lc = LatentAttentionConfig(dim=64, n_heads=4, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=12,
                               qk_rope_head_dim=8, v_head_dim=10, norm=NormConfig(16, 1e-6), scale=scale,
                               rope_interleave=cfg.rope_interleave)
    ours = LatentAttention(lc).eval()
    names = {"wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
             "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
    theirs = ref.state_dict()
    ours.load_state_dict({k: theirs[f"{names[k.split('.')[0]]}.{k.split('.')[1]}"] for k in ours.state_dict()})
    signed_sin = sin.unsqueeze(1).clone()
    signed_sin[..., :4] *= -1  # lmforge's tables carry rotate_half's sign
    with torch.no_grad():
        torch.testing.assert_close(ours(x, cos.unsqueeze(1), signed_sin, None, True), ref(x, (cos, sin), None)[0],
                                   atol=1e-5, rtol=1e-5)


def test_logits_equal_transformers(pair):
    hf, _, model = pair
    assert isinstance(model.args, DeepseekV3Args)
    tokens = ids(24)
    with torch.no_grad():
        ours, ref = model(tokens), hf(tokens).logits
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_rope_interleave_and_correction_bias_matter(pair):
    """The comparison above means something only if the interleaving and the bias change the logits."""
    hf, _, model = pair
    tokens = ids(24)
    with torch.no_grad():
        base = model(tokens)
        for layer in model.layers:
            layer.attention.interleaved = not layer.attention.interleaved
        flipped = model(tokens)
        for layer in model.layers:
            layer.attention.interleaved = not layer.attention.interleaved
        bias = model.layers[1].feed_forward.router.correction_bias
        saved = bias.clone()
        bias.zero_()
        unbiased = model(tokens)
        bias.copy_(saved)
    assert (base - flipped).abs().max() > 1e-3
    assert (base - unbiased).abs().max() > 1e-3


def test_latent_cache_holds_latents(pair):
    _, _, model = pair
    cache = KVCache.for_model(model, 3, 20)
    assert len(cache.k) == 3
    assert cache.k[0].shape == (3, 1, 20, 16) and cache.v[0].shape == (3, 1, 20, 8)  # kv_lora_rank, rope dims


def _set_absorb(model, absorb: bool) -> None:
    for layer in model.layers:
        layer.attention.absorb = absorb


@pytest.mark.parametrize("absorb", [True, False])
def test_greedy_generation_equals_transformers(pair, absorb):
    """Decode steps on the latent cache, with wkv_b absorbed into q and o or the latents re-expanded."""
    hf, _, model = pair
    prompt = ids(5, B=1, seed=2)
    new = 14
    ref = hf.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None,
                      attention_mask=torch.ones_like(prompt))
    _set_absorb(model, absorb)
    try:
        ours = generate(model, prompt.tolist(), new, eos_id=None, pad_id=0, temperature=0.0)
    finally:
        _set_absorb(model, True)
    assert ours[0] == ref[0, prompt.shape[1]:].tolist()


@pytest.mark.parametrize("adapted", [False, True])
def test_absorbed_decode_step_logits_equal_a_full_forward(pair, adapted):
    """Each cached decode step's logits (absorbed, left-padded rows) equal a forward over the whole row;
    also with trained LoRA adapters on wkv_b (whose decode steps then expand the latents)."""
    import copy

    _, _, model = pair
    if adapted:
        pytest.importorskip("peft")
        from lmforge.config import LoraSection
        from lmforge.models.lora import apply_lora

        model = apply_lora(copy.deepcopy(model), LoraSection(enabled=True, rank=4, target_modules=["wkv_b", "wo"]))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.5)
        model.eval()
    rows = [ids(9, B=1, seed=7)[0].tolist(), ids(4, B=1, seed=8)[0].tolist()]
    P = 9
    tokens = torch.tensor([[0] * (P - len(r)) + r for r in rows])
    valid = tokens != 0
    valid[1, : P - len(rows[1])] = False
    pos = (valid.long().cumsum(1) - 1).clamp(min=0)
    cache = KVCache.for_model(model, 2, P + 6, valid)
    with torch.no_grad():
        model(tokens, position_ids=pos, kv_cache=cache)
        nxt = ids(6, B=2, seed=9)
        for step in range(6):
            step_logits = model(nxt[:, step : step + 1], position_ids=pos[:, -1:] + step + 1, kv_cache=cache)[:, 0]
            for i, r in enumerate(rows):
                full = model(torch.tensor([r + nxt[i, : step + 1].tolist()]))[0, -1]
                torch.testing.assert_close(step_logits[i], full, atol=1e-5, rtol=1e-5)


def test_padded_batch_and_shared_prompts_equal_single_rows(pair):
    """Left padding and prefilled rows copied by ``select_rows`` give each row what it gets alone, which is
    what a full forward without a cache picks step by step."""
    _, _, model = pair
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (3, 11)]
    prompts.append(list(prompts[0]))  # a repeated prompt: prefilled once, its cache rows copied
    batched = generate(model, prompts, 8, eos_id=None, pad_id=0, temperature=0.0)
    single = [generate(model, [p], 8, eos_id=None, pad_id=0, temperature=0.0)[0] for p in prompts[:2]]
    assert batched == [single[0], single[1], single[0]]
    seq = list(prompts[1])
    with torch.no_grad():
        for _ in range(8):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert single[1] == seq[len(prompts[1]):]


def test_packed_documents_equal_separate_runs(pair):
    _, _, model = pair
    a, b = ids(11, B=1, seed=5), ids(17, B=1, seed=6)
    doc = torch.tensor([[0] * 11 + [1] * 17])
    pos = torch.cat([torch.arange(11), torch.arange(17)]).unsqueeze(0)
    with torch.no_grad():
        packed = model(torch.cat([a, b], dim=1), position_ids=pos, document_ids=doc)
        torch.testing.assert_close(packed[:, :11], model(a), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed[:, 11:], model(b), atol=1e-5, rtol=1e-5)


def test_export_round_trip_through_transformers(pair, tmp_path):
    hf, _, model = pair
    save_hf_model(model.state_dict(), model.args, tmp_path, eos_token_id=[2, 3], pad_token_id=0)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(again) is type(hf)
    tokens = ids(24, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, model(tokens), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(again(tokens).logits, hf(tokens).logits, atol=1e-5, rtol=1e-5)
    assert load_hf_config(tmp_path) == model.args
    assert ModelArgs.from_dict(model.args.to_dict()) == model.args


def test_multi_token_prediction_layers_are_ignored_in_one_line(pair, tmp_path):
    """Published checkpoints carry the MTP module as model.layers.{n_layers}.*: dropped on load, one warning."""
    from safetensors.torch import load_file, save_file

    hf, path, model = pair
    state = load_file(str(path / "model.safetensors"))
    state["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    state["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(4 * 22, 16)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg = {**json.loads((path / "config.json").read_text()), "num_nextn_predict_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match=r"ignoring the checkpoint's 1 multi-token-prediction layer\(s\)"):
        loaded = load_hf_model(tmp_path)
    tokens = ids(8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), model(tokens), atol=0, rtol=0)


@pytest.mark.parametrize("change, named", [
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}, "quantization_config (fp8)"),
    ({"attention_bias": True}, "attention_bias"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ({"topk_method": "greedy"}, "topk_method 'greedy'"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "'longrope'"),
    ({"n_group": 3}, "n_groups (3)"),
])
def test_unsupported_configs_are_refused_in_one_line(change, named):
    cfg = {**hf_config("q_lora_yarn").to_dict(), **change}
    with pytest.raises(UserError) as e:
        args_from_hf_config(cfg, "config.json")
    assert named in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("config.json: ")


def test_defaults_follow_transformers():
    """A terse config.json reads with transformers' DeepseekV3Config defaults."""
    terse = {"model_type": "deepseek_v3", "hidden_size": 64, "num_hidden_layers": 2}
    args = args_from_hf_config(terse, "config.json")
    ref = transformers.DeepseekV3Config(hidden_size=64, num_hidden_layers=2)
    assert (args.n_heads, args.q_lora_rank, args.kv_lora_rank, args.n_experts, args.n_groups, args.topk_groups) == (
        ref.num_attention_heads, ref.q_lora_rank, ref.kv_lora_rank, ref.n_routed_experts, ref.n_group, ref.topk_group)
    assert (args.first_k_dense_replace, args.routed_scaling_factor, args.rope_interleave, args.max_seq_len) == (
        ref.first_k_dense_replace, ref.routed_scaling_factor, ref.rope_interleave, ref.max_position_embeddings)
    assert args.moe_layers == [] and args.norm_eps == ref.rms_norm_eps


PUBLISHED = {  # (published total without the multi-token-prediction layer, tolerance, vocabulary)
    "deepseek-v3-671b": (671e9, 0.01, 129280),
    "kimi-k2": (1.0e12, 0.03, 163840),  # "1T total parameters"
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_named_sizes_match_transformers(name):
    from lmforge.models.spec import spec_for_args

    published, tolerance, vocab = PUBLISHED[name]
    args = model_args_for(name, vocab)
    cfg = spec_for_args(args).hf_config(args, torch_dtype="bfloat16")
    with torch.device("meta"):
        ours = spec_for_args(args).build(args).num_params()
        ref = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(**{
            k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}))
    assert ours == ref.num_parameters()
    assert abs(ours - published) / published < tolerance
    assert set(DEEPSEEK_V3_SIZES) == set(PUBLISHED)


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_flops_match_torch_counter(q_lora_rank):
    """Dense layers (the experts' grouped matmul is not counted by torch): 6N for the weights, the causal
    half of the q.k and p.v matmuls, with their different widths."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from lmforge.models.flops import flops_per_token, matmul_params
    from lmforge.models.spec import spec_for_args

    args = DeepseekV3Args(dim=64, n_layers=2, n_heads=4, vocab_size=VOCAB, max_seq_len=64, ffn_hidden_dim=96,
                          q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
                          v_head_dim=10, first_k_dense_replace=2, n_experts=8, n_experts_per_token=2)
    model = spec_for_args(args).build(args)
    B, T = 2, 32
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        model(torch.randint(0, VOCAB, (B, T))).float().sum().backward()
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    weights = counts.pop("aten.mm", 0) + counts.pop("aten.addmm", 0)
    attention = counts.pop("aten.bmm")
    assert not counts, f"unexpected FLOP-counted ops: {counts}"
    assert weights == 6 * matmul_params(args) * B * T
    assert attention == 2 * (flops_per_token(args, T) - 6 * matmul_params(args)) * B * T


TINY = dict(dim=64, n_layers=2, n_heads=4, ffn_hidden_dim=96, moe_ffn_dim=32, n_experts=8, n_experts_per_token=2,
            n_groups=4, topk_groups=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8,
            v_head_dim=10, first_k_dense_replace=1, max_seq_len=64,
            rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, mscale=1.0,
                              mscale_all_dim=1.0))


def test_named_size_and_checkpointed_arguments_come_back_as_the_family_class():
    """A run from ``model.size=deepseek-v3-671b`` (shrunk by overrides) builds latent attention, and the
    arguments a checkpoint stores (``to_dict``) read back as ``DeepseekV3Args``."""
    from lmforge.models.layers.moe import MoEFeedForward
    from lmforge.models.load import ModelSource, load_model
    loaded = load_model(ModelSource("init", "0"), size="deepseek-v3-671b", overrides=TINY)
    args = loaded.args
    assert isinstance(args, DeepseekV3Args) and args.rope_scaling["factor"] == 4.0
    assert isinstance(loaded.model.layers[0].attention, LatentAttention)
    assert isinstance(loaded.model.layers[1].feed_forward, MoEFeedForward)
    assert ModelArgs.from_dict(loaded.description()["model_args"]) == args
    assert model_args_for("kimi-k2", 100, **TINY).routed_scaling_factor == 2.827
    assert DEEPSEEK_V3_SIZES["deepseek-v3-671b"]["rope_scaling"]["factor"] == 40.0  # the preset is not shared


def test_correction_bias_is_balanced_after_each_optimizer_step():
    """The family's after-step hook moves each router's bias by bias_update_speed against its experts' load."""
    from lmforge.models.spec import spec_for_args

    args = DeepseekV3Args(**{**TINY, "vocab_size": VOCAB, "bias_update_speed": 0.01})
    spec = spec_for_args(args)
    model = spec.build(args)
    model.init_weights(seed=0)
    load = torch.tensor([[5.0, 1, 1, 1, 1, 1, 1, 1]])  # layer 1 (the only MoE layer): expert 0 overloaded
    spec.after_optimizer_step(model, args, {"router_expert_tokens": load})
    bias = model.layers[1].feed_forward.router.correction_bias
    assert bias[0].item() == pytest.approx(-0.01) and torch.allclose(bias[1:], torch.full((7,), 0.01))
    spec.after_optimizer_step(model, args, {})  # a step without routing statistics changes nothing
    assert bias[0].item() == pytest.approx(-0.01)
    model.requires_grad_(False)  # frozen routers (a LoRA run) keep their biases
    spec.after_optimizer_step(model, args, {"router_expert_tokens": load})
    assert bias[0].item() == pytest.approx(-0.01)
    assert spec.lora_targets["wkv_b"] == "attention.wkv_b" and spec.args_class is DeepseekV3Args


def _reference_sequence_aux(routers, mask):
    """DeepSeek-V3's sequence-wise balance loss written out per row and layer from the routers' own
    affinities (eq. 17-20 of arXiv 2412.19437), independently of lmforge's vectorised version."""
    per_layer = []
    for probs, chosen in routers:
        rows = []
        for b in range(mask.shape[0]):
            real = mask[b].bool()
            T, (E, k) = int(real.sum()), (probs.shape[-1], chosen.shape[-1])
            if T == 0:
                continue
            f = torch.zeros(E)
            for t in real.nonzero().flatten().tolist():
                for e in chosen[b, t].tolist():
                    f[e] += E / (k * T)
            P = probs[b][real].mean(0)
            rows.append((f * P).sum())
        per_layer.append(torch.stack(rows).mean())
    return torch.stack(per_layer).mean()


def test_sequence_wise_aux_loss_equals_deepseeks_formula_with_padding():
    """``aux_loss_scope=sequence`` (the family's default) gives DeepSeek-V3's per-row, per-layer loss over
    real tokens only, with a gradient into the router; ``batch`` gives transformers' batch-wise one."""
    from lmforge.models.layers.moe import MoEFeedForward, router_losses

    args = DeepseekV3Args(**{**TINY, "vocab_size": VOCAB, "n_layers": 3})
    model = spec_build(args)
    tokens = ids(12, B=3)
    mask = torch.ones(3, 12)
    mask[0, 9:] = 0
    mask[2, 4:] = 0  # rows of 12, 9 and 4 real tokens
    model(tokens)
    moes = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    routers = [(m.last_routing.probs.detach().view(3, 12, -1), m.last_routing.chosen.view(3, 12, -1)) for m in moes]
    terms = router_losses(model, mask)
    torch.testing.assert_close(terms.aux_loss, _reference_sequence_aux(routers, mask), rtol=1e-6, atol=1e-7)
    terms.aux_loss.backward()
    assert moes[0].router.weight.grad.abs().sum() > 0
    batch = DeepseekV3Args(**{**TINY, "vocab_size": VOCAB, "n_layers": 3, "aux_loss_scope": "batch"})
    model_b = spec_build(batch)
    model_b.load_state_dict(model.state_dict())
    model_b(tokens)
    assert not torch.allclose(router_losses(model_b, mask).aux_loss, terms.aux_loss)
    with pytest.raises(UserError, match="aux_loss_scope must be"):
        DeepseekV3Args(**{**TINY, "vocab_size": VOCAB, "aux_loss_scope": "token"})


def test_correction_bias_stays_fp32_through_dtype_casts():
    """A bf16 model keeps its routers' correction biases in fp32: a 1e-3 update is below bf16's
    resolution near the sigmoid scores the bias shifts."""
    args = DeepseekV3Args(**{**TINY, "vocab_size": VOCAB})
    model = spec_build(args).to(torch.bfloat16)
    router = model.layers[1].feed_forward.router
    assert router.weight.dtype == torch.bfloat16 and router.correction_bias.dtype == torch.float32
    with torch.device("meta"):
        meta = spec_build(args)
    meta.to_empty(device="cpu")
    assert meta.layers[1].feed_forward.router.correction_bias.device.type == "cpu"


def spec_build(args):
    from lmforge.models.spec import spec_for_args

    model = spec_for_args(args).build(args)
    model.init_weights(seed=0)
    return model


def write_chat_start(out: Path) -> Path:
    """A tiny random DeepSeek-V3 saved in ``out`` with a real chat tokenizer (Qwen2.5's fixture)."""
    import shutil

    from _chat_fixtures import REAL_TOKENIZERS

    tok = REAL_TOKENIZERS / "qwen2.5-instruct"
    real = json.loads((tok / "config.json").read_text())
    cfg = hf_config("q_lora_yarn", vocab_size=real["vocab_size"], bos_token_id=real.get("bos_token_id"),
                    eos_token_id=real.get("eos_token_id"), max_position_embeddings=512, pad_token_id=None)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    for f in tok.iterdir():
        if f.name != "config.json":
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def chat_start(tmp_path_factory):
    """A tiny random DeepSeek-V3 saved with a real chat tokenizer (Qwen2.5's fixture)."""
    return write_chat_start(tmp_path_factory.mktemp("deepseek_start"))


def _pairs(path):
    rows = [{"prompt": f"What is {i} plus 3?", "chosen": f" {i + 3}", "rejected": " no"} for i in range(8)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


CHATS = "tests/fixtures/data/fastchat_identity_multiturn.jsonl"
RECIPES = {
    "sft": lambda tmp: [f"--data.train={CHATS}", "--data.seq_len=128"],
    "lora_sft": lambda tmp: [f"--data.train={CHATS}", "--data.seq_len=128", "--lora.enabled=true", "--lora.rank=4"],
    "dpo": lambda tmp: [f"--data.train={_pairs(tmp / 'pairs.jsonl')}", "--data.seq_len=64", "--data.prefetch=0"],
    "grpo": lambda tmp: ["--grpo.num_generations=2", "--grpo.max_new_tokens=4", "--tasks.eval_examples=0"],
}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_trains_one_step_in_every_trainer(chat_start, recipe, tmp_path, capsys):
    """SFT, LoRA SFT, DPO and GRPO from a Hugging Face directory with a real chat template, one step each."""
    from pathlib import Path

    from _helpers import tiny_run_args
    from lmforge.cli import main
    from lmforge.metrics.records import read_records

    pytest.importorskip("peft")
    chats = Path(__file__).resolve().parent / "fixtures" / "data" / "fastchat_identity_multiturn.jsonl"
    extra = [a.replace(CHATS, str(chats)) for a in RECIPES[recipe](tmp_path)]
    run = tmp_path / "run"
    args = tiny_run_args(training_steps=1, training_global_batch_size=2, training_micro_batch_size=2, model_size=None,
                         model_n_layers=None, model_dim=None, model_n_heads=None, model_n_kv_heads=None)
    rc = main([recipe.removeprefix("lora_"), *args, *extra, f"--model.from_hf={chat_start}", "--data.validation=none",
               f"--run.dir={run}", "--checkpoint.enabled=false"])
    assert rc == 0, capsys.readouterr().err[-2000:]
    (record,) = read_records(run, "train")
    assert record["step"] == 1 and torch.isfinite(torch.tensor(record["loss"]))
    if recipe in ("sft", "lora_sft"):
        assert record["expert_load_max"] >= 1.0


@pytest.mark.parametrize("lora", [False, True])
def test_trained_run_exports_to_transformers_with_equal_logits(chat_start, lora, tmp_path, capsys):
    """Two SFT steps (full: the correction biases move by the balancing hook; LoRA on the latent projections
    and the experts, merged: frozen routers keep theirs), exported with ``lmforge export --hf``:
    transformers' logits equal lmforge's."""
    from pathlib import Path

    from _helpers import tiny_run_args
    from lmforge.cli import main
    from lmforge.inference import load_for_inference

    pytest.importorskip("peft")
    chats = Path(__file__).resolve().parent / "fixtures" / "data" / "fastchat_identity_multiturn.jsonl"
    run = tmp_path / "run"
    args = tiny_run_args(chats, training_steps=2, training_global_batch_size=2, training_micro_batch_size=2,
                         data_seq_len=128, tasks_eval_examples=0, model_size=None, model_n_layers=None, model_dim=None,
                         model_n_heads=None, model_n_kv_heads=None)
    adapters = ["--lora.enabled=true", "--lora.rank=4", "--lora.target_modules=wq_b,wkv_b,wo,w1,w2,w3"] if lora else []
    rc = main(["sft", *args, f"--model.from_hf={chat_start}", f"--run.dir={run}", "--optimizer.lr=0.05", *adapters])
    assert rc == 0, capsys.readouterr().err[-2000:]
    assert main(["export", str(run), "--hf", str(tmp_path / "hf")]) == 0, capsys.readouterr().err[-2000:]
    model, _ = load_for_inference(run)
    base = transformers.AutoModelForCausalLM.from_pretrained(chat_start).eval()
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(10, 1000, (1, 16))
    with torch.no_grad():
        ours = model.eval()(x)
        torch.testing.assert_close(exported(x).logits, ours, atol=1e-4, rtol=1e-4)
        assert (base(x).logits - ours).abs().max() > 1e-3
    # full fine-tuning balanced the routers after each step; LoRA's frozen routers keep their biases
    moved = bool(exported.model.layers[1].mlp.gate.e_score_correction_bias.abs().max() > 0)
    assert moved is not lora


def _sft_run(chat_start, out, nproc: int, flags: list[str]):
    from pathlib import Path

    from _helpers import run_lmforge, tail, tiny_run_args, torchrun

    chats = Path(__file__).resolve().parent / "fixtures" / "data" / "fastchat_identity_multiturn.jsonl"
    args = ("sft", *tiny_run_args(chats, training_steps=3, training_global_batch_size=4, training_micro_batch_size=2,
                                  data_seq_len=128, tasks_eval_examples=0, model_size=None, model_n_layers=None,
                                  model_dim=None, model_n_heads=None, model_n_kv_heads=None),
            f"--model.from_hf={chat_start}", f"--run.dir={out}", "--checkpoint.enabled=false",
            "--optimizer.lr=0.05", *flags)
    proc = run_lmforge(*args) if nproc == 1 else torchrun(*args, nproc=nproc)
    assert proc.returncode == 0, tail(proc)
    return out


@pytest.fixture(scope="module")
def one_process_run(chat_start, tmp_path_factory):
    """The one-process reference the 2-rank layouts are held against (run once for all of them)."""
    return _sft_run(chat_start, tmp_path_factory.mktemp("ds_one") / "one", 1, [])


@pytest.mark.parametrize("parallel", [["--parallel.mode=fsdp"], ["--parallel.mode=fsdp", "--parallel.ep=2"],
                                      ["--parallel.mode=fsdp", "--parallel.cp=2"]], ids=["fsdp2", "fsdp2_ep2", "cp2"])
def test_two_ranks_match_one_process(chat_start, one_process_run, parallel, tmp_path):
    """Real torchrun, 2 gloo ranks (FSDP2; with the experts split over both by expert parallelism; context
    parallelism, where latent attention's narrower values ride the key gather padded): the same losses and
    global router statistics as one process over three steps, so the correction biases, moved after each
    step from the global loads, stay the same on every rank."""
    from _helpers import assert_losses_match, losses
    from lmforge.metrics.records import read_records

    one, two = one_process_run, _sft_run(chat_start, tmp_path / "two", 2, parallel)
    # cp: step 1's gradient norm is 1.9e-6 off one process's with either attention path (the dense mask
    # before, blockwise now; the two agree to 7e-8), and lr 0.05 with the routers' sign-driven bias updates
    # grows that to 4.6e-6 (dense) / 1.0e-5 (blockwise) relative in step 3's loss (measured): fp32 order
    assert_losses_match(losses(two), losses(one), range(1, 4), rel=2e-5 if "--parallel.cp=2" in parallel else 1e-5)
    for a, b in zip(read_records(one, "train"), read_records(two, "train")):
        assert a["expert_load_max"] == pytest.approx(b["expert_load_max"], rel=1e-5)
