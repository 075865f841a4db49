"""The key/value cache that generation fills and the model's attention reads.

Kept apart from both the model (which only reads it) and :mod:`lmforge.models.generate` (which
creates it), so neither imports the other.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lmforge.errors import UserError


class KVCache:
    """Per-layer key/value buffers ``[B, n_kv_heads, max_len, head_dim]``.

    Cache slots are columns of the (left-padded) batch, shared by all rows: a forward of
    ``T`` tokens writes slots ``[pos, pos + T)`` and then advances ``pos``. The RoPE
    position of each token is whatever ``position_ids`` the caller passes, which lets
    left-padded rows count positions from their own first real token.

    ``valid`` ([B, max_len] bool, optional) marks slots that hold real tokens; padded
    slots are never attended to. ``None`` means no padding, which keeps a mask-free path.

    A sliding ``window`` (``attn_mask``'s argument: each layer's own, Gemma 3 mixes them) limits
    each query to its own slot and the ``window - 1`` slots before it. Within a row real tokens
    occupy consecutive slots, so slot distance is position distance and the band is the model's
    sliding window even for left-padded rows.
    """

    def __init__(
        self, n_layers: int, batch_size: int, n_kv_heads: int, max_len: int, head_dim: int, *,
        device: torch.device | str, dtype: torch.dtype, valid: Tensor | None = None,
    ) -> None:
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.max_len = max_len
        self.pos = 0
        if valid is not None:
            full = torch.ones(batch_size, max_len, dtype=torch.bool, device=device)
            full[:, : valid.shape[1]] = valid.to(device=device, dtype=torch.bool)
            valid = full
        self.valid = valid
        # Additive form of `valid` for decode steps: SDPA would otherwise convert the
        # bool mask to a float one in every layer of every step.
        self.bias = None if valid is None else torch.zeros(valid.shape, device=device, dtype=dtype).masked_fill_(
            ~valid, float("-inf")
        )

    @classmethod
    def for_model(cls, model: nn.Module, batch_size: int, max_len: int, valid: Tensor | None = None) -> KVCache:
        """A cache for ``model`` (a ``Transformer``: its ``args`` give the layers, heads and head size)."""
        a = model.args
        w = model.tok_embeddings.weight
        return cls(a.n_layers, batch_size, a.kv_heads, max_len, a.head_dim, device=w.device, dtype=w.dtype, valid=valid)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store new k/v [B, kv, T, hd] at the current slots; return all keys/values so far."""
        end = self.pos + k.shape[2]
        self.k[layer][:, :, self.pos:end] = k
        self.v[layer][:, :, self.pos:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def attn_mask(self, T: int, window: int | None) -> Tensor | None:
        """Bool mask [B|1, 1, T, pos+T] for the next ``T`` queries, or None if plain causal works.

        ``window``: the attending layer's sliding window (None: full attention).

        A query always sees its own slot, even when it is padding: a fully masked row would
        give NaN, which would then leak into later layers through the padded keys/values.
        """
        start, end = self.pos, self.pos + T
        if end > self.max_len:
            raise UserError(f"KV cache full: {end} tokens requested, capacity {self.max_len}")
        w = window
        banded = w is not None and end > w  # otherwise the window covers every cached slot
        if self.valid is None:
            if not banded and (T == 1 or start == 0):
                return None  # decode step attends everything; prefill from 0 is plain causal
            q = torch.arange(start, end, device=self.k[0].device).unsqueeze(1)
            return self._causal(q, end, w)[None, None]
        if T == 1 and not banded:
            return self.bias[:, None, None, :end]
        q = torch.arange(start, end, device=self.valid.device).unsqueeze(1)
        j = torch.arange(end, device=q.device).unsqueeze(0)
        return (self.valid[:, None, None, :end] & self._causal(q, end, w)) | (j == q)

    @staticmethod
    def _causal(q: Tensor, end: int, window: int | None) -> Tensor:
        """[T, end] bool: query slot q sees slot j iff j <= q (and within the sliding window)."""
        j = torch.arange(end, device=q.device).unsqueeze(0)
        allowed = j <= q
        if window is not None:
            allowed = allowed & (j > q - window)
        return allowed

    def advance(self, T: int) -> None:
        self.pos += T

    def select_rows(self, index: Tensor) -> None:
        """Keep rows ``index`` [B'] (repeats allowed): e.g. one prefilled prompt shared by several rows."""
        self.k = [k.index_select(0, index) for k in self.k]
        self.v = [v.index_select(0, index) for v in self.v]
        if self.valid is not None and self.bias is not None:
            self.valid = self.valid.index_select(0, index)
            self.bias = self.bias.index_select(0, index)
