"""lmforge's door on vLLM's own API server (:mod:`lmforge.rl.engines.vllm_routes`), without vLLM.

The middleware is plain ASGI, so it is driven here directly: the app behind it is a stub that records
what reaches it (vLLM's routes), and the engine client a stub whose ``collective_rpc`` records the worker
calls. What is under test is what the middleware lets through: the secret on the weight endpoints (also
on loopback), weight paths only from the weights directory, bounded bodies and prompt counts, and one
JSON line for every refusal. Also the launcher's argument checks and the command line it gives vLLM.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest

from lmforge.rl.engines import server_guard, vllm_api, vllm_routes

SECRET = "routes-secret-of-16-chars+"


class Engine:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.reset_ok = True

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        self.calls.append((method, args))
        return [{"seconds": 0.5, "bytes": 123}] if method == "lmforge_receive_weights" else [0.25]

    async def reset_prefix_cache(self) -> bool:
        self.calls.append(("reset_prefix_cache", ()))
        return self.reset_ok


class App:
    """vLLM's app: records the requests (and their bodies) that reach it."""

    def __init__(self) -> None:
        self.reached: list[tuple[str, bytes]] = []
        hf = SimpleNamespace(architectures=["LlamaForCausalLM"], vocab_size=320, hidden_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                             tie_word_embeddings=True)
        self.state = SimpleNamespace(engine_client=Engine(),
                                     vllm_config=SimpleNamespace(model_config=SimpleNamespace(hf_config=hf,
                                                                                              dtype="torch.float32")))

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = (await receive()).get("body", b"")
        self.reached.append((scope["path"], body))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'{"vllm": true}'})


def call(mw: vllm_routes.LmforgeRoutes, app: App, method: str, path: str, body: Any = None, *,
         secret: str | None = SECRET, raw: bytes | None = None, length: str | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
    headers = [(b"content-type", b"application/json")]
    if method == "POST":
        headers.append((b"content-length", (length if length is not None else str(len(data))).encode()))
    if secret:
        headers.append((b"authorization", f"Bearer {secret}".encode()))
    scope = {"type": "http", "method": method, "path": path, "headers": headers, "app": app}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": data, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(mw(scope, receive, send))
    return sent[0]["status"], json.loads(sent[1]["body"])


@pytest.fixture
def door(monkeypatch, tmp_path):
    def make(secret: str | None = SECRET, weights: bool = True):
        if secret:
            monkeypatch.setenv(server_guard.SECRET_ENV, secret)
        else:
            monkeypatch.delenv(server_guard.SECRET_ENV, raising=False)
        monkeypatch.setenv(vllm_routes.WEIGHTS_DIR_ENV, str(tmp_path) if weights else "")
        app = App()
        return vllm_routes.LmforgeRoutes(app), app

    return make


def test_health_says_what_the_trainer_checks(door):
    mw, app = door()
    status, reply = call(mw, app, "GET", "/lmforge/health")
    assert status == 200 and reply["authorized"] is True and reply["secret"] is True and reply["weights_dir"] is True
    assert reply["model"]["architectures"] == ["LlamaForCausalLM"] and reply["model"]["num_hidden_layers"] == 2
    assert call(mw, app, "GET", "/lmforge/health", secret="wrong-secret-of-16-chars")[1]["authorized"] is False
    assert app.reached == []


@pytest.mark.parametrize("path, body", [("/lmforge/load_weights", {"path": "x"}),
                                        ("/lmforge/init_transfer", {"host": "127.0.0.1", "port": 1, "world_size": 2}),
                                        ("/lmforge/receive_weights", {})])
def test_weight_endpoints_need_the_secret_also_on_loopback(door, path, body):
    mw, app = door()
    for secret in (None, "wrong-secret-of-16-chars"):
        status, reply = call(mw, app, "POST", path, body, secret=secret)
        assert status == 401 and "shared secret" in reply["error"]
    mw, app = door(secret=None)  # a server without a secret takes no weights at all
    status, reply = call(mw, app, "POST", path, body, secret=None)
    assert status == 403 and "need a shared secret" in reply["error"]
    assert app.state.engine_client.calls == [] and app.reached == []


def test_weights_load_only_from_the_weights_directory(door, tmp_path):
    mw, app = door()
    good = tmp_path / "weights-00000002.safetensors"
    good.write_bytes(b"x")
    (tmp_path / "other.bin").write_bytes(b"x")
    for path in ("/etc/passwd", str(tmp_path / "other.bin"), str(tmp_path / "weights-00000009.safetensors"), 7):
        status, reply = call(mw, app, "POST", "/lmforge/load_weights", {"path": path})
        assert status == 400 and "--weights-dir" in reply["error"], path
    assert app.state.engine_client.calls == []
    assert call(mw, app, "POST", "/lmforge/load_weights", {"path": str(good)}) == (200, {"seconds": 0.25})
    # the old weights' cached keys and values are forgotten after every load
    assert app.state.engine_client.calls == [("lmforge_load_weights", (str(good),)), ("reset_prefix_cache", ())]
    app.state.engine_client.reset_ok = False  # vLLM refuses the reset: the load fails (the server is dropped)
    status, reply = call(mw, app, "POST", "/lmforge/load_weights", {"path": str(good)})
    assert status == 500 and "the engine failed" in reply["error"]
    mw, app = door(weights=False)
    status, reply = call(mw, app, "POST", "/lmforge/load_weights", {"path": str(good)})
    assert status == 403 and app.state.engine_client.calls == []


def test_transfer_endpoints_reach_the_worker_with_checked_arguments(door):
    mw, app = door()
    for bad in ({"host": "h", "port": 0, "world_size": 2}, {"host": 5, "port": 80, "world_size": 2},
                {"host": "h", "port": 80, "world_size": 3}):
        assert call(mw, app, "POST", "/lmforge/init_transfer", bad)[0] == 400
    assert call(mw, app, "POST", "/lmforge/init_transfer", {"host": "10.0.0.1", "port": 29500, "world_size": 2})[0] == 200
    assert call(mw, app, "POST", "/lmforge/receive_weights", {}) == (200, {"seconds": 0.5, "bytes": 123})
    assert [c[0] for c in app.state.engine_client.calls] == ["lmforge_init_transfer", "lmforge_receive_weights",
                                                             "reset_prefix_cache"]
    assert app.state.engine_client.calls[0][1][:4] == ("10.0.0.1", 29500, 2, 1)


def test_bodies_and_prompt_counts_are_bounded_on_vllms_routes_too(door):
    mw, app = door()
    ok = {"prompt": [[1, 2]], "max_tokens": 2}
    assert call(mw, app, "POST", "/v1/completions", ok) == (200, {"vllm": True})
    assert app.reached == [("/v1/completions", json.dumps(ok).encode())]  # the body reaches vLLM unchanged
    too_many = {"prompt": [[1]] * (server_guard.MAX_PROMPTS + 1), "max_tokens": 2}
    status, reply = call(mw, app, "POST", "/v1/completions", too_many)
    assert status == 400 and "at most" in reply["error"]
    assert call(mw, app, "POST", "/v1/completions", ok, length=str(server_guard.MAX_BODY_BYTES + 1))[0] == 413
    assert call(mw, app, "POST", "/v1/completions", None, raw=b"[" * 1000)[0] == 400
    assert call(mw, app, "POST", "/lmforge/receive_weights", None, raw=b"<html>")[0] == 400
    assert call(mw, app, "GET", "/lmforge/nothing")[0] == 404
    assert len(app.reached) == 1


@pytest.mark.parametrize("argv, says", [
    (["--port", "70000"], "--port 70000: not a port number"),
    (["--host", "0.0.0.0"], "listens beyond this machine"),
    (["--weights-dir", "/nonexistent/dir"], "--weights-dir /nonexistent/dir: not a directory"),
    ([], "vLLM is not installed"),
])
def test_launcher_problems_are_one_error_line(tmp_path, capsys, monkeypatch, argv, says):
    monkeypatch.delenv(server_guard.SECRET_ENV, raising=False)
    (tmp_path / "config.json").write_text("{}")
    assert vllm_api.main(["--model", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and says in err, err


def test_the_launcher_gives_vllm_lmforges_extension_and_middleware_and_no_secret():
    a = SimpleNamespace(model="/m", host="127.0.0.1", port=8000, dtype="bfloat16", seed=3, max_model_len=512,
                        gpu_memory_utilization=0.5)
    argv = vllm_api.vllm_argv(a, ["--max-num-seqs", "64"], cpu=True)
    flag = dict(zip(argv, argv[1:]))
    assert flag["--worker-extension-cls"] == "lmforge.rl.engines.vllm_worker.WeightSync"
    assert flag["--middleware"] == "lmforge.rl.engines.vllm_routes.LmforgeRoutes"
    assert flag["--logprobs-mode"] == "processed_logprobs" and flag["--generation-config"] == "vllm"
    assert "--enforce-eager" in argv and argv[-2:] == ["--max-num-seqs", "64"] and "--api-key" not in argv
