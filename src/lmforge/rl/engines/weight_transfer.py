"""In-memory weight sync (``grpo.weight_sync = "memory"``): the policy's weights sent to a rollout server's
vLLM worker over a process group of their own, bucket by bucket, with no file between them.

The trainer's rank 0 and the server's worker form a two-member group (gloo on a CPU, NCCL on a GPU),
apart from the trainer's own process group and vLLM's: rank 0 serves the rendezvous (a ``TCPStore``) and
tells the server where it is (``/lmforge/init_transfer``, an authenticated request). A sync walks the
model's parameters in order, gathering FSDP2 shards to full tensors one layer at a time (a collective:
every rank walks, rank 0 sends), renames them to the Hugging Face names vLLM loads, casts them to the
engine's dtype and packs them into buckets of about ``bucket_bytes``; each bucket goes as a header, its
names and shapes (JSON bytes) and one flat tensor, and the worker loads the tensors as they arrive
(:meth:`.vllm_worker.WeightSync.lmforge_receive_weights`). So neither side ever holds the whole model
beside its own copy: at most one bucket (and one layer being gathered).
"""

from __future__ import annotations

import datetime
import json
import re
import socket
import urllib.parse
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""The header's dtype codes (the worker's ``_DTYPES``)."""
BUCKET_BYTES = 256 << 20
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

Bucket = list[tuple[str, Tensor]]


def _layer_groups(model: nn.Module) -> Iterator[dict[str, Tensor]]:
    """The model's state in consecutive groups of one layer (or one global tensor), each tensor whole:
    an FSDP2 shard is gathered here, a collective every rank must join in the same order."""
    from torch.distributed.tensor import DTensor

    from lmforge.models.lora import has_adapters

    if has_adapters(model):  # adapters folded into their base weights, on a copy (DDP or one process)
        from lmforge.rl.engines.snapshot import full_cpu_state

        state = full_cpu_state(model)
    else:
        state = model.state_dict()
    group: dict[str, Tensor] = {}
    key = None
    for name, t in state.items():
        m = _LAYER.search(name)
        k = m.group(1) if m else name
        if group and k != key:
            yield group
            group = {}
        key = k
        group[name] = t.full_tensor() if isinstance(t, DTensor) else t
    if group:
        yield group


def hf_buckets(model: nn.Module, dtype: torch.dtype, bucket_bytes: int = BUCKET_BYTES) -> Iterator[Bucket]:
    """The weights vLLM loads (Hugging Face names, ``dtype``) in buckets of about ``bucket_bytes``; every
    rank iterates (see :func:`_layer_groups`), the tensors are only meaningful where they are sent."""
    from lmforge.models.hf import hf_state_dict_from_lmforge

    args = model.args  # type: ignore[attr-defined]
    bucket: Bucket = []
    size = 0
    with torch.no_grad():
        for group in _layer_groups(model):
            for name, t in hf_state_dict_from_lmforge(group, args).items():
                t = t.detach().to(dtype).contiguous()
                bucket.append((name, t))
                size += t.numel() * t.element_size()
                if size >= bucket_bytes:
                    yield bucket
                    bucket, size = [], 0
    if bucket:
        yield bucket


def reachable_address(url: str) -> str:
    """This machine's address as the server at ``url`` reaches it (the interface a connection to it uses)."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)
    with socket.create_connection((host, port), timeout=10) as s:
        return str(s.getsockname()[0])


class TransferSender:
    """The trainer's end of one server's weight-transfer group (rank 0 of two)."""

    def __init__(self, address: str, join: Callable[[str, int, int], None], *, device: torch.device,
                 timeout_s: float = 600.0) -> None:
        """``join(address, port, world_size)``: asks the server to join (its request runs while this
        waits for it in the rendezvous)."""
        import threading

        timeout = datetime.timedelta(seconds=timeout_s)
        self.device = device
        store = dist.TCPStore(address, 0, 2, is_master=True, timeout=timeout, wait_for_workers=False)
        failure: list[BaseException] = []

        def ask() -> None:
            try:
                join(address, store.port, 2)
            except BaseException as e:  # noqa: BLE001 - raised below, on the caller's thread
                failure.append(e)

        thread = threading.Thread(target=ask, daemon=True)
        thread.start()
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, 0, 2, opts)
        else:
            self.group = dist.ProcessGroupGloo(store, 0, 2, timeout)
        thread.join()
        self.store = store
        if failure:
            raise failure[0]

    def _send(self, t: Tensor) -> Any:
        t = t.to(self.device)
        return t, self.group.broadcast(t, 0)  # the tensor kept alive until its send is waited on

    def send(self, bucket: Bucket) -> list[Any]:
        """Start sending one bucket; the pending sends, to :func:`wait` on (so a bucket can go to several
        servers at once)."""
        meta = json.dumps([[name, list(t.shape)] for name, t in bucket]).encode()
        flat = torch.cat([t.reshape(-1) for _, t in bucket])
        header = torch.tensor([len(meta), flat.numel(), DTYPE_CODES[flat.dtype]], dtype=torch.int64)
        return [self._send(header), self._send(torch.frombuffer(bytearray(meta), dtype=torch.uint8)),
                self._send(flat)]

    def end(self) -> list[Any]:
        return [self._send(torch.zeros(3, dtype=torch.int64))]


def wait(pending: list[Any]) -> None:
    for _, work in pending:
        work.wait()
