"""Run under torchrun, 4 ranks on the mesh pp=2 x dp_shard=2: pipeline parallelism against one process
(see test_pipeline.py). One launch, two parts:

* plain pipelines: each pp pair runs 1F1B, GPipe and interleaved 1F1B (2 stages per rank) over the same
  4 microbatches of a packed batch, then 1F1B again on another shape (also under bf16 autocast);
  pipeline eval; the gradient norm;
* FSDP2 on each stage over dp_shard, each data rank its half of the batch.

Every rank also runs the one-process reference itself (the whole model, ``gradient_computation`` over
the whole step's microbatches, no collective) and compares its own parameters' gradients by name;
rank 0 writes the largest relative errors, the flags and the counts to argv[1].
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lmforge import distributed as dist_utils
from lmforge.runtime.world import init_distributed
from lmforge.data.packing import IGNORE_INDEX, Batch
from lmforge.models.model import ModelArgs, Transformer
from lmforge.objectives.next_token import cross_entropy_loss
from lmforge.parallel.pipeline import Pipeline, split_model
from lmforge.parallel.pipeline_step import (pipeline_clip_grad_norm_, pipeline_eval_forward,
                                            pipeline_gradient_computation)
from lmforge.losses.stats import accumulate
from lmforge.training.train_step import global_target_count, gradient_computation

ARGS = ModelArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32)
out = sys.argv[1]
info = init_distributed("cpu")
world = info.world_size
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp_shard")
pp_group = mesh.get_group("pp")
results: dict[str, float] = {}


def packed_microbatches(n: int, rows: int, t: int, seed: int) -> list[Batch]:
    """``n`` microbatches of ``rows`` packed rows: documents of random lengths, positions restarting at
    each, targets ignored at each document's last token and at random places."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, ARGS.vocab_size, (rows, t + 1), generator=g)
        labels = ids[:, 1:].clone()
        docs = torch.zeros(rows, t, dtype=torch.long)
        pos = torch.zeros(rows, t, dtype=torch.long)
        for r in range(rows):
            start, d = 0, 0
            while start < t:
                length = int(torch.randint(2, 8, (1,), generator=g))
                docs[r, start:start + length], pos[r, start:start + length] = d, torch.arange(min(length, t - start))
                labels[r, min(start + length, t) - 1] = IGNORE_INDEX
                start, d = start + length, d + 1
        labels[torch.rand(rows, t, generator=g) < 0.2] = IGNORE_INDEX
        out.append(Batch(ids[:, :-1], labels, pos, docs))
    return out


def reference(microbatches: list[Batch], autocast=None) -> tuple[dict[str, torch.Tensor], dict]:
    """Gradients by name and summed statistics of the whole model in this process alone."""
    model = Transformer(ARGS)
    model.init_weights(seed=0)
    n = sum(int(mb.num_targets) for mb in microbatches)
    # gradient_computation scales by the world size: a normalizer world x the count gives 1 / count exactly
    stats = gradient_computation(model, microbatches, cross_entropy_loss, torch.tensor(float(n * world)), autocast)
    return {k: p.grad for k, p in model.named_parameters()}, stats


def fresh_pipeline(pp_rank: int, pp: int, per_rank: int, group, schedule: str, fsdp_mesh=None) -> Pipeline:
    model = Transformer(ARGS)
    model.init_weights(seed=0)  # the whole model first, then the split: the one-process weights
    parts = split_model(model, pp_rank, pp, per_rank)
    if fsdp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for part in parts:
            for block in part.layers:
                if block is not None:
                    fully_shard(block, mesh=fsdp_mesh)
            fully_shard(part, mesh=fsdp_mesh)
    return Pipeline(parts, group, info.device, schedule)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((full(a).float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12))


def compare(name: str, pipeline: Pipeline, ref: dict[str, torch.Tensor]) -> None:
    """Largest relative gradient error over this rank's parameters (by name) and how many it compared."""
    errs = [rel(p.grad, ref[k]) for part in pipeline.parts for k, p in part.named_parameters()]
    results[f"{name}/grad"] = max(errs)
    results[f"{name}/params"] = len(errs)


def compare_stats(name: str, stats, ref_stats, data_group=None) -> None:
    """The pipeline's statistics (sent from the last stage to every rank of the pipeline), summed over the
    data ranks when there are several, vs the reference."""
    def total(t):
        t = t.float().clone()
        if data_group is not None:
            dist.all_reduce(t, group=data_group)
        return t

    for key in ("loss_sum", "target_tokens"):
        results[f"{name}/{key}"] = rel(total(getattr(stats, key)), getattr(ref_stats, key))
    results[f"{name}/correct"] = rel(total(stats.sums["correct"]), ref_stats.sums["correct"])


def plain_pipelines() -> None:
    """The two pp pairs run the same step side by side, without a data-parallel wrapper."""
    group = pp_group
    micro = packed_microbatches(4, 2, 12, seed=1)
    ref, ref_stats = reference(micro)
    for schedule, per_rank in (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2)):
        pipe = fresh_pipeline(pp_rank, 2, per_rank, group, schedule)
        if schedule == "1f1b":  # a normalizer all-reduced over every rank (4 x the count), scaled by the world
            stats = pipeline_gradient_computation(pipe, micro, cross_entropy_loss, global_target_count(micro), None,
                                                  scale_world=world)
        else:
            n = torch.tensor(float(sum(int(mb.num_targets) for mb in micro)))
            stats = pipeline_gradient_computation(pipe, micro, cross_entropy_loss, n, None, scale_world=1)
        compare(schedule, pipe, ref)
        compare_stats(schedule, stats, ref_stats)
        results[f"{schedule}/stats_keys_match"] = float(sorted(stats.sums) == sorted(ref_stats.sums))
        if schedule == "1f1b":
            norm = pipeline_clip_grad_norm_(pipe, 0.0)
            results["1f1b/grad_norm"] = rel(norm, torch.nn.utils.get_total_norm(list(ref.values())))
            # a second step of another shape rebuilds the stages (gradients accumulate onto the first's)
            for part in pipe.parts:
                part.zero_grad(set_to_none=True)
            other = packed_microbatches(2, 3, 10, seed=2)
            n = torch.tensor(float(sum(int(mb.num_targets) for mb in other)))
            pipeline_gradient_computation(pipe, other, cross_entropy_loss, n, None, scale_world=1)
            compare("1f1b_reshaped", pipe, reference(other)[0])
            # bf16 autocast: the stages' forwards run under it, as the one-process forward does
            for part in pipe.parts:
                part.zero_grad(set_to_none=True)
            bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
            pipeline_gradient_computation(pipe, other, cross_entropy_loss, n, bf16, scale_world=1)
            compare("1f1b_bf16", pipe, reference(other, bf16)[0])
            # eval: batches of two shapes, forward only
            evals = packed_microbatches(3, 2, 12, seed=3) + packed_microbatches(1, 1, 12, seed=4)
            got = pipeline_eval_forward(pipe, evals, cross_entropy_loss)
            with torch.no_grad():
                model = Transformer(ARGS)
                model.init_weights(seed=0)
                want = None
                for b in evals:
                    want = accumulate(want, cross_entropy_loss(model, b)[1])
            compare_stats("eval", got, want)
        if schedule == "interleaved_1f1b":
            # the stages' state dicts use the whole model's names and together cover it exactly once
            names = [k for part in pipe.parts for k in part.state_dict()]
            gathered = [None] * 2
            dist.all_gather_object(gathered, names, group=group)
            flat = [k for g in gathered for k in g]
            results["state_dict_cover"] = float(sorted(flat) == sorted(Transformer(ARGS).state_dict()))


def fsdp_stages() -> None:
    """FSDP2 on each stage over dp_shard: each data rank its half of the batch."""
    micro = packed_microbatches(4, 2, 12, seed=5)
    ref, ref_stats = reference(micro)
    mine = micro[2 * dp_rank: 2 * dp_rank + 2]  # this data rank's half, the same on both pp ranks
    n = torch.tensor(float(sum(int(mb.num_targets) for mb in mine)))
    dist.all_reduce(n, group=mesh.get_group("dp_shard"))  # counted over the data ranks only
    pipe = fresh_pipeline(pp_rank, 2, 1, pp_group, "1f1b", fsdp_mesh=mesh["dp_shard"])
    stats = pipeline_gradient_computation(pipe, mine, cross_entropy_loss, n, None, scale_world=2)
    compare("fsdp", pipe, ref)
    compare_stats("fsdp", stats, ref_stats, mesh.get_group("dp_shard"))
    norm = pipeline_clip_grad_norm_(pipe, 0.0)
    results["fsdp/grad_norm"] = rel(norm, torch.nn.utils.get_total_norm(list(ref.values())))
    clipped = pipeline_clip_grad_norm_(pipe, 0.5 * float(norm))  # clipping to half: every gradient halves
    results["fsdp/clip"] = max(rel(p.grad, 0.5 * ref[k]) for part in pipe.parts for k, p in part.named_parameters())
    results["fsdp/clip_returns_preclip"] = rel(clipped, norm)


plain_pipelines()
fsdp_stages()
gathered = [None] * world
dist.all_gather_object(gathered, results)
if info.rank == 0:
    merged: dict[str, float] = {}
    for r in gathered:
        for k, v in r.items():
            if k.endswith("/params"):  # parameters compared, summed over ranks
                merged[k] = merged.get(k, 0) + v
            elif k.endswith(("match", "cover")):  # flags: every rank must agree
                merged[k] = min(merged.get(k, v), v)
            else:  # errors: the largest
                merged[k] = max(merged.get(k, v), v)
    with open(out, "w") as f:
        json.dump(merged, f, indent=1)
dist_utils.shutdown()
