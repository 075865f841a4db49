"""Whether a model and a config can take a layout: one line naming the key when they cannot, checked
before anything is written (an impossible degree must never surface as a shape error in a collective)."""

from __future__ import annotations

from typing import Any

from lmforge.models.args import ModelArgs
from lmforge.parallel.dims import ParallelDims


def check_layout(dims: ParallelDims, args: ModelArgs, cfg: Any) -> None:
    """Every model-splitting degree against the model's shape and the data's sequence length."""
    if dims.cp > 1:
        from lmforge.parallel.context_parallel import check_cp

        check_cp(cfg.data.seq_len, dims.cp)
