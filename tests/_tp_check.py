"""Run under torchrun (gloo, CPU): tensor (+ sequence) parallel decoders against the same model in one process.

``tp`` (2 ranks): the loss kernel's vocabulary-parallel path on its own against full logits (loss, hits,
entropy, both gradients); then for several model shapes, with and without sequence parallelism, on a packed batch
(document and position ids; the mixture of experts under activation checkpointing): full logits, the
chunked cross-entropy's value and argmax hits, the per-token log-probs / hits / entropy head at a
temperature, every parameter's gradient (gathered to full tensors, in the parameter's placement) and
the gradient norm equal the one-process run's. ``2d`` (4 ranks): dp_shard=2 x tp=2 with FSDP2 over TP,
each data rank its half of the batch in 2 microbatches: loss and gradients equal one process over the
whole batch. Every rank computes the one-process reference itself (same seed). Prints ``OK`` lines;
raises on a mismatch.
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lmforge import distributed as dist_utils
from lmforge.runtime.world import init_distributed
from lmforge.data.packing import IGNORE_INDEX, Batch
from lmforge.errors import UserError
from lmforge.models.args import ModelArgs
from lmforge.models.model import Transformer
from lmforge.objectives.next_token import cross_entropy_loss
from lmforge.parallel.plans import apply_activation_checkpointing
from lmforge.parallel.tensor_parallel import apply_tp
from lmforge.losses.chunked_loss import TargetLogprobHead, TargetLogprobSumHead

BASE = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden_dim=64, max_seq_len=32)
CONFIGS = {
    "gqa_bias_untied": dict(BASE, qkv_bias=True),
    "qwen3_qknorm_tied": dict(BASE, tie_embeddings=True, qk_norm=True, head_dim=16),
    "gemma_sandwich_tied": dict(BASE, tie_embeddings=True, sandwich_norm=True, norm_unit_offset=True,
                                embed_scale=True, hidden_act="gelu_tanh"),
    "moe": dict(BASE, n_experts=4, n_experts_per_token=2, moe_layers=[1]),
}


def packed_batch(n: int = 4, t: int = 16, seed: int = 0) -> Batch:
    """Rows of several documents (ids restart per document), some labels ignored."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (n, t + 1), generator=g)
    labels = ids[:, 1:].clone()
    doc = torch.zeros(n, t, dtype=torch.long)
    for i in range(n):
        cuts = sorted(torch.randperm(t - 2, generator=g)[:i % 3 + 1].add(1).tolist())
        for c in cuts:
            doc[i, c:] += 1
        labels[i, :2 * i] = IGNORE_INDEX
    first = torch.ones_like(doc, dtype=torch.bool)
    first[:, 1:] = doc[:, 1:] != doc[:, :-1]
    idx = torch.arange(t).expand(n, t)
    start = torch.where(first, idx, torch.zeros_like(idx)).cummax(1).values
    return Batch(input_ids=ids[:, :-1], labels=labels, position_ids=idx - start, document_ids=doc)


def rows(b: Batch, lo: int, hi: int) -> Batch:
    return Batch(b.input_ids[lo:hi], b.labels[lo:hi], b.position_ids[lo:hi], b.document_ids[lo:hi])


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """fp32 agreement: 1e-5 relative per element, or 1e-5 of the tensor's largest entry (sums in another order)."""
    atol = 1e-5 * float(b.abs().max()) if b.numel() else 0.0
    torch.testing.assert_close(full(a), b, rtol=1e-5, atol=max(atol, 1e-7), msg=lambda m: f"{what}: {m}")


def compare_grads(model: torch.nn.Module, ref: torch.nn.Module, what: str) -> None:
    got = {k.replace("_checkpoint_wrapped_module.", ""): p for k, p in model.named_parameters()}
    for name, p in ref.named_parameters():
        g = got[name].grad
        assert g is not None, f"{what}: no gradient for {name}"
        # a partial sum would pass full_tensor() (which sums it) but mislead the optimizer and the clip
        assert g.placements == got[name].placements, f"{what}: {name} grad is {g.placements}"
        close(got[name].grad, p.grad, f"{what} grad {name}")


def models(cfg: dict) -> tuple[Transformer, Transformer]:
    torch.manual_seed(0)  # the experts' init draws from the global RNG
    ref = Transformer(ModelArgs(**cfg))
    ref.init_weights(seed=0)
    model = Transformer(ModelArgs(**cfg))
    model.load_state_dict(ref.state_dict())
    model.tie_weights()
    return model, ref


def check_kernel(mesh: object) -> None:
    """The loss heads over a vocab-sharded output weight against the full logits of one process:
    ``F.cross_entropy``'s sum and ``F.log_softmax`` at a temperature, the argmax hits, the entropy, and
    the gradients of the hidden states (summed over the ranks by the declared ``Partial``) and of the
    weight, at chunk sizes of 1, not dividing the rows, and above them."""
    g = torch.Generator().manual_seed(3)
    vocab, dim, temperature = 64, 16, 0.7
    hidden, weight = torch.randn(3, 10, dim, generator=g), torch.randn(vocab, dim, generator=g) * 4
    targets, mask = torch.randint(0, vocab, (3, 10), generator=g), torch.rand(3, 10, generator=g) > 0.3
    best = F.linear(hidden, weight).argmax(-1)
    targets[:, ::3] = best[:, ::3]  # some hits; the rest (nearly all) misses
    weights = torch.linspace(-1.0, 2.0, int(mask.sum()))  # per-token upstream gradients (GRPO's)
    for chunk in (1, 7, 1000):
        for per_token in (False, True):
            what = f"kernel chunk={chunk} per_token={per_token}"
            h, w = hidden.clone().requires_grad_(), distribute_tensor(weight.clone(), mesh, [Shard(0)])
            w.requires_grad_()
            ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            logits = F.linear(ref_h, ref_w)[mask]
            if per_token:
                out = TargetLogprobHead(targets, mask, chunk_tokens=chunk, temperature=temperature, entropy=True)(h, w)
                logp_all = F.log_softmax(logits / temperature, dim=-1)
                ref = logp_all.gather(-1, targets[mask].unsqueeze(-1)).squeeze(-1)
                close(out.logprobs, ref, f"{what} logprobs")
                close(out.entropy, -(logp_all.exp() * logp_all).sum(-1).detach(), f"{what} entropy")
                value, ref_value, hits = (out.logprobs * weights).sum(), (ref * weights).sum(), out.hits
            else:
                value, hits = TargetLogprobSumHead(targets, mask, chunk_tokens=chunk)(h, w)
                ref_value = -F.cross_entropy(logits, targets[mask], reduction="sum")
            close(value, ref_value, f"{what} value")
            assert torch.equal(hits, logits.argmax(-1) == targets[mask]), f"{what}: hits differ"
            assert 0 < int(hits.sum()) < hits.numel(), f"{what}: hits and misses both compared"
            value.backward()
            ref_value.backward()
            assert w.grad.placements == (Shard(0),), f"{what}: weight grad is {w.grad.placements}"
            close(h.grad, ref_h.grad, f"{what} hidden grad")
            close(w.grad, ref_w.grad, f"{what} weight grad")
    if dist.get_rank() == 0:
        print("OK vocab-parallel kernel", flush=True)


def check_tp(mesh: object) -> None:
    batch = packed_batch()
    for name, cfg in CONFIGS.items():
        for sp in (False, True):
            what = f"{name} sp={sp}"
            model, ref = models(cfg)
            apply_tp(model, mesh, sequence_parallel=sp)
            if name == "moe":  # checkpointing goes on after tensor parallelism (its recompute stops early)
                apply_activation_checkpointing(model)
            if cfg.get("tie_embeddings"):
                assert model.output.weight is model.tok_embeddings.weight, f"{what}: tie lost"
            kw = dict(position_ids=batch.position_ids, document_ids=batch.document_ids)
            with torch.no_grad():
                close(model(batch.input_ids, **kw), ref(batch.input_ids, **kw), f"{what} logits")
            loss, stats = cross_entropy_loss(model, batch, chunk_tokens=5)
            ref_loss, ref_stats = cross_entropy_loss(ref, batch, chunk_tokens=5)
            close(loss, ref_loss, f"{what} loss")
            assert stats.sums["correct"].item() == ref_stats.sums["correct"].item(), f"{what}: hits differ"
            loss.backward()
            ref_loss.backward()
            compare_grads(model, ref, what)
            norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), float("inf"))  # as the train step
            close(norm, torch.nn.utils.clip_grad_norm_(list(ref.parameters()), float("inf")), f"{what} grad norm")
            # per-token head (GRPO's): temperature, entropy, per-token upstream gradients
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            mask = batch.labels != IGNORE_INDEX
            head = TargetLogprobHead(batch.labels.clamp(min=0), mask, chunk_tokens=7, temperature=0.7, entropy=True)
            out, ref_out = model(batch.input_ids, head=head, **kw), ref(batch.input_ids, head=head, **kw)
            close(out.logprobs, ref_out.logprobs, f"{what} logprobs")
            close(out.entropy, ref_out.entropy, f"{what} entropy")
            assert torch.equal(out.hits, ref_out.hits), f"{what}: per-token hits differ"
            weights = torch.linspace(-1.0, 2.0, out.logprobs.shape[0])
            (out.logprobs * weights).sum().backward()
            (ref_out.logprobs * weights).sum().backward()
            compare_grads(model, ref, f"{what} per-token")
            if dist.get_rank() == 0:
                print(f"OK tp=2 {what}", flush=True)
    try:  # sequence parallelism splits the sequence evenly or refuses
        model(batch.input_ids[:, :15])
        raise AssertionError("an odd sequence length was accepted under sequence parallelism")
    except UserError as e:
        assert "parallel.tp=2" in str(e), e


def check_2d(mesh: object) -> None:
    """dp_shard x tp: FSDP2 over the TP model; the train step's normalization by hand (see the report)."""
    from torch.distributed.fsdp import fully_shard

    batch = packed_batch()
    dp, dp_rank = mesh["dp_shard"].size(), mesh["dp_shard"].get_local_rank()
    for name, sp in (("gqa_bias_untied", True), ("moe", False)):
        what = f"{name} sp={sp}"
        model, ref = models(CONFIGS[name])
        apply_tp(model, mesh["tp"], sequence_parallel=sp)
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
        half = batch.input_ids.shape[0] // dp
        mine = rows(batch, dp_rank * half, (dp_rank + 1) * half)
        micro = [rows(mine, 0, half // 2), rows(mine, half // 2, half)]
        # the tokens of the step: summed over the data ranks only (tp ranks hold the same tokens)
        targets = torch.stack([(mb.labels != IGNORE_INDEX).sum() for mb in micro]).sum().float()
        dist.all_reduce(targets, group=mesh["dp_shard"].get_group())
        scale = dp / targets  # FSDP2 averages over the data ranks: times dp gives the sum back
        loss_sum = torch.zeros(())
        for i, mb in enumerate(micro):
            with dist_utils.no_grad_sync(model, enabled=i < len(micro) - 1):
                loss, _ = cross_entropy_loss(model, mb, chunk_tokens=5)
                (loss * scale).backward()
            loss_sum += loss.detach()
        dist.all_reduce(loss_sum, group=mesh["dp_shard"].get_group())  # equal on the tp ranks: not summed there
        ref_loss, _ = cross_entropy_loss(ref, batch, chunk_tokens=5)
        close(loss_sum, ref_loss.detach(), f"2d {what} loss")
        (ref_loss / (batch.labels != IGNORE_INDEX).sum()).backward()
        compare_grads(model, ref, f"2d {what}")
        if dist.get_rank() == 0:
            print(f"OK dp_shard=2 x tp=2 {what}", flush=True)


def main() -> None:
    torch.set_num_threads(1)
    info = init_distributed("cpu")
    if sys.argv[1] == "tp":
        mesh = init_device_mesh("cpu", (info.world_size,), mesh_dim_names=("tp",))
        check_kernel(mesh)
        check_tp(mesh)
    else:
        check_2d(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp")))
    dist_utils.shutdown()


if __name__ == "__main__":
    main()
