"""lmforge's few endpoints on vLLM's own OpenAI-compatible server, and its door (an ASGI middleware).

vLLM's server (``vllm serve``, started by :mod:`.vllm_api`) serves the rollouts on its OpenAI routes
(``/v1/completions`` with token-id prompts), which its ``--api-key`` guards. This middleware, loaded with
``--middleware lmforge.rl.engines.vllm_routes.LmforgeRoutes``, adds what a trainer needs beyond them and
checks every request first (the rules of :mod:`.server_guard`):

* ``GET /lmforge/health``: whether the server has a secret and this request carries it, whether it has a
  weights directory, and the served model's shape (the trainer checks it is its own architecture);
* ``POST /lmforge/load_weights {path}``: reload from a snapshot file in ``LMFORGE_WEIGHTS_DIR``;
* ``POST /lmforge/init_transfer {host, port, world_size}`` and ``POST /lmforge/receive_weights``: join the
  trainer's weight-transfer group, then receive one sync over it (:mod:`.weight_transfer`).

The weight endpoints need the shared secret (``LMFORGE_SERVER_SECRET``, also vLLM's ``VLLM_API_KEY``), also
on loopback. Every POST, the OpenAI routes' too, needs a ``Content-Length`` of at most
:data:`~.server_guard.MAX_BODY_BYTES`, and a completion request at most
:data:`~.server_guard.MAX_PROMPTS` prompts. Standard library only (and vLLM, reached through the ASGI
scope's app): it runs in vLLM's environment.
"""

from __future__ import annotations

import json
import os
from typing import Any, Awaitable, Callable

from lmforge.rl.engines.server_guard import (MAX_BODY_BYTES, MAX_PROMPTS, SECRET_ENV, RequestError, authorized,
                                             weights_path)

WEIGHTS_DIR_ENV = "LMFORGE_WEIGHTS_DIR"
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class _Headers:
    """An ASGI scope's headers with the ``get`` :func:`~.server_guard.authorized` uses."""

    def __init__(self, scope: dict[str, Any]) -> None:
        self.raw = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}

    def get(self, name: str, default: str | None = None) -> str | None:
        return self.raw.get(name.lower(), default)


async def _reply(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


async def _read_body(headers: _Headers, receive: Receive) -> bytes:
    length = headers.get("content-length") or ""
    if not length.isdigit():
        raise RequestError(411, "a request needs a Content-Length")
    if int(length) > MAX_BODY_BYTES:
        raise RequestError(413, f"request body over {MAX_BODY_BYTES} bytes")
    chunks, size = [], 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > int(length):
            raise RequestError(400, "the body is longer than its Content-Length")
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        req = json.loads(raw or b"{}")
    except (ValueError, RecursionError):
        raise RequestError(400, "the body is not JSON") from None
    if not isinstance(req, dict):
        raise RequestError(400, "the body must be a JSON object")
    return req


def served_model(app: Any) -> dict[str, Any]:
    """The served model's shape, from vLLM's config (what the trainer compares with its own)."""
    config = getattr(getattr(getattr(app, "state", None), "vllm_config", None), "model_config", None)
    hf = getattr(config, "hf_config", None)
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "tie_word_embeddings")
    shape = {k: getattr(hf, k, None) for k in keys}
    return {"architectures": list(getattr(hf, "architectures", None) or []), **shape,
            "dtype": str(getattr(config, "dtype", "")).removeprefix("torch.")}


class LmforgeRoutes:
    """The middleware (vLLM adds it with ``app.add_middleware(LmforgeRoutes)``)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        secret = os.environ.get(SECRET_ENV, "").strip()
        self.secret = secret or None
        wd = os.environ.get(WEIGHTS_DIR_ENV, "")
        from pathlib import Path

        self.weights_dir = Path(wd) if wd else None

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        path, method = scope.get("path", ""), scope.get("method", "GET")
        headers = _Headers(scope)
        try:
            if path.startswith("/lmforge/"):
                return await self._lmforge(scope, path, method, headers, receive, send)
            if method == "POST":  # vLLM's own routes: bounded bodies, a bounded count of prompts
                raw = await _read_body(headers, receive)
                if path == "/v1/completions":
                    prompts = _json_object(raw).get("prompt")
                    if isinstance(prompts, list) and prompts and isinstance(prompts[0], list) \
                            and len(prompts) > MAX_PROMPTS:
                        raise RequestError(400, f"at most {MAX_PROMPTS} prompts a request")
                receive = _replay(raw, receive)
        except RequestError as e:
            return await _reply(send, e.status, {"error": str(e)})
        return await self.app(scope, receive, send)

    async def _lmforge(self, scope: dict[str, Any], path: str, method: str, headers: _Headers, receive: Receive,
                       send: Send) -> None:
        if path == "/lmforge/health" and method == "GET":
            return await _reply(send, 200, {
                "ok": True, "server": "vllm-openai", "secret": self.secret is not None,
                "authorized": self.secret is not None and authorized(headers, self.secret),
                "weights_dir": self.weights_dir is not None, "model": served_model(scope.get("app"))})
        routes = {"/lmforge/load_weights", "/lmforge/init_transfer", "/lmforge/receive_weights"}
        if path not in routes or method != "POST":
            raise RequestError(404, "no such endpoint")
        if not authorized(headers, self.secret):
            raise RequestError(401, "missing or wrong shared secret (Authorization: Bearer ...)")
        if self.secret is None:
            raise RequestError(403, f"weight loads need a shared secret: start the server with {SECRET_ENV} set "
                                    "(any local process could otherwise replace the policy)")
        req = _json_object(await _read_body(headers, receive))
        engine = scope["app"].state.engine_client
        try:
            if path == "/lmforge/load_weights":
                target = weights_path(req, self.weights_dir, self.secret)
                seconds = max(await engine.collective_rpc("lmforge_load_weights", args=(target,)))
                await _forget_cached_prefixes(engine)
                return await _reply(send, 200, {"seconds": float(seconds)})
            if path == "/lmforge/init_transfer":
                host, port, world = req.get("host"), req.get("port"), req.get("world_size")
                if not isinstance(host, str) or len(host) > 255 or not isinstance(port, int) \
                        or not 0 < port < 65536 or world != 2:
                    raise RequestError(400, "init_transfer needs host, port and world_size 2")
                timeout = float(req.get("timeout_s", 600))
                await engine.collective_rpc("lmforge_init_transfer", args=(host, port, 2, 1, timeout))
                return await _reply(send, 200, {"ok": True})
            done = await engine.collective_rpc("lmforge_receive_weights")
            await _forget_cached_prefixes(engine)
            return await _reply(send, 200, {"seconds": max(float(d["seconds"]) for d in done),
                                            "bytes": int(done[0]["bytes"])})
        except RequestError:
            raise
        except Exception as e:  # noqa: BLE001 - the engine's failure: one line to the client
            print(f"lmforge routes: {path} failed: {type(e).__name__}: {e}", flush=True)
            return await _reply(send, 500, {"error": f"the engine failed ({type(e).__name__}); see the server's log"})


async def _forget_cached_prefixes(engine: Any) -> None:
    """After a weight load: vLLM's prefix cache holds keys and values computed by the old weights, and a
    request sharing a cached block with an earlier one (a prompt sampled again, a partial rollout's
    continuation) would reuse them. The reload does not clear it; this does, or fails the load (vLLM refuses
    while requests are running), so no request samples from old weights' blocks after a load."""
    if await engine.reset_prefix_cache() is False:
        raise RuntimeError("vLLM did not reset its prefix cache after the weight load (requests were running)")


def _replay(raw: bytes, original: Receive) -> Receive:
    """A ``receive`` that hands the already-read body to vLLM's app, then waits on the connection as the
    original does (vLLM listens for the client going away to cancel its request)."""
    sent = [False]

    async def receive() -> dict[str, Any]:
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await original()

    return receive
