"""Run under torchrun (2 ranks): one step of 3 accumulation microbatches per rank with FSDP2 or DDP,
counting the gradient reductions. Rank 0 saves the count and the full gradients (see test_distributed)."""

import sys

import torch
import torch.distributed as dist

from lmforge import distributed as dist_utils
from lmforge.runtime.world import init_distributed
from lmforge.models.model import Transformer
from lmforge.objectives.next_token import cross_entropy_loss
from lmforge.parallel.plans import data_parallel
from lmforge.training.train_step import global_target_count, gradient_computation

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _helpers import STEP_MODEL_ARGS, make_batch, split_batch  # noqa: E402

mode, out = sys.argv[1], sys.argv[2]
reductions = 0


def counted(fn):
    def wrapper(*args, **kwargs):
        global reductions
        reductions += 1
        return fn(*args, **kwargs)
    return wrapper


for name in ("reduce_scatter_tensor", "reduce_scatter_single"):  # FSDP2 calls one of them per unit
    if hasattr(dist, name):
        setattr(dist, name, counted(getattr(dist, name)))

info = init_distributed("cpu")
model = Transformer(STEP_MODEL_ARGS)
model.init_weights(seed=0)
wrapped = data_parallel(model, mode, info.device)
if mode == "ddp":
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    def counting_hook(state, bucket):
        global reductions
        reductions += 1
        return allreduce_hook(state, bucket)

    wrapped.register_comm_hook(None, counting_hook)
mine = split_batch(make_batch(n=12, t=24), 2)[info.rank]  # rank r takes its contiguous half of the batch
gradient_computation(wrapped, [mine], cross_entropy_loss, global_target_count([mine]))
one_microbatch = reductions  # what one step's gradients need: one per FSDP unit or DDP bucket
model.zero_grad(set_to_none=True)
reductions = 0
micro = split_batch(mine, 3)  # the same step, accumulated over 3 microbatches
gradient_computation(wrapped, micro, cross_entropy_loss, global_target_count(micro))
grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
if info.rank == 0:
    torch.save({"one_microbatch": one_microbatch, "three_microbatches": reductions, "grads": grads}, out)
dist_utils.shutdown()
