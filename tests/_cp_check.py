"""Run under torchrun with 4 CPU ranks (see test_context_parallel): context parallelism against one process.

The mesh is ``dp_shard=2 x cp=2``. Part 1, on each cp pair without any wrapper: a packed batch
(several documents per row, per-document positions), a plain causal batch and a Gemma-3-like model
with sliding and full layers (once more with pieces of 3 tokens on the matmul blocks); the cp ranks' summed loss, their hidden states put back in row order
and their gradients summed over the pair equal one process's on the whole batch. Part 2: FSDP2 over
the flattened ``(dp_shard, cp)`` mesh, with activation checkpointing, and the train step's ``gradient_computation`` over two
microbatches per rank; the full gradients equal one process's over the global batch. Rank 0 writes
the largest relative errors to ``argv[1]`` (the test asserts on them); any rank raises on a mismatch.
"""

import dataclasses
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lmforge import distributed as dist_utils
from lmforge.runtime.world import init_distributed
from lmforge.data.packing import IGNORE_INDEX, Batch
from lmforge.models.layers import blockwise_attention as blockwise
from lmforge.models.args import ModelArgs
from lmforge.models.model import Transformer
from lmforge.objectives.next_token import cross_entropy_loss
from lmforge.parallel.context_parallel import apply_cp, shard_batch, unshard_tokens
from lmforge.parallel.plans import apply_activation_checkpointing, apply_fsdp
from lmforge.training.train_step import global_target_count, gradient_computation

T = 16
LLAMA = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32)
GEMMA3 = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=1, head_dim=16, vocab_size=64, max_seq_len=32,
                   sliding_window=5, layer_types=["sliding_attention", "full_attention"], local_rope_theta=100.0,
                   rope_theta=10_000.0, qk_norm=True, sandwich_norm=True, norm_unit_offset=True, embed_scale=True,
                   hidden_act="gelu_tanh", attn_scale=0.3, tie_embeddings=True)


def plain_batch(rows: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (rows, T + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[:, :3] = IGNORE_INDEX  # e.g. a prompt
    return Batch(ids[:, :-1], labels)


def packed_batch(rows: int, seed: int) -> Batch:
    """Documents of 5, 7 and 4 tokens in each row (the 7 crosses both chunk boundaries of a cp rank);
    document ids repeat across rows and id 0 comes back at the end (a run, not the value, is a document)."""
    b = plain_batch(rows, seed)
    lengths = [5, 7, 4]
    docs = torch.cat([torch.full((n,), i % 2, dtype=torch.long) for i, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    ends = torch.tensor(lengths).cumsum(0) - 1
    b.labels[:, ends] = IGNORE_INDEX  # no target across a document boundary
    return Batch(b.input_ids, b.labels, pos.repeat(rows, 1), docs.repeat(rows, 1),
                 document_lengths=[lengths] * rows)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


def check(name: str, got: torch.Tensor, want: torch.Tensor, errors: dict[str, float], what: str = "") -> None:
    err = rel_err(got, want)
    errors[name] = max(errors.get(name, 0.0), err)
    if not err < 1e-5:
        raise AssertionError(f"{name}{what}: relative error {err:.2e}")


def loss_sum(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    return cross_entropy_loss(model, batch)[0]


def part1(args: ModelArgs, batch: Batch, cp_mesh, name: str, errors: dict[str, float],
          drop_document_ids: bool = False) -> None:
    ref = Transformer(args)
    ref.init_weights(seed=0)
    want_loss = loss_sum(ref, batch)
    want_loss.backward()
    with torch.no_grad():
        want_hidden = ref.hidden_states(batch.input_ids, batch.position_ids, batch.document_ids)

    model = apply_cp(Transformer(args), cp_mesh)
    model.init_weights(seed=0)
    cp_rank, cp = cp_mesh.get_local_rank(), cp_mesh.size()
    group = cp_mesh.get_group()
    mine = shard_batch(batch, cp_rank, cp)
    if drop_document_ids:  # the layout's no-documents path (shard_batch always makes them explicit)
        mine = dataclasses.replace(mine, document_ids=None)
    got_loss = loss_sum(model, mine)
    got_loss.backward()
    total = got_loss.detach().clone()
    dist.all_reduce(total, group=group)
    check(f"{name}.loss", total, want_loss.detach(), errors)
    with torch.no_grad():
        hidden = model.hidden_states(mine.input_ids, mine.position_ids, mine.document_ids).contiguous()
    shards = [torch.empty_like(hidden) for _ in range(cp)]
    dist.all_gather(shards, hidden, group=group)
    check(f"{name}.hidden", unshard_tokens(shards), want_hidden, errors)
    for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        check(f"{name}.grad", g, q.grad, errors, f" ({pname})")


def part2(mesh, errors: dict[str, float]) -> None:
    """FSDP2 over dp_shard x cp: dp_shard rank d takes rows 2d, 2d+1 of a 4-row batch, then its cp share."""
    batch = packed_batch(4, seed=3)
    ref = Transformer(LLAMA)
    ref.init_weights(seed=0)
    targets = (batch.labels != IGNORE_INDEX).sum()
    (loss_sum(ref, batch) / targets).backward()

    model = apply_cp(Transformer(LLAMA), mesh["cp"])
    model.init_weights(seed=0)
    apply_activation_checkpointing(model)  # backward recomputes each block, its all-gathers included
    apply_fsdp(model, mesh["dp_shard", "cp"]._flatten("dp_shard_cp"), torch.device("cpu"))
    d, c = mesh["dp_shard"].get_local_rank(), mesh["cp"].get_local_rank()
    rows = Batch(batch.input_ids[2 * d:2 * d + 2], batch.labels[2 * d:2 * d + 2], batch.position_ids[2 * d:2 * d + 2],
                 batch.document_ids[2 * d:2 * d + 2])
    micro = [shard_batch(Batch(rows.input_ids[i:i + 1], rows.labels[i:i + 1], rows.position_ids[i:i + 1],
                               rows.document_ids[i:i + 1]), c, 2) for i in range(2)]
    # dist_utils.world_size() (4) is the size of the gradient-averaging mesh here, as it must be
    gradient_computation(model, micro, cross_entropy_loss, global_target_count(micro))
    for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
        check("fsdp_dp_shard_cp.grad", p.grad.full_tensor(), q.grad, errors, f" ({pname})")


def main() -> None:
    torch.manual_seed(0)
    info = init_distributed("cpu")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    errors: dict[str, float] = {}
    part1(LLAMA, packed_batch(2, seed=1), mesh["cp"], "packed", errors)
    part1(LLAMA, plain_batch(2, seed=2), mesh["cp"], "causal", errors)
    part1(GEMMA3, packed_batch(2, seed=4), mesh["cp"], "sliding_packed", errors)
    part1(GEMMA3, plain_batch(2, seed=5), mesh["cp"], "sliding_causal", errors, drop_document_ids=True)
    blockwise.BLOCK, blockwise.CPU_FLASH = 3, False  # pieces that cut the chunks of 4; the matmul blocks
    part1(GEMMA3, packed_batch(2, seed=6), mesh["cp"], "blocks3_matmul", errors)
    blockwise.BLOCK, blockwise.CPU_FLASH = 1024, True
    part2(mesh, errors)
    if info.rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(errors, f)
    dist_utils.shutdown()


if __name__ == "__main__":
    main()
