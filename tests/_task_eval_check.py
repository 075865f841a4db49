"""Run under torchrun (2 ranks): held-out exact match with the model wrapped for DDP or FSDP2, each rank
decoding its share. Rank 0 writes the scores of two evals, before and after a training forward and
backward (FSDP2 must gather and free the parameters again), to OUT (see test_grpo_distributed)."""

import json
import sys

import torch

from lmforge import distributed as dist_utils
from lmforge.runtime.world import init_distributed
from lmforge.data.tasks import TaskExample
from lmforge.evaluation.tasks import task_accuracy
from lmforge.models.args import model_args_for
from lmforge.models.model import Transformer
from lmforge.models.tokenizer import ByteTokenizer
from lmforge.parallel.plans import data_parallel

mode, examples_file, out = sys.argv[1], sys.argv[2], sys.argv[3]
info = init_distributed("cpu")
torch.set_num_threads(1)
tok = ByteTokenizer()
model = Transformer(model_args_for("debug", tok.vocab_size, dim=64, n_layers=2))
model.init_weights(seed=0)
wrapped = data_parallel(model, mode, info.device)
examples = [TaskExample(**e) for e in json.loads(open(examples_file).read())]
scores = []
for _ in range(2):
    with dist_utils.full_parameters(model) as m:
        scores.append(task_accuracy(m, tok, examples, max_new_tokens=8, batch_size=2, rank=info.rank,
                                    world_size=info.world_size))
    wrapped(torch.randint(0, tok.vocab_size, (2, 8))).float().mean().backward()
if info.rank == 0:
    open(out, "w").write(json.dumps(scores))
dist_utils.shutdown()
