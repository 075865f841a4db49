"""Several rollout servers (``grpo.vllm_url`` a list): prompts spread over them, failed ones dropped.

The servers are lmforge's own HTTP server (:func:`lmforge.rl.engines.vllm_server.serve`) over a stub
engine whose completions name the prompt and the seed it was sampled with, and small standard-library
servers that fail in each way a server can (refused, timed out, 5xx, HTML, a wrong reply); no vLLM.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from _helpers import lmforge_in_process, read_records, tiny_run_args
from lmforge.errors import UserError
from lmforge.rl.engines import server_guard, vllm_server
from lmforge.rl.engines.server_pool import ServerPool, slices
from lmforge.rl.engines.vllm_engine import ServerBackend, ServerFailure

SECRET = "pool-secret-of-16-chars-or-more"


class EchoRunner:
    """A stub engine: prompt ``i`` of a request gets ``[prompt[0], (seed + i) % 300]`` (within the tiny
    model's vocabulary)."""

    vocab_size, max_model_len = 60_000, 512

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []
        self.loaded: list[str] = []

    def generate(self, prompts: list[list[int]], *, seed: int, **kw: Any) -> list[dict[str, Any]]:
        self.prompts += prompts
        return [{"token_ids": [p[0], (seed + i) % 300], "logprobs": [-1.0, -2.0]} for i, p in enumerate(prompts)]

    def load_weights(self, path: str) -> float:
        self.loaded.append(path)
        return 0.25


@pytest.fixture
def servers(tmp_path):
    """``start(kind)``: a server of one kind -> (url, runner or None, server). Kinds: ``echo`` (lmforge's
    server over :class:`EchoRunner`), ``refused``, ``slow``, ``http500``, ``html``, ``short`` (too few
    completions)."""
    live: list[Any] = []
    holders: list[socket.socket] = []

    def start(kind: str = "echo"):
        if kind == "refused":
            s = socket.socket()
            s.bind(("127.0.0.1", 0))  # bound, never listening
            holders.append(s)
            return f"http://127.0.0.1:{s.getsockname()[1]}", None, None
        if kind == "echo":
            runner = EchoRunner()
            server = vllm_server.serve(runner, "127.0.0.1", 0, secret=SECRET, weights_dir=tmp_path)
        else:
            runner, server = None, ThreadingHTTPServer(("127.0.0.1", 0), _failing(kind))
            server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        live.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", runner, server

    yield start
    for s in live:
        s.shutdown()
        s.server_close()
    for s in holders:
        s.close()


def _failing(kind: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"]))).get("prompts", []))
            if kind == "slow":
                time.sleep(3)
            status, body = {"http500": (500, b'{"error": "the engine failed (RuntimeError)"}'),
                            "html": (200, b"<html>proxy</html>"), "slow": (200, b"{}"),
                            "short": (200, json.dumps({"completions": [{"token_ids": [1], "logprobs": None}]
                                                       * max(0, n - 1)}).encode())}[kind]
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


def _pool(urls: list[str], warnings: list[str], timeout_s: float = 10.0) -> ServerPool:
    return ServerPool([ServerBackend(u, timeout_s=timeout_s, secret=SECRET) for u in urls], warn=warnings.append)


PROMPTS = [[100 + i, 7] for i in range(10)]


def test_slices_are_balanced_contiguous_and_in_order():
    assert slices(list(range(10)), 3) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert slices([0, 1, 5, 6, 7], 2) == [[0, 1], [5], [6, 7]]  # a gap splits a run: one range per request
    assert sum(slices(list(range(7)), 7), []) == list(range(7))


def test_prompts_are_spread_evenly_and_come_back_in_order_with_their_seeds(servers):
    started = [servers() for _ in range(3)]
    warnings: list[str] = []
    out = _pool([u for u, _, _ in started], warnings).generate(PROMPTS, seed=1000, max_new_tokens=2,
                                                               temperature=1.0)
    assert [len(r.prompts) for _, r, _ in started] == [4, 3, 3]
    assert [r.prompts for _, r, _ in started] == [PROMPTS[:4], PROMPTS[4:7], PROMPTS[7:]]
    one_url, _, _ = servers()
    alone = _pool([one_url], warnings).generate(PROMPTS, seed=1000, max_new_tokens=2, temperature=1.0)
    assert out == alone == [{"token_ids": [p[0], (1000 + i) % 300], "logprobs": [-1.0, -2.0]} for i, p in enumerate(PROMPTS)]
    assert warnings == []


@pytest.mark.parametrize("kind, says", [("refused", "unreachable"), ("slow", "unreachable or cut off"),
                                        ("http500", "HTTP 500"), ("html", "not lmforge's server protocol"),
                                        ("short", "expected 5 completions")])
def test_a_failing_server_is_dropped_with_one_warning_and_the_others_sample_its_share(servers, kind, says):
    (good, runner, _), (bad, _, _) = servers(), servers(kind)
    warnings: list[str] = []
    pool = _pool([good, bad], warnings, timeout_s=1.0)
    out = pool.generate(PROMPTS, seed=0, max_new_tokens=2, temperature=1.0)
    assert out == [{"token_ids": [p[0], i], "logprobs": [-1.0, -2.0]} for i, p in enumerate(PROMPTS)]
    assert len(warnings) == 1 and bad in warnings[0] and says in warnings[0] and "1 left" in warnings[0], warnings
    assert "\n" not in warnings[0] and pool.urls == [good]
    assert runner.prompts == PROMPTS[:5] + PROMPTS[5:]  # its own half, then the dropped server's
    pool.generate(PROMPTS[:2], seed=0, max_new_tokens=2, temperature=1.0)
    assert len(warnings) == 1  # dropped once, never asked again


def test_with_every_server_gone_the_step_fails_with_one_line(servers):
    (a, _, sa), (b, _, _) = servers(), servers("http500")
    warnings: list[str] = []
    pool = _pool([a, b], warnings)
    sa.shutdown()
    sa.server_close()  # a server that died during the run
    with pytest.raises(UserError) as e:
        pool.generate(PROMPTS, seed=0, max_new_tokens=2, temperature=1.0)
    msg = str(e.value)
    assert msg.startswith("every rollout server failed (grpo.vllm_url)") and "\n" not in msg, msg
    assert len(warnings) == 1  # the first to fail warns; the last one's failure is the error itself


def test_a_refused_request_is_not_a_server_failing(servers):
    """A 4xx (here a wrong secret) would be refused by every server: it stops at once, nothing dropped."""
    (a, runner, _), (b, _, _) = servers(), servers()
    warnings: list[str] = []
    pool = ServerPool([ServerBackend(u, secret="another-secret-of-16-chars") for u in (a, b)], warn=warnings.append)
    with pytest.raises(UserError) as e:
        pool.generate(PROMPTS, seed=0, max_new_tokens=2, temperature=1.0)
    assert not isinstance(e.value, ServerFailure) and "HTTP 401" in str(e.value)
    assert pool.urls == [a, b] and warnings == [] and runner.prompts == []


def test_weights_load_into_every_server_and_a_failed_load_drops_it(servers, tmp_path):
    (a, ra, _), (b, rb, _), (c, _, _) = servers(), servers(), servers("http500")
    snapshot = tmp_path / "weights-00000003.safetensors"
    snapshot.write_bytes(b"x")
    warnings: list[str] = []
    pool = _pool([a, b, c], warnings)
    assert pool.load_weights(str(snapshot)) == 0.25
    assert ra.loaded == rb.loaded == [str(snapshot)] and pool.urls == [a, b] and len(warnings) == 1
    pool.require()  # two left: no error


# ----------------------------------------------------------------------------- through a GRPO run
def test_grpo_samples_through_two_servers_and_survives_one_dying(servers, tmp_path, monkeypatch, capfd):
    """A tiny GRPO run on two servers, one of which dies after the first step: the run finishes on the
    other, with one warning line, and every weight sync reached the survivor."""
    monkeypatch.setenv(server_guard.SECRET_ENV, SECRET)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Say {i}", "answer": "1"}) + "\n"
                                                    for i in range(8)))
    (a, ra, _), (b, rb, _) = servers(), servers()
    original = rb.generate

    def dies_after_first(prompts: list[list[int]], **kw: Any) -> list[dict[str, Any]]:
        if rb.prompts:
            raise RuntimeError("the engine died")  # the server answers 500
        return original(prompts, **kw)

    rb.generate = dies_after_first
    args = ["grpo", *tiny_run_args("prompts.jsonl", data_seq_len=None, training_steps=3,
                                   training_global_batch_size=4, training_micro_batch_size=4, grpo_num_generations=2,
                                   grpo_max_new_tokens=4, tasks_eval_examples=0, checkpoint_enabled=False),
            "--rewards=format", f"--run.dir={tmp_path / 'run'}", "--grpo.engine=vllm", "--grpo.vllm_mode=server",
            f"--grpo.vllm_url={a},{b}", f"--grpo.vllm_sync_dir={tmp_path}"]
    assert lmforge_in_process(*args, cwd=tmp_path) == 0
    err = capfd.readouterr().err
    warned = [line for line in err.splitlines() if b in line]
    assert len(warned) == 1 and warned[0].startswith("warning: rollout server") and "HTTP 500" in warned[0], err
    steps = [r for r in read_records(tmp_path / "run" / "metrics.jsonl") if r.get("step")]
    assert len({r["step"] for r in steps}) == 3
    assert len(rb.prompts) == 2 and len(ra.prompts) == 3 * 4 - 2  # 4 rows a step: half of step 1, then all
    assert len(ra.loaded) >= 3 and len(rb.loaded) <= len(ra.loaded)


# ------------------------------------------------------------------- vLLM's own server as a client sees it
def _openai(reply_for: Any) -> tuple[str, ThreadingHTTPServer]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            body = json.dumps(reply_for(req)).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


def test_vllm_api_completions_are_read_by_index_and_checked():
    from lmforge.rl.engines.openai_backend import VllmApiBackend

    seen: list[dict[str, Any]] = []

    def reversed_choices(req: dict[str, Any]) -> dict[str, Any]:
        seen.append(req)
        n = len(req["prompt"])
        return {"choices": [{"index": i, "token_ids": [req["prompt"][i][0], 9],
                             "logprobs": {"token_logprobs": [-0.5, -1.5]}} for i in reversed(range(n))]}

    url, server = _openai(reversed_choices)
    bad_url, bad = _openai(lambda req: {"choices": [{"index": 0, "token_ids": [1], "logprobs": None}] * 2})
    try:
        out = VllmApiBackend(url).generate([[5], [6], [7]], max_new_tokens=2, temperature=1.0, stop_ids=[2])
        assert out == [{"token_ids": [p, 9], "logprobs": [-0.5, -1.5]} for p in (5, 6, 7)]
        assert seen[0]["stop_token_ids"] == [2] and seen[0]["ignore_eos"] is True and seen[0]["logprobs"] == 0
        assert "seed" not in seen[0]  # one seed for a batch would give every sample of a prompt the same tokens
        with pytest.raises(ServerFailure, match="expected 2 choices indexed 0 to 1"):
            VllmApiBackend(bad_url).generate([[5], [6]], max_new_tokens=2, temperature=1.0)
    finally:
        for s in (server, bad):
            s.shutdown()
            s.server_close()


def test_the_engine_keys_take_several_urls_and_memory_sync_needs_a_server():
    from lmforge.config import load_config
    from lmforge.recipes.grpo import GRPOConfig

    g = load_config(GRPOConfig, None, ["--grpo.engine=vllm", "--grpo.vllm_mode=server",
                                       "--grpo.vllm_url=http://a:1, http://b:2", "--grpo.weight_sync=memory"]).grpo
    assert g.vllm_url == ["http://a:1", "http://b:2"] and g.weight_sync == "memory"
    assert load_config(GRPOConfig, None, []).grpo.vllm_url == []
    with pytest.raises((UserError, ValueError), match="grpo.weight_sync=memory sends weights to a vLLM server"):
        load_config(GRPOConfig, None, ["--grpo.engine=vllm", "--grpo.weight_sync=memory"])
