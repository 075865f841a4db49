"""The gated activation and RMSNorm autograd nodes: the same forward bits as the eager composites they
replace, the same gradients, and fewer bytes saved for the backward (counted, not assumed).

The references are the expressions the layers computed before (``act(g) * u``; ``F.rms_norm`` for
fp32, the fp32-normalise-then-cast expression for bf16, Gemma's ``(1 + w)`` in fp32), differentiated by
eager autograd.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from lmforge.models.configs import MLPConfig
from lmforge.models.layers import mlp, moe, norm
from lmforge.models.layers.mlp import FeedForward, activation, gated_activation
from lmforge.models.layers.norm import rms_norm, unit_offset_rms_norm
from lmforge.models.model import ModelArgs, Transformer

ACTS = ("silu", "gelu_tanh")


def old_gated(g: Tensor, u: Tensor, name: str) -> Tensor:
    return activation(name)(g) * u


def old_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def old_unit_offset(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


NORMS = {"llama": (rms_norm, old_rms_norm), "unit_offset": (unit_offset_rms_norm, old_unit_offset)}


def saved(fn: Callable[[], Tensor]) -> tuple[Tensor, dict[int, int]]:
    """``fn()`` and the storages autograd saved while it ran (data pointer -> bytes; shared ones once)."""
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, storages


def grads(out: Tensor, inputs: tuple[Tensor, ...], seed: int = 3) -> tuple[Tensor, ...]:
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    return torch.autograd.grad(out, inputs, gy)


def close(got: Tensor, want: Tensor, dtype: torch.dtype) -> None:
    """fp32: 1e-6 of the tensor's largest entry (a sum in another order); bf16: two of its ulps."""
    scale = float(want.abs().max())
    tol = 1e-6 * scale if dtype == torch.float32 else 2 * 2 ** -8 * scale
    torch.testing.assert_close(got, want, rtol=0, atol=tol)


def leaf(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0) -> Tensor:
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale
    return t.to(dtype).requires_grad_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ACTS)
def test_gated_activation_same_bits_and_gradients_saving_only_its_inputs(name, dtype):
    g, u = leaf(6, 40, 96, dtype=dtype, scale=3.0), leaf(6, 40, 96, dtype=dtype, seed=1)
    got, kept = saved(lambda: gated_activation(g, u, name))
    want, kept_old = saved(lambda: old_gated(g, u, name))
    assert got.dtype == want.dtype and torch.equal(got, want)
    # the product rule and the activation's own backward kernel, as eager autograd runs them: same bits
    for a, b in zip(grads(got, (g, u)), grads(want, (g, u))):
        assert torch.equal(a, b)
    assert kept == {g.data_ptr(): g.nbytes, u.data_ptr(): u.nbytes}
    assert sum(kept_old.values()) == 3 * g.nbytes  # and act(g) besides


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(NORMS))
def test_rms_norm_same_bits_and_gradients_saving_input_and_rstd(kind, dtype):
    new, old = NORMS[kind]
    x = leaf(4, 33, 96, dtype=dtype, scale=3.0)
    w = (torch.randn(96, generator=torch.Generator().manual_seed(7)) * 0.3 + (0.0 if kind == "unit_offset" else 1.0))
    w.requires_grad_()
    got, kept = saved(lambda: new(x, w, 1e-5))
    want, kept_old = saved(lambda: old(x, w, 1e-5))
    assert got.dtype == want.dtype and torch.equal(got, want)
    for a, b, t in zip(grads(got, (x, w)), grads(want, (x, w)), (dtype, torch.float32)):
        assert a.dtype == b.dtype
        close(a.float(), b.float(), t)
    rows = 4 * 33
    assert kept == {x.data_ptr(): x.nbytes, w.data_ptr(): w.nbytes, **{
        p: 4 * rows for p in kept if p not in (x.data_ptr(), w.data_ptr())}} and len(kept) == 3
    # eager autograd keeps the fp32 normalised values besides (and, for bf16 input, its fp32 copy)
    assert sum(kept_old.values()) >= sum(kept.values()) + 4 * x.numel()


@pytest.mark.parametrize("fused", [True, False])
def test_rms_norm_fp32_is_f_rms_norm_and_without_grad_is_the_plain_call(fused, monkeypatch):
    if not fused:  # torch < 2.8 has no aten._fused_rms_norm: the composite F.rms_norm ran there
        monkeypatch.setattr(norm, "_FUSED_RMS_NORM", None)
    x, w = leaf(3, 17, 64, scale=5.0), leaf(64, seed=2)
    assert torch.equal(rms_norm(x, w, 1e-6), F.rms_norm(x, (64,), w, 1e-6))
    with torch.no_grad():
        assert torch.equal(rms_norm(x, w, 1e-6), F.rms_norm(x, (64,), w, 1e-6))
    # only the input needs a gradient (LoRA's frozen norms), or only the weight
    frozen = w.detach()
    out = rms_norm(x, frozen, 1e-6)
    (gx,) = grads(out, (x,))
    (gx_old,) = grads(old_rms_norm(x, frozen, 1e-6), (x,))
    close(gx, gx_old, torch.float32)
    const = x.detach()
    (gw,) = grads(rms_norm(const, w, 1e-6), (w,))
    (gw_old,) = grads(old_rms_norm(const, w, 1e-6), (w,))
    close(gw, gw_old, torch.float32)


def _old_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Put the eager composites back where the layers call the new nodes."""
    monkeypatch.setattr(mlp, "gated_activation", old_gated)  # the experts' gated unit calls it too
    monkeypatch.setattr(norm, "rms_norm", old_rms_norm)
    monkeypatch.setattr(norm, "unit_offset_rms_norm", old_unit_offset)


MODELS = {
    "llama": {},
    "qwen3_qknorm": dict(qk_norm=True, head_dim=16),
    "gemma": dict(norm_unit_offset=True, sandwich_norm=True, hidden_act="gelu_tanh", embed_scale=True),
    "moe": dict(n_experts=4, n_experts_per_token=2, moe_layers=[1]),
}


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("family", list(MODELS))
def test_model_same_logits_gradients_close_fewer_saved_bytes(family, bf16, monkeypatch):
    """A whole decoder (fp32, or under bf16 autocast as training runs it): the same logits as with the
    eager composites, gradients equal up to rounding, and less saved."""
    args = ModelArgs(**dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, max_seq_len=64,
                            ffn_hidden_dim=160), **MODELS[family])
    model = Transformer(args)
    model.init_weights(0)
    with torch.no_grad():  # norms away from their identity init, so a wrong weight gradient shows
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    tokens = torch.randint(0, 97, (3, 24), generator=torch.Generator().manual_seed(1))
    cast = torch.autocast("cpu", torch.bfloat16) if bf16 else contextlib.nullcontext()

    def run() -> tuple[Tensor, int, list[Tensor]]:
        model.zero_grad(set_to_none=True)
        with cast:
            logits, kept = saved(lambda: model(tokens))
        logits.float().pow(2).mean().backward()
        return logits.detach(), sum(kept.values()), [p.grad for p in model.parameters()]

    new_logits, new_bytes, new_grads = run()
    with monkeypatch.context() as m:
        _old_layers(m)
        old_logits, old_bytes, old_grads = run()
    assert torch.equal(new_logits, old_logits)
    for a, b in zip(new_grads, old_grads):
        close(a, b, torch.bfloat16 if bf16 else torch.float32)
    tokens_n = tokens.numel()
    a = 2 if bf16 else 4
    # per norm on the fp32 residual stream (two per block, the final one): its fp32 normalised values
    cut = 4 * args.dim * tokens_n * (2 * args.n_layers + 1)
    if args.sandwich_norm:  # the post norms read the sublayers' outputs (bf16 under autocast, where
        # eager autograd also kept their fp32 copy, and now the bf16 input is kept instead)
        cut += (6 if bf16 else 4) * args.dim * tokens_n * 2 * args.n_layers
    for i in range(args.n_layers):  # per MLP row: act(g); the experts' grouped matmuls have no autocast
        if args.is_moe_layer(i):  # rule on a CPU, so they run in fp32
            cut += 4 * tokens_n * args.n_experts_per_token * args.expert_ffn_dim
        else:
            cut += a * tokens_n * args.ffn_dim
    if args.qk_norm:  # per q/k value: fp32 normalised values (from bf16 input: its fp32 copy, and the
        # bf16 normalised values instead of the bf16 input)
        cut += 4 * (args.n_heads + args.kv_heads) * args.head_dim * tokens_n * args.n_layers
    assert old_bytes - new_bytes == cut


def test_dtensor_shards_compute_their_own_rows():
    """Sequence-parallel norms and tensor-parallel MLP shards: DTensor inputs (two ranks, Shard(1)) give
    each rank what the plain tensors of its shard give, and the norm weight a partial gradient."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        x, w = leaf(2, 8, 32, scale=2.0), leaf(32, seed=4)
        for fn in (rms_norm, unit_offset_rms_norm):
            xd = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
            wd = DTensor.from_local(w, mesh, [Replicate()], run_check=False)
            out = fn(xd, wd, 1e-5)
            assert isinstance(out, DTensor) and out.placements == (Shard(1),)
            want = fn(x, w, 1e-5)
            assert torch.equal(out.to_local(), want)
            gx, gw = grads(out.to_local(), (x, w))
            gx_ref, gw_ref = grads(want, (x, w))
            close(gx, gx_ref, torch.float32)
            close(gw, gw_ref, torch.float32)
        g, u = leaf(2, 8, 48, seed=5), leaf(2, 8, 48, seed=6)
        for name in ACTS:
            gd, ud = (DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in (g, u))
            out = gated_activation(gd, ud, name)
            assert out.placements == (Shard(2),) and torch.equal(out.to_local(), old_gated(g, u, name))
            for a, b in zip(grads(out.to_local(), (g, u)), grads(old_gated(g, u, name), (g, u))):
                assert torch.equal(a, b)
        # the weight's gradient over a rank's rows is a partial sum, as eager autograd's is
        xd = DTensor.from_local(x.detach(), mesh, [Shard(1)], run_check=False)
        wd = DTensor.from_local(w.detach(), mesh, [Replicate()], run_check=False).requires_grad_()
        rms_norm(xd, wd, 1e-5).to_local().sum().backward()
        assert wd.grad.placements == (Partial(),)
    finally:
        dist.destroy_process_group()


def test_compiled_checkpointed_and_meta():
    """torch.compile (aot_eager: no C++ build), activation checkpointing and the meta device."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    ff = FeedForward(MLPConfig(32, 80, "gelu_tanh"))
    w = leaf(32, seed=9)

    def block(x: Tensor) -> Tensor:
        return x + ff(rms_norm(x, w, 1e-5)) + unit_offset_rms_norm(x, w, 1e-5)

    x = leaf(2, 12, 32, scale=2.0)
    ref = block(x)
    ref_grads = grads(ref, (x, w, ff.w1.weight))
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    for a, b in zip(grads(out, (x, w, ff.w1.weight)), ref_grads):
        close(a, b, torch.float32)
    out = checkpoint(block, x, use_reentrant=False)
    assert torch.equal(out, ref)
    for a, b in zip(grads(out, (x, w, ff.w1.weight)), ref_grads):
        assert torch.equal(a, b)
    with torch.device("meta"):
        model = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=50, max_seq_len=16,
                                      qk_norm=True))
        model(torch.zeros(2, 8, dtype=torch.long)).sum().backward()
    assert all(p.grad is not None and p.grad.is_meta for p in model.parameters())


def test_unknown_activation_names_the_known_ones():
    with pytest.raises(KeyError, match="silu, gelu_tanh"):
        gated_activation(torch.ones(2), torch.ones(2), "relu")
