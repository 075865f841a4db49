"""Run under torchrun: DDP gradients of one step over 2 ranks, saved by rank 0 (see test_train_step)."""

import sys

import torch

from lmforge import distributed as dist_utils
from lmforge.runtime.world import init_distributed
from lmforge.models.model import Transformer
from lmforge.objectives.next_token import cross_entropy_loss
from lmforge.parallel.plans import data_parallel
from lmforge.training.train_step import global_target_count, gradient_computation

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _helpers import STEP_MODEL_ARGS, make_batch, split_batch  # noqa: E402

info = init_distributed("cpu")
model = Transformer(STEP_MODEL_ARGS)
model.init_weights(seed=0)
ddp = data_parallel(model, "ddp", info.device)
mine = split_batch(make_batch(), 2)[info.rank]  # rank r takes its contiguous half of the global batch
micro = split_batch(mine, 2)                    # and accumulates over 2 microbatches
gradient_computation(ddp, micro, cross_entropy_loss, global_target_count(micro))
if info.rank == 0:
    torch.save([p.grad for p in model.parameters()], sys.argv[1])
dist_utils.shutdown()
