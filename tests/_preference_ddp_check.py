"""Run under torchrun: one step of each preference method (KTO, ORPO, SimPO) over 2 DDP ranks, each
rank half the rows in 2 microbatches; rank 0 saves gradients and logged values (test_preference_methods)."""

import sys
from pathlib import Path

import torch

from lmforge import distributed as dist_utils
from lmforge.runtime.world import init_distributed
from lmforge.data.packing import collate
from lmforge.parallel.plans import data_parallel

sys.path.insert(0, str(Path(__file__).parent))
from _pairs import Reference, grads_and_values, row_sample, tiny_model  # noqa: E402
from test_preference_methods import method_batch, method_objective  # noqa: E402

info = init_distributed("cpu")
out = {}
work = Path(sys.argv[1]).parent / f"rank{info.rank}"
work.mkdir(exist_ok=True)
for name in ("kto", "orpo", "simpo"):
    policy, ref_model = tiny_model(1), tiny_model(2).requires_grad_(False)
    ddp = data_parallel(policy, "ddp", info.device)
    batch = method_batch(name, work)
    rows = list(range(batch.input_ids.shape[0]))
    mine = rows[info.rank::2]
    micro = [collate([row_sample(batch, i) for i in part]) for part in (mine[:1], mine[1:])]
    objective = method_objective(name, ddp, Reference(ref_model))
    grads, values = grads_and_values(ddp, objective, micro)
    out[name] = {"grads": {k.removeprefix("module."): g for k, g in grads.items()},
                 "values": {k: float(v) for k, v in values.items()}}
if info.rank == 0:
    torch.save(out, sys.argv[1])
dist_utils.shutdown()
