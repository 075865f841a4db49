"""The rollout server's HTTP layer, the trainer as its client, and the engine pre-flight, against hostile input.

vLLM is not installed in the test environment, so the server's engine is a stub (:class:`StubRunner`: the
``VllmRunner`` interface, recording what reaches it): everything under test is lmforge's own code, the
HTTP handler and :mod:`lmforge.rl.engines.server_guard`, which decide what reaches the engine at all. The
client tests run against small standard-library servers that misbehave on purpose. The pre-flight tests
resume a finished tiny GRPO run (lmforge's own engine) with each broken engine setting and check that
nothing saved changed.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

import pytest

from _helpers import lmforge_in_process, tiny_run_args
from lmforge.errors import UserError
from lmforge.rl.engines import server_guard, vllm_server
from lmforge.rl.engines.vllm_engine import ServerBackend

SECRET = "s3cret-of-at-least-16-chars"


class StubRunner:
    """The engine's interface, without vLLM: each call recorded, completions of fixed tokens."""

    vocab_size, max_model_len = 100, 64

    def __init__(self) -> None:
        self.generated: list[dict[str, Any]] = []
        self.loaded: list[str] = []

    def generate(self, prompts: list[list[int]], **kw: Any) -> list[dict[str, Any]]:
        self.generated.append({"prompts": prompts, **kw})
        return [{"token_ids": [1, 2], "logprobs": [-0.5, -0.25]} for _ in prompts]

    def load_weights(self, path: str) -> float:
        self.loaded.append(path)
        return 0.01


@pytest.fixture
def served(tmp_path):
    """Start a server over a fresh :class:`StubRunner`: ``served(secret=..., weights_dir=...)`` -> (url, runner)."""
    servers = []

    def start(secret: str | None = SECRET, weights_dir: Path | None = None, host: str = "127.0.0.1"):
        runner = StubRunner()
        server = vllm_server.serve(runner, host, 0, secret=secret, weights_dir=weights_dir)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", runner

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def post(url: str, path: str, body: Any, secret: str | None = SECRET, raw: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    data = raw if raw is not None else json.dumps(body).encode()
    h = {"Content-Type": "application/json", "Content-Length": str(len(data))} | (headers or {})
    if secret:
        h["Authorization"] = f"Bearer {secret}"
    conn.request("POST", path, body=data, headers=h)
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


GOOD = {"prompts": [[1, 2, 3]], "max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "stop_ids": [0], "seed": 1}


# ------------------------------------------------------------------------------------------ who may ask
def test_weight_loads_need_a_secret_and_beyond_loopback_needs_one(served, tmp_path):
    url, runner = served(secret=None, weights_dir=tmp_path)
    (tmp_path / "weights-00000001.safetensors").write_bytes(b"x")
    assert post(url, "/generate", GOOD, secret=None)[0] == 200  # loopback, no secret: sampling only
    status, reply = post(url, "/load_weights", {"path": str(tmp_path / "weights-00000001.safetensors")}, secret=None)
    assert status == 403 and "shared secret" in reply["error"] and runner.loaded == []
    with pytest.raises(ValueError, match="listens beyond this machine"):
        vllm_server.serve(StubRunner(), "0.0.0.0", 0)


def test_with_a_secret_every_request_must_carry_it(served, tmp_path):
    url, runner = served(weights_dir=tmp_path)
    for secret in (None, "wrong-secret-but-long-enough"):
        assert post(url, "/generate", GOOD, secret=secret)[0] == 401
        assert post(url, "/load_weights", {"path": "x"}, secret=secret)[0] == 401
    assert runner.generated == [] and runner.loaded == []
    assert post(url, "/generate", GOOD)[0] == 200 and len(runner.generated) == 1
    health = ServerBackend(url, secret=SECRET).request("/health")
    assert health == {"ok": True, "secret": True, "authorized": True, "weights_dir": True}
    assert ServerBackend(url, secret="another-secret-of-16+").request("/health")["authorized"] is False


# ---------------------------------------------------------------------------------------- which weights
def test_weights_only_from_the_configured_directory_and_only_regular_files(served, tmp_path):
    weights, elsewhere = tmp_path / "sync", tmp_path / "elsewhere"
    weights.mkdir(), elsewhere.mkdir()
    url, runner = served(weights_dir=weights)
    good = weights / "weights-00000007.safetensors"
    good.write_bytes(b"x")
    (elsewhere / "weights-00000007.safetensors").write_bytes(b"x")
    os.mkfifo(weights / "weights-00000008.safetensors")  # would block the engine's only lock
    (weights / "weights-00000009.safetensors").symlink_to(elsewhere / "weights-00000007.safetensors")
    (weights / "other.bin").write_bytes(b"x")
    refused = [str(elsewhere / "weights-00000007.safetensors"), str(weights / "weights-00000008.safetensors"),
               str(weights / "weights-00000009.safetensors"), str(weights / "other.bin"), "/etc/passwd",
               str(weights / "weights-00000001.safetensors"),  # absent: the same reply as present elsewhere
               str(weights / ".." / "elsewhere" / "weights-00000007.safetensors"), 7, None, "a\0b"]
    replies = set()
    for path in refused:
        t = time.perf_counter()
        status, reply = post(url, "/load_weights", {"path": path})
        assert status == 400 and time.perf_counter() - t < 2, path
        replies.add(reply["error"])
    assert len(replies) == 1 and runner.loaded == []  # one reply whatever exists: nothing is revealed
    assert post(url, "/load_weights", {"path": str(good)}) == (200, {"seconds": 0.01}) and runner.loaded == [str(good)]
    url2, runner2 = served(weights_dir=None)
    status, reply = post(url2, "/load_weights", {"path": str(good)})
    assert status == 403 and "--weights-dir" in reply["error"] and runner2.loaded == []


# ------------------------------------------------------------------------------------------- how much
@pytest.mark.parametrize("change, says", [
    ({"prompts": [[1, 100]]}, "outside the vocabulary"),
    ({"prompts": [[-1]]}, "outside the vocabulary"),
    ({"prompts": [[True]]}, "outside the vocabulary"),
    ({"prompts": [[1.5]]}, "outside the vocabulary"),
    ({"prompts": [[1] * 61]}, "at most 60 token ids"),
    ({"prompts": [[]]}, "at least one token id"),
    ({"prompts": []}, "prompts must be a list of 1 to"),
    ({"prompts": "1 2 3"}, "prompts must be a list"),
    ({"stop_ids": [10**6]}, "outside the vocabulary"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer from 1 to 64"),
    ({"max_new_tokens": 10**9}, "max_new_tokens must be an integer"),
    ({"temperature": float("nan")}, "temperature must be a finite number"),
    ({"temperature": -1}, "temperature must be a finite number"),
    ({"top_p": 0}, "top_p must be a finite number in (0, 1]"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": -1}, "seed must be an integer"),
    ({"logprobs": "yes"}, "logprobs must be true or false"),
])
def test_sampling_requests_are_checked_before_the_engine(served, change, says):
    url, runner = served()
    status, reply = post(url, "/generate", {**GOOD, **change})
    assert status == 400 and says in reply["error"], reply
    assert runner.generated == []


def test_bodies_are_bounded_and_idle_connections_closed(served, monkeypatch):
    url, runner = served()
    assert post(url, "/generate", None, raw=b"[" * 100_000)[0] == 400  # nesting: one reply, no traceback
    assert post(url, "/generate", None, raw=b"<html>")[0] == 400
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:  # a declared 10 GB body is never read
        s.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\r\n"
                  f"Content-Length: {10 << 30}\r\n\r\n".encode())
        assert b" 413 " in s.recv(4096).split(b"\r\n")[0]
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\r\n\r\n".encode())
        assert b" 411 " in s.recv(4096).split(b"\r\n")[0]
    assert runner.generated == []

    monkeypatch.setattr(vllm_server, "IDLE_TIMEOUT_S", 0.3)
    url, _ = served()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\n")  # and then nothing
        t = time.perf_counter()
        assert s.recv(4096) == b"" and time.perf_counter() - t < 5  # closed by the server


@pytest.mark.parametrize("argv, says", [
    (["--port", "70000"], "--port 70000: not a port number"),
    (["--host", "0.0.0.0"], "listens beyond this machine"),
    (["--secret-file", "/nonexistent/secret"], "--secret-file /nonexistent/secret: unreadable"),
    (["--weights-dir", "/nonexistent/dir"], "--weights-dir /nonexistent/dir: not a directory"),
    ([], "vLLM is not installed"),
])
def test_server_startup_problems_are_one_error_line(tmp_path, capsys, monkeypatch, argv, says):
    monkeypatch.delenv(server_guard.SECRET_ENV, raising=False)
    (tmp_path / "config.json").write_text("{}")
    assert vllm_server.main(["--model", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and says in err, err
    monkeypatch.setenv(server_guard.SECRET_ENV, "short")
    assert vllm_server.main(["--model", str(tmp_path)]) == 2
    assert "under 16 characters" in capsys.readouterr().err


def test_a_taken_port_is_one_error_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(server_guard.importlib.util, "find_spec", lambda name: object())  # as if vLLM were there
    (tmp_path / "config.json").write_text("{}")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert vllm_server.main(["--model", str(tmp_path), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: cannot listen on 127.0.0.1:{port}" in err, err


# ------------------------------------------------------------------------------- the trainer as a client
def _fake_server(reply: Callable[[BaseHTTPRequestHandler], None]) -> tuple[str, ThreadingHTTPServer]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            reply(self)

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            reply(self)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


def _send(status: int, body: bytes, length: int | None = None, kind: str = "text/html"):
    def reply(h: BaseHTTPRequestHandler) -> None:
        h.send_response(status)
        h.send_header("Content-Type", kind)
        h.send_header("Content-Length", str(len(body) if length is None else length))
        h.end_headers()
        h.wfile.write(body)
        h.wfile.flush()
        h.close_connection = True
    return reply


@pytest.mark.parametrize("reply, says", [
    (_send(200, b"<html><body>proxy</body></html>"), "not lmforge's server protocol"),
    (_send(502, b"<html>bad gateway</html>"), "HTTP 502"),
    (_send(500, b'{"error": "the engine failed (ValueError); see the server\'s log"}', kind="application/json"),
     "HTTP 500: the engine failed"),
    (_send(200, b'{"ok": true}', kind="application/json"), "expected 2 completions, the reply has none"),
    (_send(200, b'{"completions": [{"token_ids": [1]}, {"logprobs": []}]}', kind="application/json"),
     "without a list of token_ids"),
    (_send(200, b'{"completions": [{"token_ids": [1], "logprobs": [0.1, 0.2]}, {"token_ids": [], "logprobs": []}]}',
           kind="application/json"), "not one number per token"),
    (_send(200, b'{"completions": [', length=4000, kind="application/json"), "cut off"),
])
def test_a_misbehaving_server_is_one_line_for_the_trainer(reply, says):
    url, server = _fake_server(reply)
    try:
        with pytest.raises(UserError) as e:
            ServerBackend(url, timeout_s=5).generate([[1], [2]], max_new_tokens=2)
        assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("url", ["localhost:8000", "127.0.0.1:8000", "ftp://host:1", "http://", "http://h:99999"])
def test_a_url_without_scheme_or_host_is_one_line(url):
    with pytest.raises(UserError, match="expected http://HOST:PORT"):
        ServerBackend(url)


# ---------------------------------------------------------------------------- the pre-flight, on resume
def _digest(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory) -> Path:
    """A finished 1-step GRPO run (lmforge's own engine) to resume with broken engine settings."""
    work = tmp_path_factory.mktemp("grpo")
    (work / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Say {i}", "answer": "1"}) + "\n"
                                                for i in range(4)))
    args = ["grpo", *tiny_run_args("prompts.jsonl", data_seq_len=None, training_steps=1,
                                   training_global_batch_size=4, training_micro_batch_size=4, grpo_num_generations=2,
                                   grpo_max_new_tokens=4, tasks_eval_examples=0),
            "--rewards=format", f"--run.dir={work / 'run'}"]
    assert lmforge_in_process(*args, cwd=work) == 0
    return work


def test_broken_engine_settings_are_refused_before_the_run_directory_changes(grpo_run, tmp_path, capfd, monkeypatch):
    monkeypatch.delenv(server_guard.SECRET_ENV, raising=False)
    run = grpo_run / "run"
    before = _digest(run)
    sync_file = tmp_path / "a_file"
    sync_file.write_text("mine")
    not_vllm = tmp_path / "python"
    not_vllm.write_text("#!/bin/sh\nexit 3\n")
    not_vllm.chmod(0o755)
    html_url, html_server = _fake_server(_send(200, b"<html>hello</html>"))
    plain_url, plain_server = _fake_server(_send(
        200, b'{"ok": true, "secret": false, "authorized": false, "weights_dir": true}', kind="application/json"))
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead_url = f"http://127.0.0.1:{closed.getsockname()[1]}"  # bound, never listening: refused
    cases = {
        "colocate without vLLM": (["--grpo.vllm_mode=colocate"], "grpo.vllm_mode=colocate: vLLM is not installed"),
        "server without vLLM here": (["--grpo.vllm_mode=server"], "no grpo.vllm_url: vLLM is not installed"),
        "interpreter missing": (["--grpo.vllm_mode=server", f"--grpo.vllm_python={tmp_path / 'nope'}"], "does not exist"),
        "interpreter a directory": (["--grpo.vllm_mode=server", f"--grpo.vllm_python={tmp_path}"],
                                    "not an executable file"),
        "interpreter without vLLM": (["--grpo.vllm_mode=server", f"--grpo.vllm_python={not_vllm}"],
                                     "vLLM is not installed in that environment"),
        "sync dir a file": (["--grpo.vllm_mode=colocate", f"--grpo.vllm_sync_dir={sync_file}"],
                            "exists and is not a directory"),
        "url without scheme": (["--grpo.vllm_mode=server", "--grpo.vllm_url=localhost:8000",
                                f"--grpo.vllm_sync_dir={tmp_path}"], "expected http://HOST:PORT"),
        "url unreachable": (["--grpo.vllm_mode=server", f"--grpo.vllm_url={dead_url}", f"--grpo.vllm_sync_dir={tmp_path}"],
                            "unreachable"),
        "url answers HTML": (["--grpo.vllm_mode=server", f"--grpo.vllm_url={html_url}", f"--grpo.vllm_sync_dir={tmp_path}"],
                             "not lmforge's server protocol"),
        "server without a secret": (["--grpo.vllm_mode=server", f"--grpo.vllm_url={plain_url}",
                                     f"--grpo.vllm_sync_dir={tmp_path}"], "has no shared secret"),
        "url without sync dir": (["--grpo.vllm_mode=server", f"--grpo.vllm_url={plain_url}"], "set grpo.vllm_sync_dir"),
    }
    try:
        for what, (extra, says) in cases.items():
            args = ["grpo", *tiny_run_args("prompts.jsonl", data_seq_len=None, training_steps=2,
                                           training_global_batch_size=4, training_micro_batch_size=4,
                                           grpo_num_generations=2, grpo_max_new_tokens=4, tasks_eval_examples=0),
                    "--rewards=format", f"--run.dir={run}", "--grpo.engine=vllm", *extra]
            rc = lmforge_in_process(*args, cwd=grpo_run)
            err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
            assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and says in err[0], (what, err)
            assert _digest(run) == before, what
            assert sync_file.read_text() == "mine" and not list(tmp_path.glob("lmforge-weights-*"))
    finally:
        closed.close()
        for s in (html_server, plain_server):
            s.shutdown()
            s.server_close()


def test_the_engine_limits_come_from_vllm_or_the_model_directory(tmp_path):
    class Config:
        max_model_len = 512

        def get_vocab_size(self) -> int:
            return 49152

    class Engine:
        model_config = Config()

    class LLM:
        llm_engine = Engine()

    assert vllm_server._limits(LLM(), str(tmp_path), None) == (49152, 512)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 300, "max_position_embeddings": 256}))
    assert vllm_server._limits(object(), str(tmp_path), None) == (300, 256)
    assert vllm_server._limits(object(), str(tmp_path), 128) == (300, 128)
