"""GRPO on the real SmolLM2-135M-Instruct with asynchronous sampling, whole rounds vs partial rollouts.

    python bench/partial_rollouts.py                 # 6 steps per system, steps 3-6 timed
    python bench/partial_rollouts.py --async-steps 3 --steps 8

The setting of ``bench/rollout_engines.py`` (embedded ``add`` prompts, 8 x 8 completions of up to 48 tokens,
``grpo.tis_cap=2``, lmforge's engine) with ``grpo.async_steps = k``, once sampling whole rounds and once with
``grpo.partial_rollouts`` (each round in k segments, one segment of every round in flight per update).
Per system: seconds per step (median wall time between step records), seconds the step waited for its
rollout (``rollout/seconds``: the wait for the sampler plus the layout), the per-token staleness (mean of
``rollout/token_staleness_mean``, and the largest ``_max``) and the mean reward, all over the timed steps.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved, loadavg, machine, markdown_table, median  # noqa: E402
import rollout_engines  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--timed-from", type=int, default=3, help="first timed step (earlier ones warm up)")
    p.add_argument("--async-steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    a = p.parse_args()
    k = a.async_steps
    rollout_engines.SYSTEMS.update({
        f"async-{k}": (sys.executable, {"grpo.async_steps": k}),
        f"async-{k}-partial": (sys.executable, {"grpo.async_steps": k, "grpo.partial_rollouts": "true"}),
    })
    names = [f"async-{k}", f"async-{k}-partial"]
    work = Path(tempfile.mkdtemp(prefix="partial_rollouts_"))
    model = rollout_engines.hf_dir(work)
    per: dict[str, dict[str, list[float]]] = {n: {"wall": [], "wait": [], "lag": [], "lag_max": [], "reward": []}
                                             for n in names}
    for _, name in interleaved(names, a.repeats):
        recs = rollout_engines.run(name, model, a.steps, work, a.dtype)
        for prev, r in zip(recs, recs[1:]):
            if r["step"] >= a.timed_from:
                per[name]["wall"].append(r["time"] - prev["time"])
                per[name]["wait"].append(r["rollout/seconds"])
                per[name]["lag"].append(r["rollout/token_staleness_mean"])
                per[name]["lag_max"].append(r["rollout/token_staleness_max"])
                per[name]["reward"].append(r["reward/mean"])
        print(name, {n: round(median(v), 3) for n, v in per[name].items() if v}, flush=True)
    rows = [[n, f"{median(per[n]['wall']):.2f}", f"{median(per[n]['wait']):.2f}",
             f"{sum(per[n]['lag']) / len(per[n]['lag']):.2f}", f"{max(per[n]['lag_max']):.0f}",
             f"{sum(per[n]['reward']) / len(per[n]['reward']):.3f}"] for n in names]
    table = markdown_table(["system", "s/step", "rollout wait s/step", "token staleness mean", "max", "mean reward"], rows)
    print(f"\n{machine(__import__('torch').device('cpu'))}, {datetime.date.today()}, load {loadavg()}, "
          f"training.dtype={a.dtype}\n\n{table}")


if __name__ == "__main__":
    main()
