"""MXFP4 expert weights, as published gpt-oss checkpoints store them, dequantized on load.

MXFP4 (OCP Microscaling, FP4 E2M1 elements with one shared E8M0 scale per block of 32): a weight of
``[..., rows, cols]`` is stored as

- ``<name>_blocks`` uint8 ``[..., rows, cols / 32, 16]``: 32 FP4 values per block, two per byte, the
  element at the even column in the low nibble and the next one in the high nibble; a nibble is
  sign (bit 3), a 2-bit exponent and a 1-bit mantissa, i.e. one of
  ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` and their negatives;
- ``<name>_scales`` uint8 ``[..., rows, cols / 32]``: the block's power of two, biased by 127.

So ``w[..., r, 32 b + j] = fp4(nibble j of block b of row r) * 2 ** (scales[..., r, b] - 127)``. Every such
value is exact in bf16 and fp32 (at most two significant bits), so dequantizing loses nothing.

gpt-oss's checkpoints store the experts in the ``[E, out, in]`` orientation (``gate_up_proj_blocks``
``[E, 2 hidden, dim / 32, 16]``, ``down_proj_blocks`` ``[E, dim, hidden / 32, 16]``), the transpose of
transformers' ``GptOssExperts`` parameters (``gate_up_proj`` ``[E, dim, 2 hidden]``); the read hook
returns transformers' orientation, so the family's tensor layout then applies unchanged.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from lmforge.errors import UserError

__all__ = ["FP4_VALUES", "dequantize_mxfp4", "dequantize_mxfp4_state"]

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""FP4 E2M1 by its 4-bit code."""


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.bfloat16,
                     rows_per_chunk: int = 1 << 16) -> Tensor:
    """``[..., rows, cols]`` in ``dtype`` from ``blocks`` uint8 ``[..., rows, cols / 32, 16]`` and ``scales``
    uint8 ``[..., rows, cols / 32]`` (see the module's docstring). Works through ``rows_per_chunk`` rows at a
    time, so the temporaries stay small beside the output."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise UserError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise UserError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)} "
                        "(blocks need [..., groups, 16] beside scales [..., groups])")
    *lead, groups, nbytes = blocks.shape
    flat_blocks = blocks.reshape(-1, groups, nbytes)
    flat_scales = scales.reshape(-1, groups)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    out = torch.empty(flat_blocks.shape[0], groups, 2 * nbytes, dtype=dtype, device=blocks.device)
    for r0 in range(0, flat_blocks.shape[0], rows_per_chunk):
        b = flat_blocks[r0:r0 + rows_per_chunk]
        values = torch.stack([lut[(b & 0x0F).long()], lut[(b >> 4).long()]], dim=-1).flatten(-2)  # [r, groups, 32]
        exponent = flat_scales[r0:r0 + rows_per_chunk].to(torch.int32) - 127
        out[r0:r0 + rows_per_chunk] = torch.ldexp(values, exponent.unsqueeze(-1).float()).to(dtype)
    return out.reshape(*lead, groups * 2 * nbytes)


def dequantize_mxfp4_state(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A gpt-oss state dict with every ``<name>_blocks`` / ``<name>_scales`` pair replaced by ``<name>``: the
    dequantized ``[E, out, in]`` weight transposed to transformers' ``[E, in, out]`` (a view), in the dtype of
    the sibling ``<name>_bias`` (bf16 without one). Other tensors pass through; a state dict without MXFP4
    tensors is returned as it is."""
    if not any(k.endswith("_blocks") for k in state):
        return dict(state)
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        if name.endswith("_scales") and name.removesuffix("_scales") + "_blocks" in state:
            continue
        if not name.endswith("_blocks"):
            out[name] = t
            continue
        base = name.removesuffix("_blocks")
        scales = state.get(base + "_scales")
        if scales is None:
            raise UserError(f"MXFP4 tensor {name} has no {base}_scales beside it")
        bias = state.get(base + "_bias")
        dtype = bias.dtype if bias is not None and bias.is_floating_point() else torch.bfloat16
        out[base] = dequantize_mxfp4(t, scales, dtype).transpose(-1, -2)
    return out
