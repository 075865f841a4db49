"""FLOP accounting against a hand count and against PyTorch's own FLOP counter."""

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lmforge.models.flops import flops_per_token, matmul_params, measure_matmul_peak, peak_flops_per_device
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


def test_measured_peak_is_best_over_shapes():
    small = measure_matmul_peak("cpu", torch.float32, shapes=[(64, 64, 64)], iters=3)
    both = measure_matmul_peak("cpu", torch.float32, shapes=[(64, 64, 64), (256, 256, 256)], iters=3)
    assert small > 0 and both > 0
    peak, source = peak_flops_per_device("cpu", torch.float32, configured=123e12)
    assert (peak, source) == (123e12, "configured")
    peak, source = peak_flops_per_device("cpu", torch.float32)
    assert peak > 1e9 and "measured" in source
