"""gpt-oss's :class:`~lmforge.models.spec.ModelSpec`, registered on import (the package imports it)."""

from __future__ import annotations

from torch import nn

from lmforge.models.args import ModelArgs
from lmforge.models.gpt_oss.args import GPT_OSS_SIZES, GptOssArgs
from lmforge.models.gpt_oss.config_json import ARCHITECTURE, MODEL_TYPE, args_from_hf, check_exportable, hf_config
from lmforge.models.gpt_oss.state_dict import GPT_OSS_LAYOUT
from lmforge.models.spec import ModelSpec, register_spec

__all__ = ["GPT_OSS"]


def build(args: ModelArgs) -> nn.Module:
    """The shared decoder, built from ``GptOssArgs.decoder_config()``."""
    from lmforge.models.model import Transformer

    return Transformer(args)


GPT_OSS = register_spec(ModelSpec(
    name=MODEL_TYPE, hf_model_type=MODEL_TYPE, hf_architecture=ARCHITECTURE, args_from_hf=args_from_hf,
    hf_config=hf_config, check_exportable=check_exportable, state_dict_adapter=GPT_OSS_LAYOUT, build=build,
    fused_decode=False,  # the fused decode step has a dense MLP only
    args_class=GptOssArgs, sizes=GPT_OSS_SIZES,
))
