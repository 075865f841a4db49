"""In-memory weight sync (:mod:`lmforge.rl.engines.weight_transfer`) end to end, without vLLM: the trainer's
sender and the worker extension's receiver (:class:`lmforge.rl.engines.vllm_worker.WeightSync`, its
vLLM reload replaced by a recorder) over a real gloo group, in two threads of this process. What arrives
must be exactly the Hugging Face state dict a snapshot file holds, whatever the bucket size.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lmforge.models.hf import hf_state_dict_from_lmforge
from lmforge.models.model import ModelArgs, Transformer
from lmforge.rl.engines.server_pool import ServerPool
from lmforge.rl.engines.vllm_engine import ServerFailure
from lmforge.rl.engines.vllm_worker import WeightSync
from lmforge.rl.engines.weight_transfer import TransferSender, hf_buckets


class Worker(WeightSync):
    """The worker's side, as vLLM would mix it in, with the reload recorded instead of done."""

    def __init__(self) -> None:
        self.model_runner = SimpleNamespace(get_model=lambda: torch.nn.Linear(1, 1))
        self.received: dict[str, torch.Tensor] = {}

    def _lmforge_reload(self, weights: Any) -> None:
        for name, t in weights:
            self.received[name] = t.clone()


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=320, max_seq_len=64))


def _connect(worker: Worker) -> TransferSender:
    def join(host: str, port: int, world_size: int) -> None:  # returns once joined, as the server's reply does
        worker.lmforge_init_transfer(host, port, world_size, 1, 60.0)

    return TransferSender("127.0.0.1", join, device=torch.device("cpu"), timeout_s=60.0)


@pytest.mark.parametrize("bucket_bytes, dtype", [(1 << 30, torch.float32), (20_000, torch.float32),
                                                 (20_000, torch.bfloat16)])
def test_every_tensor_arrives_exactly_in_any_bucket_size(model, bucket_bytes, dtype):
    worker = Worker()
    sender = _connect(worker)
    expected = {k: v.to(dtype) for k, v in hf_state_dict_from_lmforge(model.state_dict(), model.args).items()}
    buckets = list(hf_buckets(model, dtype, bucket_bytes))
    assert (len(buckets) == 1) == (bucket_bytes == 1 << 30)
    assert all(sum(t.numel() * t.element_size() for _, t in b) < bucket_bytes + 64 * 320 * 4 for b in buckets)
    reply: dict[str, Any] = {}
    receiving = threading.Thread(target=lambda: reply.update(worker.lmforge_receive_weights()))
    receiving.start()
    for bucket in buckets:
        for _, work in sender.send(bucket):
            work.wait()
    for _, work in sender.end():
        work.wait()
    receiving.join(60)
    assert set(worker.received) == set(expected)
    for name, t in expected.items():
        assert worker.received[name].dtype == dtype and torch.equal(worker.received[name], t), name
    assert reply["bytes"] == sum(t.numel() * t.element_size() for t in expected.values())


class _Member:
    """A pool member whose transfer group is real and whose receive side is a :class:`Worker` (or dead)."""

    def __init__(self, url: str, dead: bool = False) -> None:
        self.url, self.timeout_s, self.worker = url, 30.0, Worker()
        self.sender = _connect(self.worker)
        self.dead = dead

    def receive_weights(self) -> dict[str, Any]:
        reply = self.worker.lmforge_receive_weights()
        if self.dead:  # the worker took the weights, then the server failed before it answered
            raise ServerFailure(f"vLLM server {self.url}: HTTP 500")
        return reply

    def close(self) -> None:
        pass


def test_a_pool_pushes_to_every_server_and_drops_one_that_fails(model):
    warnings: list[str] = []
    good, bad = _Member("http://good:1"), _Member("http://bad:1", dead=True)
    pool = ServerPool([good, bad], warn=warnings.append)  # type: ignore[list-item]
    sent = pool.push_weights(hf_buckets(model, torch.float32, 1 << 30))
    assert sent == sum(t.numel() * 4 for t in hf_state_dict_from_lmforge(model.state_dict(), model.args).values())
    assert pool.urls == ["http://good:1"] and len(good.worker.received) > 0
    assert len(warnings) == 1 and "http://bad:1" in warnings[0]
