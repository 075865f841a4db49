"""Where the real SmolLM2-135M SFT step's time goes: torch.profiler over ``lmforge sft``'s own steps.

    python bench/sft_step_profile.py                         # fp32, steps 3-4 profiled
    python bench/sft_step_profile.py --dtype bfloat16 --rows 30

The run is the CLI's (``lmforge sft``, in this process) on the same weights, chats and shape as
``bench/sft_real_throughput.py`` (8 x 256 packed tokens a step, 2 threads); the profiler starts at
the third step's gradient computation, after the warm-up steps, and stops after the last step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import loadavg, machine  # noqa: E402
from sft_real_throughput import DATA, ROWS, SEQ, TOKENIZER, gguf_path  # noqa: E402
from step_profile import print_profile  # noqa: E402

import lmforge.training.loop as loop  # noqa: E402
from lmforge.cli import main as cli_main  # noqa: E402

WARMUP = 2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    p.add_argument("--steps", type=int, default=2, help="profiled steps (after 2 warm-up steps)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, default=25)
    a = p.parse_args()
    print(f"{machine(torch.device('cpu'))}; {a.threads} threads; load {loadavg()}")
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    original, calls = loop.gradient_computation, [0]

    def gradient_computation(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls[0] += 1
        if calls[0] == WARMUP + 1:
            prof.start()
        return original(*args, **kwargs)

    loop.gradient_computation = gradient_computation
    with tempfile.TemporaryDirectory() as run_dir:
        cli_main(["sft", f"--model.from_hf={gguf_path()}", f"--model.tokenizer={TOKENIZER}",
                  f"--data.train={DATA}", f"--data.validation={DATA}", f"--data.seq_len={SEQ}",
                  f"--training.global_batch_size={ROWS}", f"--training.micro_batch_size={ROWS}",
                  f"--training.steps={WARMUP + a.steps}", f"--training.dtype={a.dtype}",
                  f"--training.threads={a.threads}", "--eval.interval=0", "--eval.at_start=false",
                  "--checkpoint.enabled=false", "--metrics.log_every=1", "--metrics.tensorboard=false",
                  "--metrics.progress=off", f"--run.dir={run_dir}"])
    prof.stop()
    print_profile(prof, a.steps, a.rows)
    print(f"load after: {loadavg()}")


if __name__ == "__main__":
    main()
