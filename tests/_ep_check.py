"""Run under torchrun (4 gloo ranks): expert parallelism against one process (test_expert_parallel.py).

Every rank builds the same models and the global inputs, runs its own share with EP, and runs the
one-process reference on them itself; any mismatch is an AssertionError (non-zero exit).

* One MoE layer on each pair of ranks (ep=2, no further data sharding): outputs, input and
  parameter gradients, and the summed router statistics, in three routings: one rank's tokens
  never pick expert 3; every token picks experts 0 and 1 (the rank owning 2 and 3 receives
  nothing; with the per-expert loop, which cannot run on no rows); top-1 with every token on expert 2.
* The whole MoE Transformer, experts sharded by :func:`shard_experts` and the rest by FSDP2 over
  the flattened ``dp_shard``, two microbatches per rank against one process on the whole batch:
  loss, router statistics, every gradient (gathered) and the clipped norm. First on each pair
  (``dp_shard=2 = ep``: mesh ``dp_shard_mod_ep=1 x ep=2``, experts' divide by FSDP over one rank),
  then on all 4 (``dp_shard_mod_ep=2 x ep=2``, blocks activation-checkpointed, the train step's
  ``gradient_computation`` itself).
"""

import copy
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lmforge.models.configs import MLPConfig, MoEConfig, RouterConfig
from lmforge import distributed as dist_utils
from lmforge.runtime.world import init_distributed
from lmforge.data.packing import Batch
from lmforge.models.layers.moe import MoEFeedForward
from lmforge.models.model import ModelArgs, Transformer
from lmforge.objectives.next_token import cross_entropy_loss
from lmforge.parallel.expert_parallel import apply_ep, clip_grad_norm, moe_layers, shard_experts
from lmforge.parallel.plans import apply_activation_checkpointing, apply_fsdp
from lmforge.training.train_step import gradient_computation, global_target_count

TINY_MOE = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, max_seq_len=64, n_experts=4,
                     n_experts_per_token=2, moe_ffn_dim=32)
"""The shape of test_moe.py's tiny Mixtral: 4 experts, top-2, every layer MoE."""
TOL = dict(rtol=1e-5, atol=1e-6)


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}: {m}")


def routing_totals(modules: list[MoEFeedForward], group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Per layer: prob_sum, counts, z_sum, tokens, summed over the ranks of ``group`` (None: no reduction)."""
    out = []
    for m in modules:
        s = m.last_routing
        t = torch.cat([s.prob_sum.detach(), s.counts, s.z_sum.detach().view(1), torch.tensor([float(s.tokens)])])
        if group is not None:
            dist.all_reduce(t, group=group)
        out.append(t)
    return out


def layer_case(ep_mesh, seed: int, top_k: int, bias: dict[int, float], biased_rank: int | None,
               impl: str = "auto") -> torch.Tensor:
    """One MoE layer, ep=2 over ``ep_mesh``; router logits = the first 4 input features, shifted by
    ``bias`` (expert -> shift) on the tokens of ``biased_rank`` (None: all tokens)."""
    group, rank, size = ep_mesh.get_group(), ep_mesh.get_local_rank(), ep_mesh.size()
    dim, per_rank = 16, 6
    torch.manual_seed(seed)
    ref = MoEFeedForward(MoEConfig(dim, RouterConfig(4, top_k, norm_topk=True), MLPConfig(dim, 24)))
    ref.experts.impl = impl
    with torch.no_grad():
        ref.router.weight.copy_(torch.eye(4, dim) * 2)
    x = torch.randn(size * per_rank, dim)
    rows = slice(None) if biased_rank is None else slice(biased_rank * per_rank, (biased_rank + 1) * per_rank)
    for e, shift in bias.items():
        x[rows, e] += shift
    g = torch.randn(size * per_rank, dim)
    n = x.shape[0]
    ep = copy.deepcopy(ref)
    apply_ep(ep, ep_mesh)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)

    x_ref = x.clone().requires_grad_(True)
    out_ref = ref(x_ref)
    (out_ref * g).sum().div(n).backward()
    x_ep = x[mine].clone().requires_grad_(True)
    out_ep = ep(x_ep)
    (out_ep * g[mine]).sum().mul(size / n).backward()  # the train step's scale, W = size

    what = f"layer case seed={seed} top{top_k} bias={bias}"
    close(out_ep, out_ref[mine], f"{what} output")
    close(x_ep.grad / size, x_ref.grad[mine], f"{what} input grad")
    close(routing_totals([ep], group)[0], routing_totals([ref])[0], f"{what} routing statistics")
    router_grad = ep.router.weight.grad.clone()
    dist.all_reduce(router_grad, group=group)
    close(router_grad / size, ref.router.weight.grad, f"{what} router grad")  # data-parallel average
    for name in ("w1", "w2", "w3"):
        got = getattr(ep.experts, name).grad.full_tensor() / size  # sum over the 1 holder, divided by W
        close(got, getattr(ref.experts, name).grad, f"{what} experts.{name} grad")
    return ep.last_routing.counts.view(1, -1)  # this rank's slots per expert


def layer_checks(ep_mesh, group_index: int) -> None:
    base = 10 * group_index
    counts = layer_case(ep_mesh, base + 1, 2, {3: -8.0}, biased_rank=0)
    if ep_mesh.get_local_rank() == 0:
        assert counts[0, 3] == 0, counts  # an expert with no token from this rank
    counts = layer_case(ep_mesh, base + 2, 2, {0: 8.0, 1: 8.0}, biased_rank=None, impl="loop")
    assert counts[0, 2:].sum() == 0, counts  # the owner of experts 2 and 3 receives nothing
    counts = layer_case(ep_mesh, base + 3, 1, {2: 8.0}, biased_rank=None)
    assert counts[0].tolist() == [0, 0, 6, 0], counts  # all on one expert: rank 0 idle


def batch(n: int, t: int = 16, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY_MOE.vocab_size, (n, t + 1), generator=g)
    labels = ids[:, 1:].clone()
    for i in range(n):
        labels[i, : i % 5] = -100  # uneven target counts
    return Batch(input_ids=ids[:, :-1], labels=labels, position_ids=None, document_ids=None)


def rows(b: Batch, lo: int, hi: int) -> Batch:
    return Batch(b.input_ids[lo:hi], b.labels[lo:hi], None, None)


def plain_name(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def group_step(model, micro: list[Batch], group: dist.ProcessGroup, world: int) -> torch.Tensor:
    """``gradient_computation`` within a group of ``world`` ranks (that one reads the whole world):
    objective x world / the group's target count, gradients synced on the last microbatch only.
    Returns the group's mean loss."""
    targets = torch.stack([mb.num_targets for mb in micro]).sum().float()
    dist.all_reduce(targets, group=group)
    loss_sum = torch.zeros(())
    for i, mb in enumerate(micro):
        model.set_requires_gradient_sync(i == len(micro) - 1)
        objective, stats = cross_entropy_loss(model, mb)
        (objective * world / targets).backward()
        loss_sum += stats.loss_sum.detach()
    dist.all_reduce(loss_sum, group=group)
    return loss_sum / targets


def model_check(mesh, seed: int) -> None:
    """The MoE Transformer on ``mesh`` (dims ``dp_shard_mod_ep``, ``ep``, maybe an outer ``group`` of
    independent copies) against one process on the tokens of the ranks of this copy."""
    dp_mesh = mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
    world, rank, whole = dp_mesh.size(), dp_mesh.get_local_rank(), dp_mesh.size() == dist.get_world_size()
    model = Transformer(TINY_MOE)
    model.init_weights(seed=0)
    with torch.no_grad():  # decisive routers: no near-tie for a rounding difference to flip
        for m in moe_layers(model):
            m.router.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(model)

    apply_ep(model, mesh["ep"])
    if whole:
        apply_activation_checkpointing(model)
    shard_experts(model, mesh["dp_shard_mod_ep"], world)
    apply_fsdp(model, dp_mesh, torch.device("cpu"))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["layers.0.feed_forward.experts.w1"] == (4, 32, 64), shapes  # full [E, ...] in the state dict

    full = batch(4 * world, seed=seed)
    per_rank = full.input_ids.shape[0] // world
    mine = rows(full, rank * per_rank, (rank + 1) * per_rank)
    micro = [rows(mine, 0, per_rank // 2), rows(mine, per_rank // 2, per_rank)]
    if whole:  # the train step itself
        stats = gradient_computation(model, micro, cross_entropy_loss, global_target_count(micro))
        loss = stats.global_totals()["loss"]
    else:
        loss = group_step(model, micro, dp_mesh.get_group(), world)
    got_routing = routing_totals(moe_layers(model), dp_mesh.get_group())  # of the last microbatch

    ref_loss, ref_stats = cross_entropy_loss(ref, full)
    ref_loss.div(ref_stats.loss_weight).backward()
    last_micro = torch.cat([torch.arange(r * per_rank + per_rank // 2, (r + 1) * per_rank) for r in range(world)])
    with torch.no_grad():
        ref(full.input_ids[last_micro])  # the reference's statistics of the same tokens
    what = f"model on {mesh}"
    close(loss, ref_stats.loss_sum / ref_stats.loss_weight, f"{what}: loss")
    for a, b in zip(got_routing, routing_totals(moe_layers(ref))):
        close(a, b, f"{what}: routing statistics")

    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    seen = set()
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        close(grad, ref_grads[plain_name(name)], f"{what}: grad of {plain_name(name)}")
        seen.add(plain_name(name))
    assert seen == set(ref_grads), set(ref_grads) ^ seen
    close(clip_grad_norm(model.parameters(), 0.5), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5),
          f"{what}: gradient norm")
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        close(grad, ref_grads[plain_name(name)], f"{what}: clipped grad of {plain_name(name)}")


def main() -> None:
    info = init_distributed("cpu")
    world, rank = info.world_size, info.rank
    pairs = init_device_mesh("cpu", (world // 2, 1, 2), mesh_dim_names=("group", "dp_shard_mod_ep", "ep"))
    layer_checks(pairs["ep"], pairs.get_local_rank("group"))
    model_check(pairs, seed=pairs.get_local_rank("group"))  # ep=2 = dp_shard: each pair on its own
    if world > 2:
        model_check(init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard_mod_ep", "ep")), seed=9)
    if rank == 0:
        print(f"ep check passed on {world} ranks")
    dist_utils.shutdown()


if __name__ == "__main__":
    sys.exit(main())
