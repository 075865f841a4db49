"""The planner's per-device estimate against each rank's measured peak of a real train step laid out over
a 2-rank mesh (tensor and pipeline parallel): one torchrun launch."""

from __future__ import annotations

import json
import subprocess
import sys

from _helpers import REPO, cli_env
from lmforge.models.args import model_args_for
from lmforge.parallel.dims import ParallelDims
from lmforge.planning.planner import estimate_memory

SHAPE = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=128)
STEP = dict(seq_len=128, micro_batch=4, microbatches=2, dtype="float32")


def test_estimate_matches_each_ranks_peak_at_tp_and_pp(tmp_path):
    """Within 15% (bench/plan_memory_layouts.py: 0.97-1.07 of the measured peak on the debug and small
    shapes, tp=2 within 4%). At tp=2 the projections, the vocabulary and (sequence parallel) the norms are split: the estimate
    of an unsplit model is 75% over this peak, so a planner that misses the split fails here."""
    out = tmp_path / "peaks.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--monitor-interval=0.2", str(REPO / "tests" / "_planner_layouts_check.py"), str(out),
           json.dumps(SHAPE), json.dumps(STEP)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=cli_env({"OMP_NUM_THREADS": "1"}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(out.read_text())
    args = model_args_for("debug", 320, **SHAPE)
    est = {name: estimate_memory(args, layout, STEP["seq_len"], STEP["micro_batch"], STEP["dtype"],
                                 microbatches=STEP["microbatches"], device="cpu").total
           for name, layout in (("tp=2", ParallelDims.of(tp=2)), ("pp=2", ParallelDims.of(pp=2)))}
    for name in est:
        assert abs(est[name] / measured[name] - 1) < 0.15, (name, est[name], measured[name])
    one = estimate_memory(args, ParallelDims.of(), STEP["seq_len"], STEP["micro_batch"], microbatches=2).total
    assert one / measured["tp=2"] > 1.3
