"""Distillation: each divergence and its gradient against full logits written out here (fp64), chunking
and temperature, microbatch invariance on packed SFT batches, and the CLI end to end (resume equal to
an uninterrupted run with on-policy steps, two DDP ranks equal to one process, a teacher with another
vocabulary refused)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from _helpers import REPO, lmforge_in_process, tail, tiny_run_args, torchrun
from lmforge.data.chat import ByteChatFormat
from lmforge.data.packing import IGNORE_INDEX, collate
from lmforge.data.sft_data import build_sft_dataset, task_records
from lmforge.data.tasks import task_examples
from lmforge.metrics.records import read_records
from lmforge.models.load import ModelSource
from lmforge.models.model import ModelArgs, Transformer
from lmforge.models.tokenizer import ByteTokenizer
from lmforge.objectives.distill import DistillObjective, DistillSettings
from lmforge.losses.chunked_divergence import chunked_divergence
from lmforge.recipes.jobs.on_policy import batch_prompts, completion_batch
from lmforge.objectives.reference import FrozenReference
from lmforge.training.train_step import compute_global_loss, gradient_computation


# ---------------------------------------------------------------------------------------- the math
def reference_sums(zs, zt, labels, kind, beta, T, ce_weight):
    """Per-row divergence from full logits, the formulas spelled out; the cross-entropy at T = 1."""
    logq, logp = torch.log_softmax(zs / T, -1), torch.log_softmax(zt / T, -1)
    q, p = logq.exp(), logp.exp()
    if kind == "forward_kl":
        d = (p * (logp - logq)).sum(-1)
    elif kind == "reverse_kl":
        d = (q * (logq - logp)).sum(-1)
    else:
        m = beta * p + (1 - beta) * q
        d = beta * (p * (p / m).log()).sum(-1) + (1 - beta) * (q * (q / m).log()).sum(-1)
    has = labels >= 0
    ce = -torch.log_softmax(zs, -1)[has].gather(-1, labels[has, None]).sum()
    return d.sum() + ce_weight * ce, d.sum(), ce


def random_problem(n=11, vocab=37, d=8, dt=6, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, d, generator=g, dtype=dtype) * 2).requires_grad_(True)
    w = (torch.randn(vocab, d, generator=g, dtype=dtype)).requires_grad_(True)
    ht, wt = torch.randn(n, dt, generator=g, dtype=dtype) * 2, torch.randn(vocab, dt, generator=g, dtype=dtype)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::3] = IGNORE_INDEX
    return h, w, ht, wt, labels


@pytest.mark.parametrize("kind, beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3), ("jsd", 0.9)])
@pytest.mark.parametrize("T, ce_weight", [(1.0, 0.0), (2.5, 0.7)])
def test_divergence_and_gradients_equal_full_logits_at_every_chunk_size(kind, beta, T, ce_weight):
    h, w, ht, wt, labels = random_problem()
    want, want_d, want_ce = reference_sums(h @ w.t(), ht @ wt.t(), labels, kind, beta, T, ce_weight)
    gh, gw = torch.autograd.grad(want, (h, w))
    for chunk in (1, 4, 11, 1000):
        out = chunked_divergence(h, w, ht, wt, labels, kind=kind, beta=beta, temperature=T, ce_weight=ce_weight,
                                 chunk_tokens=chunk)
        assert float(out.objective.detach()) == pytest.approx(float(want.detach()), rel=1e-12)
        assert float(out.divergence) == pytest.approx(want_d.item(), rel=1e-12)
        assert float(out.ce) == pytest.approx(want_ce.item(), rel=1e-12)
        got_h, got_w = torch.autograd.grad(out.objective * 3.0, (h, w))  # the upstream scalar is applied
        assert torch.allclose(got_h, 3 * gh, rtol=1e-10, atol=1e-12), chunk
        assert torch.allclose(got_w, 3 * gw, rtol=1e-10, atol=1e-12), chunk
    assert want_d.item() > 0


def test_jsd_ends_are_the_kl_limits_and_temperature_divides_both_logits():
    h, w, ht, wt, labels = random_problem(dtype=torch.float64)
    h, ht = h.detach() / 4, ht / 4  # milder logits: the limits' next terms grow with the chi-squared distance
    div = lambda kind, beta=0.5, T=1.0, **kw: float(chunked_divergence(  # noqa: E731
        kw.get("h", h), kw.get("w", w), ht, kw.get("wt", wt), labels, kind=kind, beta=beta, temperature=T,
        chunk_tokens=5).divergence)
    fkl, rkl = div("forward_kl"), div("reverse_kl")
    assert div("jsd", 0.0) == fkl and div("jsd", 1.0) == rkl
    eps = 1e-7  # JSD / beta -> KL(p || q) as beta -> 0; JSD / (1 - beta) -> KL(q || p) as beta -> 1
    assert div("jsd", eps) / eps == pytest.approx(fkl, rel=1e-3)
    assert div("jsd", 1 - eps) / eps == pytest.approx(rkl, rel=1e-3)
    assert fkl != pytest.approx(rkl, rel=1e-3)
    # temperature T equals logits divided by T at temperature 1 (both models)
    for kind in ("forward_kl", "reverse_kl", "jsd"):
        assert div(kind, T=3.0) == pytest.approx(div(kind, w=w / 3.0, wt=wt / 3.0), rel=1e-12)
    # the divergence of a teacher with itself is zero, and its gradient too
    same = chunked_divergence(h, w, h, w.detach(), labels, kind="jsd", chunk_tokens=4)
    assert abs(float(same.divergence)) < 1e-12
    assert float(torch.autograd.grad(same.objective, w)[0].abs().max()) < 1e-12


# ---------------------------------------------------------------------------------------- packed batches
def tiny_model(seed: int, dim: int = 32, layers: int = 2) -> Transformer:
    model = Transformer(ModelArgs(dim=dim, n_layers=layers, n_heads=4, n_kv_heads=2, vocab_size=320, max_seq_len=128))
    model.init_weights(seed=seed)
    with torch.no_grad():  # peaked logits, so the two models' distributions differ clearly
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return model


def sft_batch(rows: int = 6):
    tok = ByteTokenizer()
    dataset, _ = build_sft_dataset(task_records(task_examples("train", 30)), "t", tok, ByteChatFormat(tok), seq_len=64)
    return collate([dataset[i] for i in range(rows)])


def microbatches(batch, cuts):
    def rows(lo, hi):
        sl = slice(lo, hi)
        return type(batch)(batch.input_ids[sl], batch.labels[sl], batch.position_ids[sl], batch.document_ids[sl],
                           batch.document_lengths[sl])
    edges = [0, *cuts, batch.input_ids.shape[0]]
    return [rows(a, b) for a, b in zip(edges, edges[1:])]


def run_step(student, objective, mbs):
    student.zero_grad()
    stats = gradient_computation(student, mbs, objective.loss_fn, objective.normalizer(mbs))
    return {n: p.grad.clone() for n, p in student.named_parameters()}, objective.log_values(compute_global_loss(stats))


def test_microbatch_split_is_exact_and_equals_full_logits_per_document():
    student, teacher = tiny_model(1, dim=32, layers=1), tiny_model(2, dim=48).requires_grad_(False)
    settings = DistillSettings("jsd", 0.4, temperature=1.5, ce_weight=0.3, chunk_tokens=7)
    objective = DistillObjective(FrozenReference(teacher, ModelSource("init", "2")), settings)
    batch = sft_batch()
    whole, values = run_step(student, objective, [batch])
    split, split_values = run_step(student, objective, microbatches(batch, [1, 4]))
    for name in whole:
        assert torch.allclose(whole[name], split[name], rtol=1e-5, atol=1e-7), name
    for key in values:
        assert float(values[key]) == pytest.approx(float(split_values[key]), rel=1e-5), key
    # each packed document alone through full logits, the loss written out
    student.zero_grad()
    total, div, ce, n = 0.0, 0.0, 0.0, 0
    for i in range(batch.input_ids.shape[0]):
        at = 0
        for length in batch.document_lengths[i]:
            ids, labels = batch.input_ids[i, at:at + length][None], batch.labels[i, at:at + length]
            at += length
            keep = labels != IGNORE_INDEX
            with torch.no_grad():
                zt = teacher(ids)[0][keep].double()
            zs = student(ids)[0][keep].double()
            t, d, c = reference_sums(zs, zt, labels[keep], "jsd", 0.4, 1.5, 0.3)
            total, div, ce, n = total + t, div + d.item(), ce + c.item(), n + int(keep.sum())
    (total / n).backward()
    assert float(values["loss"]) == pytest.approx(float(total) / n, rel=1e-5)
    assert float(values["divergence"]) == pytest.approx(div / n, rel=1e-5)
    assert float(values["ce"]) == pytest.approx(ce / n, rel=1e-5)
    assert int(values["total_weights"]) == n
    for name, p in student.named_parameters():
        assert torch.allclose(whole[name], p.grad.float(), rtol=1e-4, atol=1e-6), name


def test_on_policy_layout_takes_each_prompt_and_targets_only_the_completion():
    batch = sft_batch(2)
    prompts = batch_prompts(batch)
    assert len(prompts) == sum(len(r) for r in batch.document_lengths)
    tok = ByteTokenizer()
    k = len(prompts[0])  # the first document's tokens up to its first target's position
    assert batch.input_ids[0, :k].tolist() == prompts[0]
    assert (batch.labels[0, :k - 1] == IGNORE_INDEX).all() and batch.labels[0, k - 1] != IGNORE_INDEX
    sampled = completion_batch(prompts[:2], [[65, 66, 67], [68]], pad_id=tok.pad_id, device=torch.device("cpu"))
    assert sampled.labels[0][sampled.labels[0] != IGNORE_INDEX].tolist() == [65, 66, 67]
    assert sampled.labels[1][sampled.labels[1] != IGNORE_INDEX].tolist() == [68]
    assert int(sampled.num_targets) == 4
    assert sampled.input_ids[0, :k].tolist() == prompts[0] and sampled.input_ids[0, k:k + 2].tolist() == [65, 66]


# ---------------------------------------------------------------------------------------- the CLI
DISTILL_RUN = {"data_seq_len": 64, "training_global_batch_size": 4, "training_micro_batch_size": 2,
               "data_prefetch": 0, "model_dim": 32, "model_n_layers": 1, "optimizer_lr": 3e-3,
               "schedule_kind": "constant", "schedule_warmup_steps": 0, "tasks_train_examples": 48,
               "tasks_eval_examples": 4}
FLAGS = ("--distill.divergence=jsd", "--distill.jsd_beta=0.3", "--distill.ce_weight=0.5", "--distill.temperature=1.5",
         "--distill.on_policy=0.5", "--distill.max_new_tokens=6", "--training.loss_chunk_tokens=16")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """A 2-step pretrained tiny model (byte tokenizer) as the teacher."""
    run = tmp_path_factory.mktemp("distill") / "teacher"
    assert lmforge_in_process("pretrain", *tiny_run_args(training_steps=2), f"--run.dir={run}") == 0
    return run


def distill_args(teacher: Path, run: Path, **overrides) -> list[str]:
    return ["distill", *tiny_run_args(**{**DISTILL_RUN, **overrides}), *FLAGS, f"--distill.teacher={teacher}",
            f"--run.dir={run}"]


@pytest.fixture(scope="module")
def straight(teacher, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("distill") / "straight"
    args = distill_args(teacher, run, training_steps=4, eval_interval=2, eval_steps=2, eval_batch_size=4)
    assert lmforge_in_process(*args) == 0
    return run


def picked(run: Path) -> dict[int, list[float]]:
    keys = ("loss", "divergence", "ce", "distill/on_policy", "grad_norm")
    return {r["step"]: [r[k] for k in keys] for r in read_records(run, "train")}


def test_cli_run_resumes_exactly_with_on_policy_steps(teacher, straight, tmp_path):
    interrupted = tmp_path / "interrupted"
    for steps in (2, 4):
        assert lmforge_in_process(*distill_args(teacher, interrupted, training_steps=steps, checkpoint_interval=2)) == 0
    assert [r["step"] for r in read_records(interrupted, "resume")] == [2]
    a, b = picked(straight), picked(interrupted)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5), step
    train = read_records(straight, "train")
    sampled = [r for r in train if "completion/mean_length" in r]
    assert sampled and len(sampled) < len(train)  # on_policy=0.5: both kinds of step in 4 (seed 0)
    assert all(r["ce"] == 0.0 for r in sampled) and all(r["ce"] > 0 for r in train if r not in sampled)
    assert 0 < sampled[0]["completion/mean_length"] <= 6
    assert train[-1]["distill/on_policy"] == pytest.approx(len(sampled) / 4)
    assert all(r["tflops_per_device"] > 0 for r in train)
    evals = [e for e in read_records(straight, "eval") if "divergence" in e]
    assert [e["step"] for e in evals] == [0, 2, 4] and all(e["ce"] > 0 for e in evals)
    assert evals[-1]["divergence"] < evals[0]["divergence"]  # the student moved towards the teacher
    state = json.loads((interrupted / "checkpoints" / "step_00000004" / "trainer_state.json").read_text())
    assert state["data"]["reference"].startswith("checkpoint:") and "teacher" in state["data"]["reference"]


def test_two_ddp_ranks_equal_one_process(teacher, straight, tmp_path):
    """Each rank samples from a generator seeded by the global microbatch index, so the on-policy steps
    match too (one process: 2 microbatches of 2; two ranks: one microbatch of 2 each)."""
    two = tmp_path / "two"
    ddp = torchrun(*distill_args(teacher, two, training_steps=4, eval_interval=0, checkpoint_enabled=False,
                                 parallel_mode="ddp"))
    assert ddp.returncode == 0, tail(ddp)
    a, b = picked(straight), picked(two)
    assert sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4), step


def test_reward_model_as_teacher_is_refused_before_the_run_exists(teacher, tmp_path, capfd):
    """A reward model scores sequences: there is no next-token distribution to distill from it. Its
    checkpoint says so (``"head": "score"``, as an ``lmforge rm`` run saves), and so does the config.json
    of a ``*ForSequenceClassification`` directory."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"q{i}", "chosen": "yes", "rejected": "no"}) + "\n" for i in range(4)))
    rm_run = tmp_path / "rm_run"
    overrides = {k: v for k, v in DISTILL_RUN.items() if not k.startswith("tasks_")}
    assert lmforge_in_process("rm", *tiny_run_args(pairs, **{**overrides, "training_steps": 1}),
                              f"--run.dir={rm_run}") == 0
    hf = tmp_path / "rm_hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"]}))
    for k, rm in enumerate((rm_run, hf)):
        run = tmp_path / f"run{k}"
        rc = lmforge_in_process(*distill_args(rm, run, training_steps=1))
        err = capfd.readouterr().err
        assert rc == 2 and err.startswith(f"error: distill.teacher={rm}: a reward model") and err.count("\n") == 1, err
        assert not run.exists()


def test_teacher_with_another_vocabulary_or_none_is_refused_in_one_line(teacher, tmp_path, capfd):
    smol = REPO / "tests" / "fixtures" / "tokenizers" / "smollm2-135m-instruct"
    rc = lmforge_in_process(*distill_args(teacher, tmp_path / "a", training_steps=1), f"--model.tokenizer={smol}")
    err = capfd.readouterr().err
    assert rc == 2 and err.startswith(f"error: distill.teacher={teacher}: the teacher's vocabulary (vocab_size 320")
    assert err.count("\n") == 1
    rc = lmforge_in_process(*distill_args(tmp_path / "missing", tmp_path / "b", training_steps=1))
    err = capfd.readouterr().err
    assert rc == 2 and err.startswith(f"error: distill.teacher={tmp_path / 'missing'}: ") and err.count("\n") == 1
    assert not (tmp_path / "b").exists()
    assert lmforge_in_process("distill", f"--run.dir={tmp_path / 'c'}") == 2
    assert "error: distill.teacher is not set" in capfd.readouterr().err
