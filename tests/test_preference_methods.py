"""KTO, ORPO and SimPO: each loss and its gradient against the paper's formula written out with plain
math, the logged values against a hand computation from full-logit log-probs, microbatch and rank
invariance (KTO's reference point is one number per step), KTO's data, and each recipe through the CLI
on the real preference fixture with a real tokenizer (metrics, exact resume)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _helpers import cli_env, lmforge_in_process, tiny_run_args
from _pairs import Reference, full_logit_logprob, grads_and_values, row_sample, split_documents, task_pairs, tiny_model
from lmforge.data.chat import ByteChatFormat
from lmforge.data.packing import collate
from lmforge.data.preference_data import build_preference_dataset
from lmforge.data.unpaired_data import build_unpaired_dataset, read_unpaired_examples
from lmforge.errors import UserError
from lmforge.metrics.records import read_records
from lmforge.models.tokenizer import ByteTokenizer
from lmforge.objectives.kto import KTOObjective, kto_losses
from lmforge.objectives.orpo import ORPOObjective, log1m_exp, orpo_log_odds
from lmforge.objectives.simpo import SimPOObjective
from lmforge.objectives.pairwise import PairLogps

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PAIRS = FIXTURES / "data" / "preference_pairs.jsonl"
SMOLLM2 = FIXTURES / "tokenizers" / "smollm2-135m-instruct"
log_sigmoid = lambda x: -math.log1p(math.exp(-x)) if x > -30 else x - math.log1p(math.exp(x))  # noqa: E731
sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731


def random_logps(n: int = 6, seed: int = 0) -> PairLogps:
    g = torch.Generator().manual_seed(seed)
    nc, nr = (torch.randint(1, 9, (n,), generator=g).double() for _ in range(2))
    pc, pr = (-torch.rand(n, generator=g, dtype=torch.float64) * 4 * n_ for n_ in (nc, nr))
    return PairLogps(pc.requires_grad_(True), pr.requires_grad_(True), nc, nr)


# ---------------------------------------------------------------------------------------- formulas
@pytest.mark.parametrize("ls, nll", [(0.0, 0.0), (0.2, 0.5)])
def test_simpo_loss_and_gradient_match_the_formula(ls, nll):
    beta, gamma = 2.0, 0.7
    lp = random_logps()
    t = SimPOObjective(beta=beta, gamma=gamma, label_smoothing=ls, nll_weight=nll).loss_fn.terms(lp)
    want, grads = [], []
    for i in range(len(lp.pc)):
        pc, pr, nc, nr = (float(v[i].detach()) for v in (lp.pc, lp.pr, lp.nc, lp.nr))
        x = beta * (pc / nc - pr / nr) - gamma
        want.append(-(1 - ls) * log_sigmoid(x) - ls * log_sigmoid(-x) - nll * pc / nc)
        # d/dpc: -(1-ls) sigmoid(-x) beta/nc + ls sigmoid(x) beta/nc - nll/nc
        grads.append((-(1 - ls) * sigmoid(-x) + ls * sigmoid(x)) * beta / nc - nll / nc)
    assert t.losses.tolist() == pytest.approx(want, rel=1e-12)
    assert t.chosen_rewards.tolist() == pytest.approx((beta * lp.pc / lp.nc).tolist(), rel=1e-12)
    t.losses.sum().backward()
    assert lp.pc.grad.tolist() == pytest.approx(grads, rel=1e-10)


def test_orpo_loss_and_gradient_match_the_formula():
    lam = 0.25
    lp = random_logps(seed=1)
    t = ORPOObjective(beta=lam).loss_fn.terms(lp)
    want = []
    for i in range(len(lp.pc)):
        ac, ar = float(lp.pc[i].detach() / lp.nc[i]), float(lp.pr[i].detach() / lp.nr[i])
        log_odds = (ac - ar) - (math.log1p(-math.exp(ac)) - math.log1p(-math.exp(ar)))
        want.append(-ac - lam * log_sigmoid(log_odds))
    assert t.losses.tolist() == pytest.approx(want, rel=1e-12)
    t.losses.sum().backward()
    # d/dac of -ac - lam log s(L), L = ac - ar - log(1 - e^ac) + log(1 - e^ar): dL/dac = 1 + e^ac / (1 - e^ac)
    for i in range(len(lp.pc)):
        ac, ar = float(lp.pc[i].detach() / lp.nc[i]), float(lp.pr[i].detach() / lp.nr[i])
        L = (ac - ar) - (math.log1p(-math.exp(ac)) - math.log1p(-math.exp(ar)))
        d_ac = -1 - lam * sigmoid(-L) * (1 + math.exp(ac) / (1 - math.exp(ac)))
        assert float(lp.pc.grad[i]) == pytest.approx(d_ac / float(lp.nc[i]), rel=1e-9)


def test_log1m_exp_stays_accurate_where_the_naive_form_fails():
    a = torch.tensor([-1e-6, -0.5, -0.7, -5.0, -60.0], dtype=torch.float64)
    want = [math.log(-math.expm1(float(x))) for x in a]
    assert log1m_exp(a).tolist() == pytest.approx(want, rel=1e-9)
    a32 = torch.tensor([-1e-6])  # in float32 the naive form loses digits near 0, the stable one does not
    assert abs(float(torch.log1p(-torch.exp(a32))) / want[0] - 1) > 1e-4
    assert abs(float(log1m_exp(a32)) / want[0] - 1) < 1e-6
    assert float(log1m_exp(torch.tensor([-1e-12]))) == pytest.approx(math.log(1e-7), rel=1e-6)  # the clamp
    assert math.isfinite(float(orpo_log_odds(torch.tensor(0.0), torch.tensor(-1.0))))  # P(chosen) = 1: clamped


def test_kto_loss_matches_the_formula():
    g = torch.Generator().manual_seed(2)
    r = torch.randn(8, generator=g, dtype=torch.float64) * 3
    desirable = torch.tensor([True, False] * 4)
    z0, beta, wd, wu = torch.tensor(0.4, dtype=torch.float64), 0.3, 1.5, 0.8
    got = kto_losses(r, z0, desirable, beta=beta, desirable_weight=wd, undesirable_weight=wu)
    want = [wd * (1 - sigmoid(beta * (float(x) - 0.4))) if d else wu * (1 - sigmoid(beta * (0.4 - float(x))))
            for x, d in zip(r, desirable)]
    assert got.tolist() == pytest.approx(want, rel=1e-12)


# ---------------------------------------------------------------------------------------- KTO data
def test_kto_reads_pairs_as_two_examples_with_mismatched_partners(tmp_path):
    tok = ByteTokenizer()
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for _, r in task_pairs(5)))
    examples, records = read_unpaired_examples(str(path))
    assert records == 5 and len(examples) == 10 and [e[3] for e in examples] == [True, False] * 5
    dataset, summary = build_unpaired_dataset(str(path), tok, ByteChatFormat(tok), 96, True)
    assert summary.pairs == 10 and "5 desirable and 5 undesirable examples" in summary.line()
    docs = [tok.decode([int(t) for t in ex.input_ids]) for ex in dataset.examples]
    for j in range(10):  # the mismatched sequence: the example's own prompt, another example's response
        own, mismatched = docs[2 * j], docs[2 * j + 1]
        prompt = examples[j][1] if isinstance(examples[j][1], str) else examples[j][1][0]["content"]
        assert prompt in own and prompt in mismatched and own != mismatched
        assert dataset.examples[2 * j].value == dataset.examples[2 * j + 1].value == float(examples[j][3])


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "p", "completion": "a", "label": "yes"}', "'label' must be true or false, got \"yes\""),
    ('{"prompt": "p", "completion": "a"}', "missing key 'label'"),
    ('{"prompt": "p", "chosen": "a", "rejected": "b"}', "a file mixes preference pairs"),
    ('{"prompt": [{"role": "user", "content": "p"}], "completion": "a", "label": true}', "both strings or both"),
])
def test_bad_kto_records_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "kto.jsonl"
    path.write_text('{"prompt": "p", "completion": "a", "label": true}\n\n' + line + "\n")
    with pytest.raises(UserError) as e:
        read_unpaired_examples(str(path))
    assert str(e.value).startswith(f"{path}:3: ") and message in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------- gradients
def method_objective(name: str, policy, reference):
    if name == "kto":
        return KTOObjective(policy, reference, beta=0.3, desirable_weight=1.3, undesirable_weight=0.7)
    if name == "orpo":
        return ORPOObjective(beta=0.2)
    return SimPOObjective(beta=2.0, gamma=0.5, label_smoothing=0.1)


def method_batch(name: str, tmp_path: Path, rows: int = 6):
    tok = ByteTokenizer()
    if name == "kto":
        path = tmp_path / "pairs.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for _, r in task_pairs(13)))
        dataset, _ = build_unpaired_dataset(str(path), tok, ByteChatFormat(tok), 64, True)
    else:
        dataset, _ = build_preference_dataset(task_pairs(13), "t", tok, ByteChatFormat(tok), seq_len=64)
    return collate([dataset[i] for i in range(rows)])


def hand_loss(name: str, policy, ref_model, batch) -> torch.Tensor:
    """The method's mean loss from each sequence's full-logit log-probs, written out."""
    rows = [row_sample(batch, i) for i in range(batch.input_ids.shape[0])]
    seqs = [doc for row in rows for doc in split_documents(row)]
    logps = [full_logit_logprob(policy, ids, labels) for ids, labels in seqs]
    lengths = [int((labels >= 0).sum()) for _, labels in seqs]
    n = len(seqs) // 2
    if name == "kto":
        with torch.no_grad():
            refs = [full_logit_logprob(ref_model, ids, labels) for ids, labels in seqs]
        values = [v for row in batch.document_values for v in row[0::2]]
        z0 = max(sum(float(logps[2 * j + 1].detach() - refs[2 * j + 1]) for j in range(n)) / n, 0.0)
        terms = [1.3 * (1 - torch.sigmoid(0.3 * (logps[2 * j] - refs[2 * j] - z0))) if values[j] else
                 0.7 * (1 - torch.sigmoid(0.3 * (z0 - logps[2 * j] + refs[2 * j]))) for j in range(n)]
    elif name == "orpo":
        terms = []
        for j in range(n):
            ac, ar = logps[2 * j] / lengths[2 * j], logps[2 * j + 1] / lengths[2 * j + 1]
            odds = (ac - ar) - (torch.log1p(-torch.exp(ac)) - torch.log1p(-torch.exp(ar)))
            terms.append(-ac - 0.2 * torch.nn.functional.logsigmoid(odds))
    else:
        terms = []
        for j in range(n):
            x = 2.0 * (logps[2 * j] / lengths[2 * j] - logps[2 * j + 1] / lengths[2 * j + 1]) - 0.5
            terms.append(-0.9 * torch.nn.functional.logsigmoid(x) - 0.1 * torch.nn.functional.logsigmoid(-x))
    return sum(terms) / n


@pytest.mark.parametrize("name", ["kto", "orpo", "simpo"])
def test_microbatch_split_gives_the_hand_computed_gradient_and_loss(name, tmp_path):
    policy, ref_model = tiny_model(1), tiny_model(2).requires_grad_(False)
    batch = method_batch(name, tmp_path)
    objective = method_objective(name, policy, Reference(ref_model))
    whole, values = grads_and_values(policy, objective, [batch])
    rows = batch.input_ids.shape[0]
    parts = [collate([row_sample(batch, i) for i in idx]) for idx in ([0], [1, 2, 3], list(range(4, rows)))]
    split, split_values = grads_and_values(policy, objective, parts)
    for key in whole:
        assert torch.allclose(whole[key], split[key], rtol=1e-5, atol=1e-7), key
    for key in values:
        assert float(values[key]) == pytest.approx(float(split_values[key]), rel=1e-4, abs=1e-6), key
    policy.zero_grad()
    want = hand_loss(name, policy, ref_model, batch)
    assert float(values["loss"]) == pytest.approx(float(want.detach()), rel=1e-5)
    want.backward()
    for key, p in policy.named_parameters():
        assert torch.allclose(whole[key], p.grad, rtol=1e-4, atol=1e-6), key
    if name == "kto":
        assert float(values["kl"]) >= 0
        assert float(values["examples"]) == sum(len(row) for row in batch.document_lengths) // 2


# ---------------------------------------------------------------------------------------- ranks
def test_two_ranks_equal_one_process_for_every_method(tmp_path):
    """One torchrun launch checks all three methods (2 gloo ranks, each half the rows in 2 microbatches)."""
    script = Path(__file__).with_name("_preference_ddp_check.py")
    out = tmp_path / "ranks.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=cli_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out)
    for name in ("kto", "orpo", "simpo"):
        policy, ref_model = tiny_model(1), tiny_model(2).requires_grad_(False)
        batch = method_batch(name, tmp_path)
        grads, values = grads_and_values(policy, method_objective(name, policy, Reference(ref_model)), [batch])
        for key, g in grads.items():
            assert torch.allclose(got[name]["grads"][key], g, rtol=1e-5, atol=1e-7), (name, key)
        for key, v in values.items():
            assert got[name]["values"][key] == pytest.approx(float(v), rel=1e-4, abs=1e-6), (name, key)


# ---------------------------------------------------------------------------------------- the CLI
RUN = {"data_seq_len": 256, "training_global_batch_size": 4, "training_micro_batch_size": 2, "data_prefetch": 0,
       "optimizer_lr": 1e-2, "schedule_kind": "constant", "schedule_warmup_steps": 0, "model_tokenizer": SMOLLM2,
       "model_dim": 32, "model_n_layers": 1, "data_overlong": "skip"}  # the 33 pairs that fit 256 tokens whole
WANT = {"kto": ("kl", "rewards/margins", "logps/rejected", "examples"),
        "orpo": ("nll/chosen", "log_odds_ratio", "log_odds_chosen", "rewards/accuracies"),
        "simpo": ("loss/simpo", "rewards/margins", "rewards/accuracies", "pairs")}


@pytest.mark.parametrize("name", ["kto", "orpo", "simpo"])
def test_cli_on_the_real_pairs_logs_metrics_and_resume_equals_uninterrupted(name, tmp_path):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    common = [name, *tiny_run_args(PAIRS, **RUN)]
    for run, extra in ((straight, ["--training.steps=6", "--eval.interval=6", "--eval.steps=4", "--eval.batch_size=8"]),
                       (interrupted, ["--training.steps=3", "--checkpoint.interval=3"]),
                       (interrupted, ["--training.steps=6", "--checkpoint.interval=3"])):
        assert lmforge_in_process(*common, *extra, f"--run.dir={run}") == 0, (name, run)
    pick = lambda run: {r["step"]: [r[k] for k in ("loss", "grad_norm", *WANT[name])]  # noqa: E731
                        for r in read_records(run, "train")}
    a, b = pick(straight), pick(interrupted)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        assert b[step] == pytest.approx(a[step], rel=1e-5), step
    evals = read_records(straight, "eval")
    assert [e["step"] for e in evals] == [0, 6] and set(WANT[name]) <= set(evals[-1])
    assert evals[-1]["loss"] < evals[0]["loss"]  # it learns the pairs' preferences (33 of them, scored whole)
    data = [r for r in read_records(straight) if r["kind"] == f"{name}_data"]
    assert data[0]["records"] == 78 and data[0]["message"].startswith(f"{name} data ")
