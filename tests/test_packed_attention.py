"""Packed attention (per-document SDPA) against the dense block-diagonal mask it replaces.

The reference runs the same weights through the same layers with ``document_mask`` (and the
sliding-window band), the path lmforge used before; ``test_model.py`` and ``test_families.py``
tie that path to separate per-document runs.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lmforge.models.layers.masks as masks_module
from lmforge.models.layers.masks import document_mask, sliding_window_mask
from lmforge.models.layers.packed_attention import PackedLayout, packed_layout
from lmforge.models.model import ModelArgs, Transformer

VOCAB = 61


def tiny(n_kv_heads: int = 2, window: int | None = None, max_seq_len: int = 96) -> Transformer:
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, vocab_size=VOCAB,
                     max_seq_len=max_seq_len, sliding_window=window)
    model = Transformer(args)
    model.init_weights(seed=0)
    return model


def packed_batch(rows: list[list[int]], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens, position_ids, document_ids [B, T] for rows given as document lengths."""
    g = torch.Generator().manual_seed(seed)
    T = sum(rows[0])
    assert all(sum(r) == T for r in rows)
    docs = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])
    pos = torch.stack([torch.cat([torch.arange(n) for n in r]) for r in rows])
    return torch.randint(0, VOCAB, (len(rows), T), generator=g), pos, docs


def dense_logits(model: Transformer, tokens: torch.Tensor, pos: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """The same layers with the dense [B, 1, T, T] mask (and band) passed to SDPA."""
    T = tokens.shape[1]
    h = model.tok_embeddings(tokens)
    cos, sin = model.rope(pos, h.dtype)
    mask = document_mask(docs)
    if model.args.sliding_window is not None:
        mask = mask & sliding_window_mask(T, model.args.sliding_window)
    for layer in model.layers:
        h = layer(h, cos, sin, mask, False)
    return model.output(model.norm(h))


def logits_and_grads(fn, model: Transformer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits = fn()
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


ROWS = {
    "several documents per row": [[5, 17, 3, 7], [9, 9, 9, 5]],
    "a row with one document": [[32], [10, 22]],
    "documents of length 1": [[1, 1, 12, 1, 17], [1] * 32],
    "padding document at the end": [[13, 11, 8], [20, 12]],  # the tail is one more document
}


@pytest.mark.parametrize("rows", ROWS.values(), ids=ROWS.keys())
@pytest.mark.parametrize("n_kv_heads,window", [(4, None), (2, None), (1, None), (2, 4), (2, 64)],
                         ids=["mha", "gqa", "mqa", "window-shorter-than-documents", "window-longer"])
def test_packed_logits_and_grads_equal_dense_mask(rows, n_kv_heads, window):
    model = tiny(n_kv_heads, window)
    tokens, pos, docs = packed_batch(rows)
    got, got_grads = logits_and_grads(lambda: model(tokens, position_ids=pos, document_ids=docs), model)
    want, want_grads = logits_and_grads(lambda: dense_logits(model, tokens, pos, docs), model)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=1e-5, rtol=1e-5, msg=name)


def test_window_longer_than_sequence_equals_plain_causal():
    """A window inside every document is the causal mask: both paths agree with no window."""
    tokens, pos, docs = packed_batch([[6, 20, 6]], seed=2)
    with torch.no_grad():
        windowed = tiny(window=8)(tokens, position_ids=pos, document_ids=docs)
        plain = tiny()(tokens, position_ids=pos, document_ids=docs)
    assert (windowed - plain).abs().max() > 1e-4  # the 20-token document is cut by the window
    with torch.no_grad():
        wide = tiny(window=20)(tokens, position_ids=pos, document_ids=docs)
    torch.testing.assert_close(wide, plain, atol=1e-6, rtol=1e-6)


def test_packed_rows_equal_separate_documents_with_gqa_and_window():
    model = tiny(n_kv_heads=1, window=5)
    model.eval()
    lengths = [7, 1, 12, 4]
    tokens, pos, docs = packed_batch([lengths], seed=3)
    with torch.no_grad():
        packed = model(tokens, position_ids=pos, document_ids=docs)
        at = 0
        for n in lengths:
            alone = model(tokens[:, at: at + n])
            torch.testing.assert_close(packed[:, at: at + n], alone, atol=1e-5, rtol=1e-5)
            at += n


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_packed_batch_allocates_no_sequence_squared_tensor(monkeypatch):
    T, doc = 512, 32
    model = tiny(max_seq_len=T)
    tokens, pos, docs = packed_batch([[doc] * (T // doc)], seed=4)

    def refuse(*_a, **_k):
        raise AssertionError("document_mask called for a packed batch")

    monkeypatch.setattr(masks_module, "document_mask", refuse)
    seen = []
    hook = model.layers[0].attention.register_forward_pre_hook(lambda _m, a: seen.append(a[3]))
    with LargestTensor() as probe:
        model(tokens, position_ids=pos, document_ids=docs).sum().backward()
    hook.remove()
    assert isinstance(seen[0], PackedLayout)
    # Activations are T x vocab; scores per document group are n_docs x heads x doc^2 (< T^2 here).
    assert probe.largest < T * T, probe.largest


def test_layout_groups_documents_by_padded_length():
    docs = torch.tensor([[0] * 3 + [1] * 9 + [2] * 4, [0] * 16])
    layout = packed_layout(docs, window=8)
    assert [(g.length, g.index.shape[0]) for g in layout.groups] == [(3, 1), (4, 1), (10, 1), (16, 1)]
    assert [g.mask is not None for g in layout.groups] == [False, False, True, True]
    rows = layout.unpack.tolist()  # every token has its own row among the 3 + 4 + 10 + 16 padded ones
    assert len(set(rows)) == 32 and max(rows) < 33


class FullSizeOutputs(TorchDispatchMode):
    """Counts the ops whose output has exactly ``numel`` elements (full-size buffers of q, k or v)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() == self.numel and func._schema.name.startswith(
                    ("aten::zeros", "aten::new_zeros", "aten::fill_", "aten::zero_")):
                self.count += 1
        return out


@pytest.mark.parametrize("lengths", [[30, 34], [3, 5, 7, 9, 11, 13, 16]])
def test_the_backward_zero_fills_each_input_once_whatever_the_number_of_length_groups(lengths):
    """One gather for all length groups: the gradients of q, k and v are each one zero-filled buffer
    scattered into once. Gathering group by group zero-filled a full-size buffer per group and input."""
    from lmforge.models.layers.packed_attention import attend_packed

    B, H, D = 2, 4, 8
    T = sum(lengths)
    _, _, docs = packed_batch([lengths, lengths[::-1]])
    layout = packed_layout(docs)
    assert len(layout.groups) >= 2
    q, k, v = (torch.randn(B, H, T, D, requires_grad=True) for _ in range(3))
    out = attend_packed(q, k, v, layout, enable_gqa=False)
    with FullSizeOutputs(B * T * H * D) as counter:
        out.sum().backward()
    assert counter.count == 3, (counter.count, len(layout.groups))
