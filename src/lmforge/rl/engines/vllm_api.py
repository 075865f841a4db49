"""A rollout server that is vLLM's own OpenAI-compatible server, with lmforge's weight sync added::

    python -m lmforge.rl.engines.vllm_api --model DIR [--host 127.0.0.1] [--port 8000] [--dtype auto]
        [--seed 0] [--max-model-len N] [--weights-dir DIR] [--secret-file FILE] [-- ANY vllm serve FLAGS]

It takes and checks its arguments as :mod:`.vllm_server` does (``server_guard.check_server_arguments``: one
``error:`` line each, before vLLM loads), then
runs vLLM's API server (what ``vllm serve`` runs) in this process with: lmforge's worker extension (``--worker-extension-cls``: weight
loads inside vLLM's workers, :mod:`.vllm_worker`), lmforge's middleware (``--middleware``: the
``/lmforge/*`` endpoints and request limits, :mod:`.vllm_routes`), the shared secret as vLLM's API key
(``VLLM_API_KEY``, in the environment, not on the command line: ``ps`` shows command lines), the log-probs
of the distribution sampled from (``--logprobs-mode processed_logprobs``), no sampling defaults from the
model's ``generation_config`` (the trainer's settings are the only ones), and eager mode on a CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from lmforge.rl.engines.server_guard import SECRET_ENV, add_server_arguments, check_server_arguments

WORKER_EXTENSION = "lmforge.rl.engines.vllm_worker.WeightSync"
MIDDLEWARE = "lmforge.rl.engines.vllm_routes.LmforgeRoutes"


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 2


def vllm_argv(a: argparse.Namespace, extra: Sequence[str], cpu: bool) -> list[str]:
    """The command line of vLLM's API server (``vllm serve`` without ``serve``; no secret) for ``a``."""
    argv = ["--model", a.model, "--host", a.host, "--port", str(a.port), "--dtype", a.dtype, "--seed", str(a.seed),
            "--worker-extension-cls", WORKER_EXTENSION, "--middleware", MIDDLEWARE,
            "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", "--disable-uvicorn-access-log"]
    if a.max_model_len:
        argv += ["--max-model-len", str(a.max_model_len)]
    if cpu:
        argv += ["--enforce-eager"]
    else:
        argv += ["--gpu-memory-utilization", str(a.gpu_memory_utilization)]
    return argv + list(extra)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_arguments(p, weights_help="the only directory file weight loads are read from")
    a = p.parse_args(argv)
    try:
        secret = check_server_arguments(a)
    except ValueError as e:
        return _fail(str(e))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # see vllm_server.VllmRunner
    if secret is not None:
        os.environ[SECRET_ENV] = secret  # the middleware's
        os.environ["VLLM_API_KEY"] = secret  # vLLM's own routes
    else:
        os.environ.pop("VLLM_API_KEY", None)
    from lmforge.rl.engines.vllm_routes import WEIGHTS_DIR_ENV

    if a.weights_dir:
        os.environ[WEIGHTS_DIR_ENV] = str(Path(a.weights_dir).resolve())
    else:
        os.environ.pop(WEIGHTS_DIR_ENV, None)
    # the API server's own entry point (``vllm serve`` is the same server; its command asks for the
    # distribution named ``vllm``, which a ``vllm-cpu`` install is not)
    from vllm.entrypoints.launchers.api_server.entry import main as vllm_main
    from vllm.platforms import current_platform

    sys.argv = ["vllm-api-server", *vllm_argv(a, extra, current_platform.is_cpu())]
    vllm_main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
