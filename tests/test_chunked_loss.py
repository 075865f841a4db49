"""Chunked cross-entropy and GRPO log-probs equal the full-logits computation, and never hold more
than one chunk of logits."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lmforge.config import TrainingSection
from lmforge.data.packing import IGNORE_INDEX, Batch
from lmforge.models.model import ModelArgs, Transformer
from lmforge.objectives.grpo import GRPOLoss, PolicyBatch, token_logprobs
from lmforge.losses.chunked_loss import DEFAULT_CHUNK_TOKENS, TargetLogprobHead, TargetLogprobs
from lmforge.objectives.next_token import cross_entropy_loss
from lmforge.losses.stats import LossStats

V = 97  # a prime: no chunk size divides it, and it is told apart from every other dimension
ARGS = ModelArgs(dim=24, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=V, max_seq_len=32)
B, T = 3, 11  # 33 tokens


def _model(tie: bool = False, seed: int = 0) -> Transformer:
    model = Transformer(ModelArgs(**{**ARGS.__dict__, "tie_embeddings": tie}))
    model.init_weights(seed=seed)
    with torch.no_grad():  # larger logits than the init gives, so the softmax is far from uniform
        model.output.weight.mul_(20)
    return model


def _batch(masked: bool, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T + 1), generator=g)
    labels = ids[:, 1:].clone()
    if masked:  # SFT-like: each row's prompt carries no loss, one row none at all
        for i, prompt in enumerate((4, 8, T)):
            labels[i, :prompt] = IGNORE_INDEX
    return Batch(input_ids=ids[:, :-1], labels=labels)


def _with_hits(model: Transformer, batch: Batch) -> Batch:
    """Every third target replaced by the model's own argmax, so the hit count is not trivially 0."""
    with torch.no_grad():
        best = model(batch.input_ids).argmax(-1)
    pick = (torch.arange(B * T).view(B, T) % 3 == 0) & (batch.labels != IGNORE_INDEX)
    batch.labels[pick] = best[pick]
    return batch


def _full_cross_entropy(model: Transformer, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss as computed before chunking: all logits, upcast to fp32, one F.cross_entropy."""
    logits = model(batch.input_ids).float().flatten(0, 1)
    labels = batch.labels.flatten()
    loss_sum = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    mask = labels != IGNORE_INDEX
    correct = ((logits.argmax(-1) == labels) & mask).sum()
    return loss_sum, LossStats(loss_sum.detach(), mask.sum(), mask.sum(), {"correct": correct})


def _loss_and_grads(model, loss_fn, batch):
    model.zero_grad(set_to_none=True)
    loss, stats = loss_fn(model, batch)
    loss.backward()
    # names as in the bare Transformer, whatever wraps it (torch.compile'd blocks, a test wrapper)
    return stats, {n.replace("_orig_mod.", "").removeprefix("model."): p.grad.clone()
                   for n, p in model.named_parameters()}


def _assert_grad_close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """Equal up to float rounding: the largest difference within 1e-6 of the gradient's own scale
    (summing chunk by chunk reorders the additions of one big matmul)."""
    err, scale = float((got - want).abs().max()), float(want.abs().max())
    assert err <= 1e-6 * scale, f"{name}: max difference {err:.3g} at scale {scale:.3g}"


def _assert_same(got, want):
    (stats, grads), (ref_stats, ref_grads) = got, want
    torch.testing.assert_close(stats.loss_sum, ref_stats.loss_sum, rtol=1e-6, atol=0)
    assert int(stats.target_tokens) == int(ref_stats.target_tokens) == int(stats.loss_weight)
    assert int(stats.sums["correct"]) == int(ref_stats.sums["correct"])
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        _assert_grad_close(grads[name], ref_grads[name], name)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("tie", [False, True])
def test_chunked_cross_entropy_equals_full_logits(masked, tie):
    """Loss sum, target count, argmax hits and every parameter's gradient, for chunk sizes that divide
    the target count, do not, are 1, and exceed the whole batch."""
    model = _model(tie)
    batch = _with_hits(model, _batch(masked))
    want = _loss_and_grads(model, _full_cross_entropy, batch)
    assert int(want[0].sums["correct"]) > 0  # the hit count is really compared
    targets = int(want[0].target_tokens)
    for chunk in (1, 4, 7, targets, 1000):
        got = _loss_and_grads(model, lambda m, b: cross_entropy_loss(m, b, chunk_tokens=chunk), batch)
        _assert_same(got, want)


def test_no_target_tokens_gives_zero_loss_and_zero_gradients():
    model, batch = _model(), _batch(masked=True)
    batch.labels[:] = IGNORE_INDEX
    stats, grads = _loss_and_grads(model, cross_entropy_loss, batch)
    assert float(stats.loss_sum) == 0 and int(stats.target_tokens) == 0 and int(stats.sums["correct"]) == 0
    assert all(float(g.abs().sum()) == 0 for g in grads.values())  # every parameter got a (zero) gradient


def test_bfloat16_autocast_stays_close_to_full_logits():
    """Under autocast the output matmul runs in bf16 as nn.Linear's does; only rounding differs."""
    model, batch = _model(), _batch(masked=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_loss, _ = _full_cross_entropy(model, batch)
        got_loss, _ = cross_entropy_loss(model, batch, chunk_tokens=5)
    torch.testing.assert_close(got_loss, want_loss, rtol=2e-2, atol=0)


class _LogitsSizes(TorchDispatchMode):
    """Records the rows of every newly computed tensor whose last dimension is the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if (isinstance(t, torch.Tensor) and t.ndim >= 2 and t.shape[-1] == V
                    and t.untyped_storage().data_ptr() not in inputs):  # views (e.g. weight.t()) are not new
                self.rows.append(t.numel() // V)
        return out


def test_no_more_than_one_chunk_of_logits_exists_at_once():
    """In forward and backward, no tensor of logits (or their gradient) spans more than one chunk; the
    same recorder sees the full [B*T, V] logits of the unchunked loss."""
    model, batch = _model(), _batch(masked=False)
    with _LogitsSizes() as full:
        _full_cross_entropy(model, batch)[0].backward()
    assert max(full.rows) == B * T
    with _LogitsSizes() as chunked:
        cross_entropy_loss(model, batch, chunk_tokens=5)[0].backward()
    assert chunked.rows and max(chunked.rows) <= 5


def test_only_target_positions_are_projected():
    model, batch = _model(), _batch(masked=True)
    with _LogitsSizes() as seen:
        cross_entropy_loss(model, batch, chunk_tokens=1000)[0].backward()
    assert set(seen.rows) == {int((batch.labels != IGNORE_INDEX).sum())}


def test_loss_chunk_tokens_default_is_the_library_default():
    assert TrainingSection().loss_chunk_tokens == DEFAULT_CHUNK_TOKENS


def test_compiled_blocks_give_the_same_loss_and_gradients():
    """As ``training.compile`` does: compiled transformer blocks, the chunked loss outside them (the
    ``aot_eager`` backend: the graphs dynamo captures and autograd's traced backward, without codegen).
    The check runs in a fresh dynamo cache, so the count is this test's own."""
    model, batch = _model(), _batch(masked=True)
    want = _loss_and_grads(model, _full_cross_entropy, batch)
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()  # graphs cached by another test would not reach this counter
    compiled = copy.deepcopy(model)
    counter = CompileCounterWithBackend("aot_eager")  # no C++ build: quick, and no toolchain to be missing
    for i, block in enumerate(compiled.layers):
        compiled.layers[i] = torch.compile(block, backend=counter)
    # any exception here is a failure of lmforge's blocks under torch.compile, never a skip
    got = _loss_and_grads(compiled, lambda m, b: cross_entropy_loss(m, b, chunk_tokens=7), batch)
    _assert_same(got, want)
    # it did compile, into one graph that every layer reuses: a block that breaks the graph (or fails
    # under tracing and falls back to eager piece by piece) shows as more graphs
    assert counter.frame_count == 1 and counter.op_count > 0, (counter.frame_count, counter.op_count)


# ---------------------------------------------------------------- GRPO
def _policy_batch(seed: int = 1) -> PolicyBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.zeros(B, T)
    mask[0, 3:9] = 1
    mask[1, 5:] = 1
    mask[2, 2:4] = 1
    adv = torch.tensor([1.0, -0.5, 2.0])
    return PolicyBatch(ids, targets, mask, adv)


class _FullLogits(torch.nn.Module):
    """The model with every head swapped for the computation before chunking: all [B, T, V] logits
    at once, log-softmax in fp32, then the head's positions picked out."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, head: TargetLogprobHead):
        def full(hidden, weight):
            logp_all = F.log_softmax(F.linear(hidden, weight).float() / head.temperature, dim=-1)
            logp = logp_all.gather(-1, head.targets.unsqueeze(-1)).squeeze(-1)
            entropy = -(logp_all.exp() * logp_all).sum(-1).detach()
            hits = logp_all.argmax(-1) == head.targets
            pos = head.mask.flatten().nonzero().squeeze(1)
            return TargetLogprobs(*(t.flatten()[pos] for t in (logp, hits, entropy)), pos)
        return self.model(input_ids, head=full)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_grpo_logprobs_entropy_and_gradients_equal_full_logits(temperature):
    """Old/reference log-probs (no grad), and the policy loss's statistics (entropy, KL, clip counts)
    and gradients, at chunk sizes that split the 14 completion tokens evenly, unevenly, and not at all."""
    model, batch = _model(), _policy_batch()
    on = batch.mask > 0
    want = token_logprobs(_FullLogits(model), batch, temperature)
    g = torch.Generator().manual_seed(5)
    batch.old_logprobs = (want + 0.3 * torch.randn(B, T, generator=g)) * batch.mask
    batch.ref_logprobs = (want + 0.2 * torch.randn(B, T, generator=g)) * batch.mask
    full_logits = F.log_softmax(model(batch.input_ids).float() / temperature, dim=-1)  # independent of heads
    torch.testing.assert_close(want[on], full_logits.gather(-1, batch.targets[..., None])[..., 0][on])
    loss_fn = GRPOLoss(eps_low=0.2, eps_high=0.28, beta=0.05, aggregation="grpo", max_new_tokens=8,
                       temperature=temperature)
    want_stats, want_grads = _loss_and_grads(_FullLogits(model), loss_fn, batch)
    assert float(want_stats.sums["clip_low_count"] + want_stats.sums["clip_high_count"]) > 0
    for chunk in (4, 7, 1000):
        got = token_logprobs(model, batch, temperature, chunk_tokens=chunk)
        torch.testing.assert_close(got[on], want[on], rtol=1e-6, atol=1e-6)
        assert float(got[~on].abs().sum()) == 0
        loss_fn.chunk_tokens = chunk
        stats, grads = _loss_and_grads(model, loss_fn, batch)
        for k in want_stats.sums:
            torch.testing.assert_close(stats.sums[k], want_stats.sums[k], rtol=1e-6, atol=1e-6, msg=k)
        for k in ("loss_sum", "loss_weight", "target_tokens"):
            torch.testing.assert_close(getattr(stats, k), getattr(want_stats, k), rtol=1e-6, atol=1e-6, msg=k)
        for name in want_grads:
            _assert_grad_close(grads[name], want_grads[name], name)
