"""DeepSeek-V3 (``model_type`` ``deepseek_v3``; Kimi-K2 is the same architecture): the family folder.

- :mod:`.args`: :class:`DeepseekV3Args` (its hyper-parameters, ``decoder_config()`` with latent attention
  and the grouped sigmoid router with shared experts) and the named sizes ``deepseek-v3-671b``, ``kimi-k2``;
- :mod:`.hf_config`: ``config.json`` both ways, with transformers' defaults and one-line refusals;
- :mod:`.layout`: the checkpoint tensor names;
- :mod:`.flops`: FLOP counts for MFU.

Its own module, multi-head latent attention, is a shared layer
(:mod:`lmforge.models.layers.latent_attention`), as is the router (:mod:`lmforge.models.layers.moe`).
Importing this package registers the family's :class:`~lmforge.models.spec.ModelSpec`.
"""

from __future__ import annotations

from lmforge.models.deepseek_v3 import flops as _flops
from lmforge.models.deepseek_v3 import hf_config as _hf
from lmforge.models.deepseek_v3.args import DEEPSEEK_V3_SIZES, DeepseekV3Args, deepseek_v3_args_for
from lmforge.models.deepseek_v3.layout import DEEPSEEK_V3_LAYOUT

__all__ = ["DEEPSEEK_V3", "DEEPSEEK_V3_LAYOUT", "DEEPSEEK_V3_SIZES", "DeepseekV3Args", "deepseek_v3_args_for"]


def _build(args: DeepseekV3Args):  # type: ignore[no-untyped-def]
    """The shared decoder; its latent attention told the checkpoint's rotary layout (``rope_interleave``),
    which ``LatentAttentionConfig`` does not carry."""
    from lmforge.models.model import Transformer

    model = Transformer(args)
    for layer in model.layers:
        layer.attention.interleaved = args.rope_interleave
    return model


def _register():  # type: ignore[no-untyped-def]
    from lmforge.models.spec import ModelSpec, register_spec

    return register_spec(ModelSpec(
        name=_hf.MODEL_TYPE, hf_model_type=_hf.MODEL_TYPE, hf_architecture=_hf.ARCHITECTURE,
        args_from_hf=_hf.args_from_hf, hf_config=_hf.hf_config, check_exportable=_hf.check_exportable,
        state_dict_adapter=DEEPSEEK_V3_LAYOUT, build=_build, fused_decode=False,
        flops_per_token=_flops.flops_per_token, training_flops=_flops.training_flops, args_type=DeepseekV3Args,
        sizes=DEEPSEEK_V3_SIZES,
    ))


DEEPSEEK_V3 = _register()
