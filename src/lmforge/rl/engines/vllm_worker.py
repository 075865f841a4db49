"""The piece of lmforge that runs inside vLLM's workers: loading new policy weights in place.

vLLM imports this class by name (``worker_extension_cls``) into every worker, so
``LLM.collective_rpc("lmforge_load_weights", ...)`` reaches it; the server mode calls the same methods (a
safetensors file, or the weights received over a process group of the trainer's: :mod:`.weight_transfer`).
It imports nothing from lmforge: only this module must be importable in vLLM's environment.
"""

from __future__ import annotations

import json
import math
import time

import torch


class WeightSync:
    """Mixed into vLLM's worker class: ``self.model_runner`` and ``self.vllm_config`` are the worker's."""

    def lmforge_load_weights(self, path: str) -> float:
        """Load a safetensors file of Hugging Face-named tensors into the running model; the seconds taken.

        The file is memory-mapped (``/dev/shm`` makes it a shared-memory transfer); vLLM's in-place reload
        converts each tensor to the model's dtype and re-applies its kernel-format processing (the CPU
        backend repacks linear weights, so writing into the parameters directly would not do).
        """
        from safetensors import safe_open

        t0 = time.perf_counter()
        with safe_open(path, framework="pt") as f:
            self._lmforge_reload((name, f.get_tensor(name)) for name in f.keys())
        return time.perf_counter() - t0

    def lmforge_init_transfer(self, host: str, port: int, world_size: int, rank: int, timeout_s: float) -> bool:
        """Join the trainer's weight-transfer group (its rank 0 serves the rendezvous at ``host:port``):
        gloo on a CPU, NCCL on a GPU. A group of its own, apart from vLLM's: nothing of vLLM's changes."""
        import datetime

        import torch.distributed as dist

        device = next(self.model_runner.get_model().parameters()).device
        store = dist.TCPStore(host, port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self._lmforge_group = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        else:
            self._lmforge_group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        self._lmforge_device = device if device.type == "cuda" else torch.device("cpu")
        return True

    def lmforge_receive_weights(self) -> dict:
        """Receive the policy's weights from the trainer's group, bucket by bucket (each: a header, the
        bucket's names and shapes as JSON bytes, then one flat tensor; a zero header ends), and load them
        as they arrive: at most one bucket is held here besides the model. Seconds and bytes received."""
        import torch

        t0 = time.perf_counter()
        group, device = self._lmforge_group, self._lmforge_device
        received = [0]

        def weights():  # noqa: ANN202 - a generator of (name, tensor)
            while True:
                header = torch.zeros(3, dtype=torch.int64, device=device)
                group.broadcast(header, 0).wait()
                meta_len, numel, dtype_code = (int(x) for x in header.tolist())
                if meta_len == 0:
                    return
                meta = torch.empty(meta_len, dtype=torch.uint8, device=device)
                group.broadcast(meta, 0).wait()
                entries = json.loads(bytes(meta.cpu().tolist()).decode())
                flat = torch.empty(numel, dtype=_DTYPES[dtype_code], device=device)
                group.broadcast(flat, 0).wait()
                received[0] += flat.numel() * flat.element_size()
                offset = 0
                for name, shape in entries:
                    n = math.prod(shape)
                    yield name, flat[offset:offset + n].view(shape)
                    offset += n

        self._lmforge_reload(weights())
        return {"seconds": time.perf_counter() - t0, "bytes": received[0]}

    def _lmforge_reload(self, weights) -> None:  # noqa: ANN001 - an iterable of (name, tensor)
        from vllm.config import set_current_vllm_config

        model = self.model_runner.get_model()
        tied = _tied_parameters(model)
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.reload_weights(weights_iterator=weights)
        _retie(tied)


_DTYPES = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16}
"""The bucket dtype codes of the transfer header (the trainer's side: ``weight_transfer.DTYPE_CODES``)."""


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
