"""Hugging Face ``config.json`` <-> ``ModelArgs``, through the family's :class:`~lmforge.models.spec.ModelSpec`.

The file's ``model_type`` selects the spec; the spec reads the rest (its defaults for missing keys,
the settings it refuses, the switches it sets) and writes it back. Every refusal is one line
naming the file and the key. The Llama-shaped families share their mapping
(:mod:`lmforge.models.common.llama_style`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from lmforge.models.args import ModelArgs
from lmforge.models.spec import spec_for_args, spec_for_hf_config

__all__ = ["args_from_hf_config", "check_exportable", "hf_config_from_args"]


def args_from_hf_config(cfg: Mapping[str, Any], where: str | Path) -> ModelArgs:
    """``ModelArgs`` for a parsed ``config.json``; ``where`` names the file in error messages."""
    where = str(where)
    return spec_for_hf_config(cfg, where).args_from_hf(cfg, where)


def check_exportable(args: ModelArgs) -> None:
    """UserError unless ``args`` is exactly what its ``hf_model_type`` can express."""
    spec_for_args(args).check_exportable(args)


def hf_config_from_args(
    args: ModelArgs, *, torch_dtype: str, bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
) -> dict[str, Any]:
    """The ``config.json`` transformers needs to build ``args``' family with the same shapes."""
    return spec_for_args(args).hf_config(args, torch_dtype=torch_dtype, bos_token_id=bos_token_id,
                                         eos_token_id=eos_token_id, pad_token_id=pad_token_id)
