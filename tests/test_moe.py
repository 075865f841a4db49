"""Mixtures of experts against transformers: the load-balancing loss and its gradient, the grouped
kernel against the per-expert loop, the objective's loss normalisation, and router statistics on a
real run's metrics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lmforge.models.configs import MLPConfig
from lmforge.data.packing import Batch
from lmforge.models.hf import load_hf_model, save_hf_model
from lmforge.models.layers.moe import GroupedExperts, MoEFeedForward, router_losses
from lmforge.objectives.next_token import cross_entropy_loss
from lmforge.objectives.router import RouterLossWeights, router_log_values
from lmforge.losses.stats import LossStats

from _helpers import lmforge_in_process, tiny_run_args
from test_families import MOE_FAMILIES, ids, tiny_hf

transformers = pytest.importorskip("transformers")
CHATS = Path(__file__).resolve().parent / "fixtures" / "data" / "fastchat_identity_multiturn.jsonl"


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def pair(request, tmp_path_factory):
    """(transformers model, the same weights loaded by lmforge) of one MoE family."""
    hf = tiny_hf(request.param)
    d = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(d)
    return hf, load_hf_model(d)


def test_aux_loss_and_its_router_gradient_equal_transformers(pair):
    hf, model = pair
    tokens = ids(24)
    out = hf(tokens, output_router_logits=True)
    hf_router = [p for n, p in hf.named_parameters() if n.endswith(".gate.weight")]
    (hf_grad,) = torch.autograd.grad(out.aux_loss, hf_router[:1])
    model(tokens)
    terms = router_losses(model)
    assert terms is not None
    torch.testing.assert_close(terms.aux_loss, out.aux_loss.float(), atol=1e-6, rtol=1e-6)
    router = next(m.router.weight for m in model.modules() if isinstance(m, MoEFeedForward))
    (grad,) = torch.autograd.grad(terms.aux_loss, [router])
    torch.testing.assert_close(grad, hf_grad, atol=1e-6, rtol=1e-5)
    assert hf_grad.abs().max() > 0
    # Every routed slot is counted once: layers x tokens x k.
    n_moe = sum(isinstance(m, MoEFeedForward) for m in model.modules())
    assert terms.counts.shape == (n_moe, model.args.n_experts)
    assert terms.counts.sum() == n_moe * tokens.numel() * model.args.n_experts_per_token


PADDED_LENGTHS = [[8], [5, 6], [24]]  # real tokens per row of [3, 24]: 67% and 54% padding, then none


def padded_batch(T: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``PADDED_LENGTHS`` real tokens then padding: (tokens, transformers' attention mask)."""
    tokens = ids(T, B=len(PADDED_LENGTHS), seed=5)
    attention = torch.zeros_like(tokens)
    for row, lengths in enumerate(PADDED_LENGTHS):
        attention[row, :sum(lengths)] = 1
    return tokens, attention


def test_router_terms_leave_padding_out_as_transformers_does(pair):
    """transformers passes the attention mask to ``load_balancing_loss_func``; lmforge's padded rows
    (real tokens then padding, the mask read from ``document_lengths``) give the same aux loss and
    router gradient, and the z-loss is the mean over real tokens of transformers' router logits."""
    hf, model = pair
    tokens, attention = padded_batch()
    out = hf(tokens, attention_mask=attention, output_router_logits=True)
    hf_router = [p for n, p in hf.named_parameters() if n.endswith(".gate.weight")]
    (hf_grad,) = torch.autograd.grad(out.aux_loss, hf_router[:1], retain_graph=True)
    real = attention.reshape(-1).bool()
    hf_z = torch.cat([torch.logsumexp(g.float()[real], -1).pow(2) for g in out.router_logits]).mean()
    # one document per row (SFT without packing): padding is the tail after it
    batch = Batch(tokens, tokens, document_lengths=[[sum(n)] for n in PADDED_LENGTHS])
    mask = batch.real_token_mask()
    assert mask is not None and torch.equal(mask, attention.bool())
    _, stats = cross_entropy_loss(model, batch, router=RouterLossWeights(aux=1.0, z=1.0))  # what training logs
    logged = router_log_values(stats.global_totals())
    torch.testing.assert_close(logged["router_aux_loss"], out.aux_loss.float(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(logged["router_z_loss"], hf_z, atol=1e-6, rtol=1e-6)
    terms = router_losses(model, mask)
    torch.testing.assert_close(terms.aux_loss, out.aux_loss.float(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(terms.z_loss, hf_z, atol=1e-6, rtol=1e-6)
    router = next(m.router.weight for m in model.modules() if isinstance(m, MoEFeedForward))
    (grad,) = torch.autograd.grad(terms.aux_loss, [router])
    torch.testing.assert_close(grad, hf_grad, atol=1e-6, rtol=1e-5)
    n_moe = sum(isinstance(m, MoEFeedForward) for m in model.modules())
    assert terms.counts.sum() == n_moe * attention.sum() * model.args.n_experts_per_token  # padding not counted
    unmasked = router_losses(model)
    assert abs(unmasked.aux_loss - terms.aux_loss) > 1e-3  # the padding does move the value
    print(f"aux masked lmforge {terms.aux_loss.item():.6f} transformers {out.aux_loss.item():.6f} "
          f"unmasked {unmasked.aux_loss.item():.6f}; z {terms.z_loss.item():.6f} vs {hf_z.item():.6f}")


def test_packed_rows_mask_their_padded_tail_on_every_context_parallel_shard():
    """Packed rows (documents then a padding document) and one-document rows: the mask is the row
    position below the real length, and a context-parallel shard's mask is the shard of the row's."""
    from lmforge.data.sft_data import Example, SFTDataset
    from lmforge.data.packing import collate
    from lmforge.parallel.context_parallel import _shard, shard_batch

    examples = [Example(np.arange(1, n + 1), np.arange(1, n + 1)) for n in (5, 6, 9, 3, 16)]
    for packing in (True, False):
        batch = collate([SFTDataset(examples, 16, 0, packing=packing)[i] for i in range(3)])
        real = [sum(row) for row in batch.document_lengths]
        want = torch.arange(16).unsqueeze(0) < torch.tensor(real).unsqueeze(1)
        mask = batch.real_token_mask()
        assert mask is not None and torch.equal(mask, want), (packing, real)
        for cp in (2, 4):
            for rank in range(cp):
                assert torch.equal(shard_batch(batch, rank, cp).real_token_mask(), _shard(want, rank, cp))
    full = Batch(ids(8), ids(8), document_lengths=[[8], [8]])
    assert full.real_token_mask() is None and make_unpadded().real_token_mask() is None


def make_unpadded() -> Batch:
    """Pretraining rows: no document lengths, no padding."""
    return Batch(ids(8), ids(8))


def test_router_terms_are_per_microbatch_as_documented(pair):
    """The scope docs/models.md states: each microbatch's aux loss is its own forward's, and the step
    logs their target-token-weighted mean, which is not the one-microbatch value (the aux loss is a
    product of two means)."""
    _, model = pair
    tokens = ids(16, B=4, seed=7)
    labels = tokens.clone()
    labels[0, :6] = -100
    weights = RouterLossWeights(aux=1.0, z=0.0)
    whole = Batch(tokens, labels)
    halves = [Batch(tokens[:2], labels[:2]), Batch(tokens[2:], labels[2:])]
    _, one = cross_entropy_loss(model, whole, router=weights)
    one_aux = router_log_values(one.global_totals())["router_aux_loss"]
    own, total = [], None
    for half in halves:
        _, stats = cross_entropy_loss(model, half, router=weights)
        own.append((router_losses(model).aux_loss.detach(), stats.target_tokens))
        total = stats if total is None else total + stats
    step_aux = router_log_values(total.global_totals())["router_aux_loss"]
    want = sum(a * n for a, n in own) / sum(n for _, n in own)
    torch.testing.assert_close(step_aux, want)
    assert abs(step_aux - one_aux) > 1e-4, (step_aux, one_aux)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_kernel_equals_the_loop_over_experts(dtype):
    torch.manual_seed(0)
    experts = GroupedExperts(5, MLPConfig(16, 24)).to(dtype)
    counts = torch.tensor([7, 0, 3, 11, 4])  # an expert with no tokens too
    x = torch.randn(int(counts.sum()), 16, dtype=dtype, requires_grad=True)
    results = {}
    for impl in ("grouped", "loop"):
        experts.impl = impl
        out = experts(x, counts)
        grads = torch.autograd.grad(out.sum(), [x, experts.w1, experts.w2, experts.w3])  # stride-0 gradient
        results[impl] = (out, *grads)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for a, b in zip(results["grouped"], results["loop"]):
        torch.testing.assert_close(a, b, **tol)


def test_objective_adds_weighted_router_terms_to_the_gradient_not_to_the_logged_loss(pair):
    _, model = pair
    tokens = ids(16)
    labels = tokens.clone()
    labels[:, :4] = -100
    batch = Batch(input_ids=tokens, labels=labels, position_ids=None, document_ids=None)
    weights = RouterLossWeights(aux=0.3, z=0.05)
    loss, stats = cross_entropy_loss(model, batch, router=weights)
    plain, plain_stats = cross_entropy_loss(model, batch)
    terms = router_losses(model)
    targets = (labels != -100).sum()
    torch.testing.assert_close(loss, plain + (0.3 * terms.aux_loss + 0.05 * terms.z_loss) * targets)
    torch.testing.assert_close(stats.loss_sum, plain_stats.loss_sum)  # logged: cross-entropy alone
    logged = router_log_values(stats.global_totals())
    torch.testing.assert_close(logged["router_aux_loss"], terms.aux_loss.detach())
    torch.testing.assert_close(logged["router_z_loss"], terms.z_loss.detach())
    counts = terms.counts  # [layers, E]: the load is each layer's busiest / idlest expert against an even share
    even = counts.sum(1) / model.args.n_experts
    torch.testing.assert_close(logged["expert_load_max"], (counts.max(1).values / even).mean())
    torch.testing.assert_close(logged["expert_load_min"], (counts.min(1).values / even).mean())
    assert counts.sum() == targets.new_tensor(counts.shape[0] * tokens.numel() * model.args.n_experts_per_token)
    # A run's weights: the model's own coefficient unless the config names one.
    assert RouterLossWeights.for_run(None, 0.0, model.args).aux == model.args.router_aux_loss_coef
    assert RouterLossWeights.for_run(0.0, 0.0, model.args).aux == 0.0


def test_vector_sums_add_and_reduce_with_their_shape():
    a = LossStats(torch.tensor(2.0), torch.tensor(4), torch.tensor(4), {"v": torch.tensor([[1.0, 2.0]]),
                                                                        "s": torch.tensor(3.0)})
    totals = (a + a).global_totals()
    assert totals["v"].shape == (1, 2) and totals["v"].tolist() == [[2.0, 4.0]] and totals["s"] == 6.0
    assert totals["loss"] == 0.5


def test_export_round_trip_keeps_router_settings(pair, tmp_path):
    hf, model = pair
    save_hf_model(model.state_dict(), model.args, tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert type(again) is type(hf) and load_hf_model(tmp_path).args == model.args
    assert cfg["num_experts_per_tok"] == model.args.n_experts_per_token
    tokens = ids(12, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, model(tokens), atol=1e-5, rtol=1e-5)


def test_sft_run_logs_router_statistics(tmp_path, capfd):
    """A real run through the CLI: every train and eval record carries the router terms."""
    from lmforge.metrics.records import read_records

    from _hf_models import hf_start

    start = hf_start("mixtral", tmp_path / "start")
    args = tiny_run_args(CHATS, model_size=None, model_n_layers=None, model_dim=None, model_n_heads=None,
                         model_n_kv_heads=None, data_seq_len=128, training_steps=2,
                         training_global_batch_size=4, training_micro_batch_size=2, tasks_eval_examples=0)
    rc = lmforge_in_process("sft", *args, f"--model.from_hf={start}", f"--run.dir={tmp_path / 'run'}",
                            "--training.router_z_loss_coef=0.001", "--eval.interval=2")
    assert rc == 0, capfd.readouterr().err[-2000:]
    for kind, n in (("train", 2), ("eval", 1)):
        records = read_records(tmp_path / "run", kind)
        assert len(records) >= n
        for r in records:
            assert {"router_aux_loss", "router_z_loss", "expert_load_max", "expert_load_min"} <= r.keys(), r
    # the values themselves are checked against transformers in-process above; here, that the run says
    # which terms it trains with
    (setup,) = read_records(tmp_path / "run", "setup")
    assert setup["router_losses"] == ("aux 0.001 (model config; transformers adds it only with output_router_logits, "
                                      "0 turns it off), z 0.001; per microbatch, padding excluded")
