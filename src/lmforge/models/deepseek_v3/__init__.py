"""DeepSeek-V3 (``model_type`` ``deepseek_v3``; Kimi-K2 is the same architecture): the family folder.

- :mod:`.args`: :class:`DeepseekV3Args` (its hyper-parameters, ``decoder_config()`` with latent attention
  and the grouped sigmoid router with shared experts) and the named sizes ``deepseek-v3-671b``, ``kimi-k2``;
- :mod:`.hf_config`: ``config.json`` both ways, with transformers' defaults and one-line refusals;
- :mod:`.layout`: the checkpoint tensor names.

Its own module, multi-head latent attention, is a shared layer
(:mod:`lmforge.models.layers.latent_attention`), as is the router (:mod:`lmforge.models.layers.moe`).
Importing this package registers the family's :class:`~lmforge.models.spec.ModelSpec`.
"""

from __future__ import annotations

from lmforge.models.deepseek_v3 import hf_config as _hf
from lmforge.models.deepseek_v3.args import DEEPSEEK_V3_SIZES, DeepseekV3Args
from lmforge.models.deepseek_v3.layout import DEEPSEEK_V3_LAYOUT
from lmforge.models.model import Transformer

__all__ = ["DEEPSEEK_V3", "DEEPSEEK_V3_LAYOUT", "DEEPSEEK_V3_SIZES", "DeepseekV3Args", "LORA_TARGETS"]

LORA_TARGETS = {
    "wq": "attention.wq", "wq_a": "attention.wq_a", "wq_b": "attention.wq_b", "wkv_a": "attention.wkv_a",
    "wkv_b": "attention.wkv_b", "wo": "attention.wo",
    "w1": "feed_forward.w1", "w2": "feed_forward.w2", "w3": "feed_forward.w3",
}
"""Latent attention's projections (``wq`` without a query bottleneck, ``wq_a``/``wq_b`` with one) and the
MLP's; in MoE layers the MLP names reach the stacked experts and the shared experts' MLP."""


def _balance(model, args, totals) -> None:  # type: ignore[no-untyped-def]
    """Auxiliary-loss-free balancing after each optimizer step: every router's correction bias moves by
    ``bias_update_speed`` against its experts' load in the step (all microbatches and ranks). Routers that do
    not train (LoRA: the base is frozen, and its checkpoints keep only the adapters) keep their biases."""
    from lmforge.models.layers.moe import Router, balance_correction_bias

    load = totals.get("router_expert_tokens")
    training = any(m.weight.requires_grad for m in model.modules() if isinstance(m, Router))
    if load is not None and args.bias_update_speed and training:
        balance_correction_bias(model, load, args.bias_update_speed)


def _register():  # type: ignore[no-untyped-def]
    from lmforge.models.spec import ModelSpec, register_spec

    return register_spec(ModelSpec(
        name=_hf.MODEL_TYPE, hf_model_type=_hf.MODEL_TYPE, hf_architecture=_hf.ARCHITECTURE,
        args_from_hf=_hf.args_from_hf, hf_config=_hf.hf_config, check_exportable=_hf.check_exportable,
        state_dict_adapter=DEEPSEEK_V3_LAYOUT, build=Transformer, fused_decode=False,
        lora_targets=LORA_TARGETS,
        after_optimizer_step=_balance, args_class=DeepseekV3Args, sizes=DEEPSEEK_V3_SIZES,
    ))


DEEPSEEK_V3 = _register()
