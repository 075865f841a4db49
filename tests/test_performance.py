"""Speed options keep the math unchanged, and the benchmark compares like with like."""

import sys
from pathlib import Path

import pytest
import torch

from lmforge.models.model import Transformer, model_args_for
from lmforge.parallel.plans import apply_activation_checkpointing

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _loss_and_grads(model: Transformer, tokens: torch.Tensor):
    model.zero_grad(set_to_none=True)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
                           for n, p in model.named_parameters()}


def test_activation_checkpointing_gives_identical_gradients():
    args = model_args_for("debug", 320, n_layers=2, dim=64)
    plain = Transformer(args)
    plain.init_weights(seed=0)
    wrapped = Transformer(args)
    wrapped.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(wrapped)
    assert all("checkpoint" in type(b).__name__.lower() for b in wrapped.layers)
    tokens = torch.randint(0, 320, (2, 33), generator=torch.Generator().manual_seed(0))
    loss_a, grads_a = _loss_and_grads(plain, tokens)
    loss_b, grads_b = _loss_and_grads(wrapped, tokens)
    torch.testing.assert_close(loss_a, loss_b, rtol=0, atol=0)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-6, atol=1e-7, msg=name)


def test_benchmark_hf_model_is_the_same_network():
    """The HF baseline of bench/throughput.py has lmforge's parameter count and, given the
    converted weights, lmforge's logits: the comparison is like for like."""
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    from lmforge.models.hf import hf_state_dict_from_lmforge

    sys.path.insert(0, str(BENCH))
    try:
        from throughput import hf_config
    finally:
        sys.path.remove(str(BENCH))
    args = model_args_for("debug", 320, n_layers=2)
    ours = Transformer(args)
    ours.init_weights(seed=0)
    theirs = LlamaForCausalLM(hf_config(args))
    assert sum(p.numel() for p in theirs.parameters()) == ours.num_params()
    theirs.load_state_dict(hf_state_dict_from_lmforge(ours.state_dict(), args))
    tokens = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours(tokens), rtol=1e-4, atol=1e-4)
