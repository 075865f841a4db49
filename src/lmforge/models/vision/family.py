"""How a vision-language family folder registers its spec: every such family's ``ModelSpec`` is its
``hf_config`` module's three functions, its tensor names, its model class and argument class, the
parameter groups a recipe can freeze, and the tower's FLOPs; none has a fused decode step."""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Mapping

from lmforge.models.state_dict_adapter import StateDictAdapter

__all__ = ["register_vision_family"]


def register_vision_family(hf: ModuleType, layout: StateDictAdapter, build: Callable[..., Any], args_class: type,
                           parameter_groups: Mapping[str, tuple[str, ...]], image_flops: Callable[..., float],
                           sizes: Mapping[str, dict[str, Any]] | None = None) -> Any:
    """Register the family whose ``hf`` module has ``MODEL_TYPE``, ``ARCHITECTURE``, ``args_from_hf``,
    ``hf_config`` and ``check_exportable``; ``image_flops(args, grid, n_images, training)``."""
    from lmforge.models.spec import ModelSpec, register_spec

    return register_spec(ModelSpec(
        name=hf.MODEL_TYPE, hf_model_type=hf.MODEL_TYPE, hf_architecture=hf.ARCHITECTURE,
        args_from_hf=hf.args_from_hf, hf_config=hf.hf_config, check_exportable=hf.check_exportable,
        state_dict_adapter=layout, build=build, fused_decode=False, args_class=args_class,
        parameter_groups=dict(parameter_groups), image_flops=image_flops, sizes=dict(sizes or {}),
    ))
