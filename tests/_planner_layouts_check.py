"""Run under torchrun, 2 ranks: each rank's peak of live tensor memory in a real train step at tp=2, then
at pp=2 (lmforge.planning.layout_probe); rank 0 writes the largest rank's peak per layout to argv[1]
as JSON (see test_planner_layouts.py, which holds the planner's estimate against it)."""

import json
import sys

import torch
import torch.distributed as dist

from lmforge.runtime.world import init_distributed
from lmforge.models.args import model_args_for
from lmforge.planning.layout_probe import measure_layout_step
from lmforge.parallel.dims import ParallelDims

torch.set_num_threads(1)
init_distributed("cpu")
args = model_args_for("debug", 320, **json.loads(sys.argv[2]))
shape = json.loads(sys.argv[3])
out = {}
for name, layout in (("tp=2", ParallelDims.of(tp=2)), ("pp=2", ParallelDims.of(pp=2))):
    m = measure_layout_step(args, layout, **shape)
    peaks: list = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, m.peak)
    out[name] = max(peaks)
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
dist.destroy_process_group()
