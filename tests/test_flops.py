"""FLOP accounting against a hand count and against PyTorch's own FLOP counter."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lmforge.models.flops import flops_per_token, matmul_params
from lmforge.runtime.precision import measure_matmul_peak, peak_flops_per_device
from lmforge.models.model import Transformer, model_args_for


def test_debug_model_flops_by_hand():
    # debug: dim 128, 4 layers, 4 heads (head_dim 32), 2 kv heads, SwiGLU hidden 384, vocab 320.
    args = model_args_for("debug", 320)
    per_layer = 128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 384  # q, k+v, o, w1+w2+w3
    assert matmul_params(args) == 4 * per_layer + 128 * 320  # + the output head
    # attention: QK^T and AV are 2*T*d each per query forward, x3 for training, causal half.
    assert flops_per_token(args, 256) == 6 * (4 * per_layer + 128 * 320) + 6 * 4 * 256 * 128


def test_flops_per_token_matches_torch_flop_counter():
    """Forward + backward counted by FlopCounterMode with the math attention backend.

    Weight matmuls must match 6N exactly; the math backend computes the full T x T score
    matrix, so its attention FLOPs are exactly twice the causal half lmforge counts.
    """
    torch.manual_seed(0)
    args = model_args_for("debug", 320, n_layers=2)
    model = Transformer(args)
    B, T = 2, 64
    tokens = torch.randint(0, args.vocab_size, (B, T))
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        model(tokens).float().sum().backward()
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    weights = counts.pop("aten.mm")
    attention = counts.pop("aten.bmm")
    assert not counts, f"unexpected FLOP-counted ops: {counts}"
    assert weights == 6 * matmul_params(args) * B * T
    ours_attention = (flops_per_token(args, T) - 6 * matmul_params(args)) * B * T
    assert attention == 2 * ours_attention


class _ScriptedMatmuls:
    """``torch`` for ``lmforge.runtime.precision``, except that a matmul computes nothing and takes the next
    of its shape's scripted seconds on a fake clock (the module's ``time``): the timing is exact."""

    def __init__(self, seconds: dict[tuple[int, int, int], list[float]]) -> None:
        self.seconds = {shape: list(s) for shape, s in seconds.items()}
        self.calls = {shape: 0 for shape in seconds}
        self.now = 0.0

    def __getattr__(self, name):
        return getattr(torch, name)

    def matmul(self, a, b):
        shape = (a.shape[0], a.shape[1], b.shape[1])
        self.now += self.seconds[shape][self.calls[shape]]
        self.calls[shape] += 1

    def perf_counter(self) -> float:
        return self.now


def test_measured_peak_is_best_over_shapes(monkeypatch):
    """The peak over several shapes is the best single timed call of any of them, in FLOP/s (not the
    shortest call): warm-up calls and calls after a shape's time budget is spent do not count."""
    from lmforge.runtime import precision

    warmup = [1e-9, 1e-9]  # either would be the best call by far, were warm-ups timed
    seconds = {  # iters=4, budget 10 us per shape
        (64, 64, 64): warmup + [4e-6, 2e-6, 3e-6, 3e-6],  # the shortest call; all 4 timed (the 4th ends at 12 us)
        (128, 32, 256): warmup + [5e-6, 4e-6, 6e-6, 1e-8],  # the best FLOP/s; budget spent after 3 calls
        (32, 256, 32): warmup + [11e-6, 1e-9],  # budget spent after 1 call
    }
    calls = {(64, 64, 64): 6, (128, 32, 256): 5, (32, 256, 32): 3}  # warm-ups + timed calls
    flop = {shape: 2.0 * shape[0] * shape[1] * shape[2] for shape in seconds}

    def measure(*shapes):
        fake = _ScriptedMatmuls(seconds)
        monkeypatch.setattr(precision, "torch", fake)
        monkeypatch.setattr(precision, "time", fake)
        peak = measure_matmul_peak("cpu", torch.float32, shapes=list(shapes), iters=4, budget_s=10e-6)
        assert fake.calls == {shape: calls[shape] if shape in shapes else 0 for shape in seconds}
        return peak

    a, b, c = seconds
    per_shape = {shape: measure(shape) for shape in seconds}
    assert per_shape[a] == pytest.approx(flop[a] / 2e-6, rel=1e-9)
    assert per_shape[b] == pytest.approx(flop[b] / 4e-6, rel=1e-9)
    assert per_shape[c] == pytest.approx(flop[c] / 11e-6, rel=1e-9)
    best = max(per_shape.values())
    assert best == per_shape[b] > per_shape[a]  # not the shape of the shortest call
    assert measure(a, b, c) == best and measure(c, b, a) == best and measure(a, c) == per_shape[a]
    monkeypatch.undo()
    peak, source = peak_flops_per_device("cpu", torch.float32, configured=123e12)
    assert (peak, source) == (123e12, "configured")
    peak, source = peak_flops_per_device("cpu", torch.float32)
    assert peak > 1e9 and "measured" in source
