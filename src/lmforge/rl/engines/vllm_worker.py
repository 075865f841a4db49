"""The piece of lmforge that runs inside vLLM's workers: loading new policy weights in place.

vLLM imports this class by name (``worker_extension_cls``) into every worker, so
``LLM.collective_rpc("lmforge_load_weights", ...)`` reaches it; the server mode calls the same method.
It imports nothing from lmforge: only this module must be importable in vLLM's environment.
"""

from __future__ import annotations

import time


class WeightSync:
    """Mixed into vLLM's worker class: ``self.model_runner`` and ``self.vllm_config`` are the worker's."""

    def lmforge_load_weights(self, path: str) -> float:
        """Load a safetensors file of Hugging Face-named tensors into the running model; the seconds taken.

        The file is memory-mapped (``/dev/shm`` makes it a shared-memory transfer); vLLM's in-place reload
        converts each tensor to the model's dtype and re-applies its kernel-format processing (the CPU
        backend repacks linear weights, so writing into the parameters directly would not do).
        """
        from safetensors import safe_open
        from vllm.config import set_current_vllm_config

        t0 = time.perf_counter()
        model = self.model_runner.get_model()
        tied = _tied_parameters(model)
        with safe_open(path, framework="pt") as f:
            weights = ((name, f.get_tensor(name)) for name in f.keys())
            with set_current_vllm_config(self.vllm_config):
                self.model_runner.reload_weights(weights_iterator=weights)
        _retie(tied)
        return time.perf_counter() - t0


def _tied_parameters(model) -> list[list[tuple[object, str]]]:  # noqa: ANN001
    """Groups of (module, attribute) that share one parameter (a tied output layer and embedding)."""
    owners: dict[int, list[tuple[object, str]]] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((module, name))
    return [group for group in owners.values() if len(group) > 1]


def _retie(groups: list[list[tuple[object, str]]]) -> None:
    """vLLM's in-place reload loads a tied output layer's weight through the embedding but puts back the
    output layer's old kernel-format state (it received no weights of its own; on a CPU that is the
    packed GEMM weight behind ``cpu_linear``): point every member at the first one's parameter again and
    redo its kernel-format processing from it."""
    for (first, first_name), *rest in groups:
        param = getattr(first, first_name)
        for module, name in rest:
            if getattr(module, name) is not param:
                setattr(module, name, param)
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
