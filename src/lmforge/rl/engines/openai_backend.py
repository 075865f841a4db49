"""The trainer as a client of vLLM's own OpenAI-compatible server with lmforge's routes (:mod:`.vllm_api`).

Rollouts go to ``/v1/completions`` (token-id prompts, the sampled tokens' ids and log-probs back); weights
to ``/lmforge/load_weights`` (a snapshot file) or over a weight-transfer group (:mod:`.weight_transfer`,
set up once with ``/lmforge/init_transfer``). Every reply is checked before it is used: a reply that is
not the protocol is a :class:`~.vllm_engine.ServerFailure`, as an unreachable server is.

Seeds: a completion request carries one seed for all its prompts, which would give every sample of a
prompt the same tokens, so requests carry none: the stream is the engine's, seeded at its start.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Sequence

import torch

from lmforge.errors import UserError
from lmforge.rl.engines.server_guard import SECRET_ENV
from lmforge.rl.engines.vllm_engine import ServerBackend, ServerFailure, _die_with_parent, _free_port, checked_completions

__all__ = ["VllmApiBackend", "check_served_model", "connect"]

PROBE_TEXT = "Grüße, 12 + 30 = 42; def f(x): return x ** 2  # ✓"


class VllmApiBackend(ServerBackend):
    """One vLLM API server (``process`` when lmforge started it)."""

    protocol = "vllm-openai"
    sender: Any = None

    def generate(self, prompts: Sequence[list[int]], *, max_new_tokens: int, temperature: float, top_p: float = 1.0,
                 stop_ids: Sequence[int] = (), seed: int = 0, logprobs: bool = True) -> list[dict[str, Any]]:
        body = {"prompt": [list(p) for p in prompts], "max_tokens": max_new_tokens, "temperature": temperature,
                "top_p": top_p, "stop_token_ids": list(stop_ids), "ignore_eos": True, "logprobs": 0,
                "return_token_ids": True, "skip_special_tokens": False, "n": 1}
        where = f"vLLM server {self.url}/v1/completions"
        choices = self.request("/v1/completions", body).get("choices")
        if not isinstance(choices, list) or len(choices) != len(prompts) \
                or not all(isinstance(c, dict) and isinstance(c.get("index"), int) for c in choices) \
                or sorted(c["index"] for c in choices) != list(range(len(prompts))):
            raise ServerFailure(f"{where}: expected {len(prompts)} choices indexed 0 to {len(prompts) - 1}")
        out = []
        for c in sorted(choices, key=lambda c: c["index"]):
            lps = c.get("logprobs")
            lps = lps.get("token_logprobs") if isinstance(lps, dict) else None
            out.append({"token_ids": c.get("token_ids"), "logprobs": lps})
        return checked_completions(out, len(prompts), where)

    def load_weights(self, path: str) -> float:
        seconds = self.request("/lmforge/load_weights", {"path": str(path)}).get("seconds")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise ServerFailure(f"vLLM server {self.url}/lmforge/load_weights: the reply has no seconds")
        return float(seconds)

    def init_transfer(self, device: torch.device, timeout_s: float = 600.0) -> None:
        """Set up this server's weight-transfer group (its worker joins this process's rendezvous)."""
        from lmforge.rl.engines.weight_transfer import TransferSender, reachable_address

        def join(host: str, port: int, world_size: int) -> None:
            self.request("/lmforge/init_transfer", {"host": host, "port": port, "world_size": world_size,
                                                    "timeout_s": timeout_s})

        try:
            self.sender = TransferSender(reachable_address(self.url), join, device=device, timeout_s=timeout_s)
        except (RuntimeError, OSError) as e:  # the rendezvous or the group: the server did not join
            raise ServerFailure(f"vLLM server {self.url}: the weight-transfer group failed ({e})"[:400]) from None

    def receive_weights(self) -> dict[str, Any]:
        """The server's side of one in-memory sync (blocks until the trainer has sent every bucket)."""
        reply = self.request("/lmforge/receive_weights", {})
        if not isinstance(reply.get("seconds"), (int, float)) or not isinstance(reply.get("bytes"), int):
            raise ServerFailure(f"vLLM server {self.url}/lmforge/receive_weights: the reply has no seconds or bytes")
        return reply


def check_served_model(backend: ServerBackend, args: Any, tokenizer: Any) -> None:
    """The server serves this trainer's architecture (its ``config.json`` shape) and tokenizer (the same ids
    for a probe text); else one line. A server of another model would sample tokens the trainer reads as
    other words, and a weight sync into it would fail or, worse, load into a model of another shape."""
    from lmforge.models.spec import spec_for_args

    health = backend.request("/lmforge/health")
    served = health.get("model") if isinstance(health.get("model"), dict) else {}
    want = {"architectures": [spec_for_args(args).hf_architecture], "vocab_size": args.vocab_size,
            "hidden_size": args.dim, "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads or args.n_heads}
    wrong = [f"{k} {served.get(k)} (the policy's: {v})" for k, v in want.items() if served.get(k) != v]
    if wrong:
        raise UserError(f"grpo.vllm_url: {backend.url} serves another model: " + ", ".join(wrong))
    ids = tokenizer.encode(PROBE_TEXT)
    reply = backend.request("/tokenize", {"prompt": PROBE_TEXT, "add_special_tokens": False})
    if reply.get("tokens") != list(ids):
        raise UserError(f"grpo.vllm_url: {backend.url} tokenizes with another tokenizer than the policy's "
                        "(a probe text gave other token ids)")


def connect(url: str, timeout_s: float = 3600.0) -> ServerBackend:
    """The backend for the server at ``url``: vLLM's API server with lmforge's routes when it answers
    ``/lmforge/health``, else lmforge's own small server (:mod:`.vllm_server`)."""
    probe = VllmApiBackend(url, timeout_s=timeout_s)
    try:
        if probe.request("/lmforge/health", timeout_s=10).get("server") == "vllm-openai":
            return probe
    except UserError as e:
        if isinstance(e, ServerFailure) and "HTTP" not in str(e):  # unreachable: said by the caller's first use
            return probe
    return ServerBackend(url, timeout_s=timeout_s)


def start_server(python: str, model_dir: Path, *, weights_dir: Path, dtype: str, seed: int, max_model_len: int,
                 log: Path, timeout_s: float = 600.0) -> VllmApiBackend:
    """Start vLLM's API server (:mod:`.vllm_api`) with ``python`` (vLLM's environment) and wait until it
    answers. It loads
    weights only from ``weights_dir`` and only for requests carrying a fresh random secret, which only
    this process knows (the environment of the server's process carries it, not its command line)."""
    port = _free_port()
    secret = secrets.token_hex(16)
    src = str(Path(__file__).resolve().parents[3])  # lmforge importable there without installing it
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env[SECRET_ENV] = secret
    cmd = [python, "-m", "lmforge.rl.engines.vllm_api", "--model", str(model_dir), "--port", str(port),
           "--dtype", dtype, "--seed", str(seed), "--max-model-len", str(max_model_len),
           "--weights-dir", str(weights_dir)]
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    except OSError as e:
        raise UserError(f"grpo.vllm_python: cannot start {python} ({e.strerror})") from None
    backend = VllmApiBackend(f"http://127.0.0.1:{port}", proc, secret=secret)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            raise UserError(f"the vLLM server exited with status {proc.returncode}: {tail[0]} (log: {log})")
        try:
            with urllib.request.urlopen(backend.url + "/health", timeout=5):
                return backend
        except (urllib.error.URLError, ConnectionError, OSError):
            time.sleep(1.0)
    backend.close()
    raise UserError(f"the vLLM server did not answer within {timeout_s:.0f} s (log: {log})")
