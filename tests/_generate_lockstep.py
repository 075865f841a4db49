"""Run under torchrun (2 CPU ranks): generate(lockstep=True) vs lockstep=False on each rank.

The ranks get different prompts and one stop id that ends rank 0's rows within a few steps
while rank 1's rows never emit it. Each rank writes its outputs and its count of decode steps
(model forward calls after the prefill) with and without lockstep to ``OUT_DIR/rank{r}.json``.
"""

import json
import sys
from pathlib import Path

import torch

import lmforge.models.generate as gen
from lmforge import distributed as dist_utils
from lmforge.runtime.world import init_distributed
from lmforge.models.model import ModelArgs, Transformer

NEW = 24

info = init_distributed("cpu")
model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=101, max_seq_len=128))
model.init_weights(seed=0)
with torch.no_grad():
    for p in model.parameters():
        if p.dim() == 2:
            p.mul_(4.0)  # peaked logits: greedy paths are not decided by float noise

# Both ranks search the same prompts: rank 0's first tokens are the stop ids; rank 1 needs rows
# that never emit one of them.
g = torch.Generator().manual_seed(0)
candidates = [torch.randint(1, 101, (int(n),), generator=g).tolist() for n in torch.randint(2, 12, (64,), generator=g)]
free = gen.generate(model, candidates, NEW, pad_id=0, temperature=0.0)
rank0 = candidates[:2]
stops = sorted({free[0][0], free[1][1]})
rank1 = [p for p, f in zip(candidates[2:], free[2:]) if not set(f) & set(stops)][:3]
assert len(rank1) == 3, "no prompts that avoid the stop ids"
prompts = rank0 if info.rank == 0 else rank1

calls = [0]
step = gen.decode_step


def counting_step(*args, **kwargs):
    calls[0] += 1
    return step(*args, **kwargs)


gen.decode_step = counting_step
result = {}
for lockstep in (False, True):
    calls[0] = 0
    greedy = gen.generate(model, prompts, NEW, stop_ids=stops, pad_id=0, temperature=0.0, lockstep=lockstep)
    result[f"steps_{lockstep}"] = calls[0]
    result[f"greedy_{lockstep}"] = greedy
    sampled = gen.generate(model, prompts, NEW, stop_ids=stops, pad_id=0, temperature=1.0, lockstep=lockstep,
                           generator=torch.Generator().manual_seed(info.rank))
    result[f"sampled_{lockstep}"] = sampled
Path(sys.argv[1], f"rank{info.rank}.json").write_text(json.dumps(result))
dist_utils.shutdown()
