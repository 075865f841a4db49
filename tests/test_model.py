"""Transformer numerics against transformers' LlamaForCausalLM, plus packing and presets."""

from __future__ import annotations

import pytest
import torch

from lmforge.errors import UserError
from lmforge.models.flops import flops_per_token, matmul_params
from lmforge.runtime.precision import measure_matmul_peak, peak_flops_per_device
from lmforge.models.hf import hf_state_dict_from_lmforge
from lmforge.models.model import MODEL_SIZES, ModelArgs, Transformer, model_args_for

transformers = pytest.importorskip("transformers")


def hf_twin(model: Transformer) -> "transformers.LlamaForCausalLM":
    """A transformers Llama with the same config and (renamed) weights."""
    a = model.args
    cfg = transformers.LlamaConfig(
        hidden_size=a.dim, num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads,
        num_key_value_heads=a.kv_heads, intermediate_size=a.ffn_dim, vocab_size=a.vocab_size,
        rms_norm_eps=a.norm_eps, rope_theta=a.rope_theta, max_position_embeddings=a.max_seq_len,
        tie_word_embeddings=a.tie_embeddings, rope_scaling=a.rope_scaling,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    missing, unexpected = hf.load_state_dict(hf_state_dict_from_lmforge(model.state_dict(), a), strict=False)
    assert not unexpected
    assert set(missing) <= ({"lm_head.weight"} if a.tie_embeddings else set())
    return hf


def tiny(seed: int = 0, **kw) -> Transformer:
    args = ModelArgs(**{**dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=64), **kw})
    m = Transformer(args)
    m.init_weights(seed)
    # Perturb the norms so a wrong norm mapping cannot hide behind all-ones weights.
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return m.eval()


@pytest.mark.parametrize(
    "kw",
    [
        dict(n_kv_heads=2, tie_embeddings=False),
        dict(n_kv_heads=4, tie_embeddings=True),
        dict(n_kv_heads=1, tie_embeddings=False, rope_theta=500000.0),
        dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=16)),
    ],
)
def test_logits_match_transformers(kw):
    model = tiny(**kw)
    hf = hf_twin(model)
    tokens = torch.randint(0, model.args.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(tokens)
        ref = hf(tokens).logits
    assert ours.shape == (3, 40, model.args.vocab_size)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)


def test_tied_embeddings_share_storage():
    m = tiny(tie_embeddings=True)
    assert m.output.weight is m.tok_embeddings.weight
    untied = tiny(tie_embeddings=False)
    assert m.num_params() == untied.num_params() - untied.output.weight.numel()


def test_packed_documents_equal_separate_runs():
    model = tiny()
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, 97, (1, 11), generator=g)
    b = torch.randint(0, 97, (1, 17), generator=g)
    packed = torch.cat([a, b], dim=1)
    doc = torch.tensor([[0] * 11 + [1] * 17])
    pos = torch.cat([torch.arange(11), torch.arange(17)]).unsqueeze(0)
    with torch.no_grad():
        out = model(packed, position_ids=pos, document_ids=doc)
        ra, rb = model(a), model(b)
        plain = model(packed)
    torch.testing.assert_close(out[:, :11], ra, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out[:, 11:], rb, atol=1e-5, rtol=1e-4)
    # Without document_ids the second document sees the first: the mask really matters.
    assert (plain[:, 11:] - rb).abs().max() > 1e-3


def test_position_ids_default_is_arange():
    model = tiny()
    t = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(t), model(t, position_ids=torch.arange(9).expand(2, 9)))


def test_too_long_sequence_is_user_error():
    model = tiny()
    with pytest.raises(UserError, match="max_seq_len"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_init_is_deterministic_and_bf16_keeps_fp32_rope():
    a, b, c = tiny(seed=5), tiny(seed=5), tiny(seed=6)
    assert torch.equal(a.layers[0].attention.wq.weight, b.layers[0].attention.wq.weight)
    assert not torch.equal(a.layers[0].attention.wq.weight, c.layers[0].attention.wq.weight)
    a.to(torch.bfloat16)
    assert a.rope.cos.dtype == torch.float32
    torch.testing.assert_close(a.rope.cos, b.rope.cos, atol=0, rtol=0)
    assert a(torch.zeros(1, 4, dtype=torch.long)).dtype == torch.bfloat16


def test_meta_init_then_to_empty():
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=97, max_seq_len=64)
    with torch.device("meta"):
        m = Transformer(args)
    m.to_empty(device="cpu")
    m.init_weights(seed=5)
    ref = Transformer(args)
    ref.init_weights(seed=5)
    t = torch.randint(0, 97, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(m(t), ref(t), atol=0, rtol=0)


def test_presets():
    assert {"debug", "small", "125m", "1b", "8b"} <= set(MODEL_SIZES)
    dbg = Transformer(model_args_for("debug", 512))
    assert 0.8e6 < dbg.num_params() < 3e6
    one_b = model_args_for("1b", 128256)
    assert (one_b.dim, one_b.n_layers, one_b.kv_heads, one_b.ffn_dim, one_b.tie_embeddings) == (2048, 16, 8, 8192, True)
    with torch.device("meta"):
        n = Transformer(one_b).num_params()
    assert 1.2e9 < n < 1.3e9  # Llama-3.2-1B has 1.24B parameters
    assert model_args_for("small", 100, n_layers=2).n_layers == 2
    with pytest.raises(UserError, match="huge.*debug"):
        model_args_for("huge", 512)
    with pytest.raises(UserError, match="bogus"):
        model_args_for("debug", 512, bogus=1)
    assert ModelArgs.from_dict(dbg.args.to_dict()) == dbg.args


def test_ffn_dim_llama_rounding():
    # int(8/3 * 4096) = 10922 -> next multiple of 64 (Llama-2 used 256, giving 11008)
    assert ModelArgs(dim=4096, n_heads=32).ffn_dim == 10944
    assert ModelArgs(dim=128).ffn_dim == 384
    assert ModelArgs(dim=128, ffn_hidden_dim=100).ffn_dim == 100


def test_flops_hand_count():
    args = ModelArgs(dim=8, n_layers=2, n_heads=2, n_kv_heads=1, vocab_size=10, ffn_hidden_dim=16)
    # per layer: wq 8x8=64, wk 8x4=32, wv 32, wo 64, mlp 3*8*16=384 -> 576; x2 layers + head 8*10
    assert matmul_params(args) == 2 * 576 + 80
    # attention: 6 * layers * T * d = 6 * 2 * 5 * 8 = 480
    assert flops_per_token(args, seq_len=5) == 6 * (2 * 576 + 80) + 480
    # matches a real module's matmul weights (everything but embeddings and norms)
    m = Transformer(args)
    n = sum(p.numel() for name, p in m.named_parameters() if not name.endswith("norm.weight")
            and not name.startswith("tok_embeddings"))
    assert n == matmul_params(args)


def test_peak_flops():
    peak, src = peak_flops_per_device(torch.device("cpu"), torch.float32)
    assert peak > 0 and "measured" in src
    assert peak_flops_per_device(torch.device("cpu"), torch.float32, configured=1.5e12) == (1.5e12, "configured")
    assert measure_matmul_peak("cpu", torch.float32, size=256, iters=2) > 0
