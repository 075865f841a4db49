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
        with safe_open(path, framework="pt") as f:
            weights = ((name, f.get_tensor(name)) for name in f.keys())
            with set_current_vllm_config(self.vllm_config):
                self.model_runner.reload_weights(weights_iterator=weights)
        return time.perf_counter() - t0
