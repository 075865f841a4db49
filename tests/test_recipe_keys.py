"""Every preference and GRPO hyper-parameter key reaches the loss: each case parses the command-line
flags into the recipe's config, builds the objective the way the recipe's ``build`` does (its
``objective``), and checks the logged loss against the method's formula written out here with the
flag's value, from each sequence's full-logit log-probs. A key that is hard-coded, swapped or dropped
on the way changes the number."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from _pairs import Reference, full_logit_logprob, grads_and_values, row_sample, split_documents, task_pairs, tiny_model
from lmforge.config import load_config
from lmforge.data.chat import ByteChatFormat
from lmforge.data.packing import collate
from lmforge.data.preference_data import build_preference_dataset
from lmforge.data.unpaired_data import build_unpaired_dataset
from lmforge.models.tokenizer import ByteTokenizer
from lmforge.recipes.dpo import DPO, DPOConfig
from lmforge.recipes.kto import KTO, KTOConfig
from lmforge.recipes.orpo import ORPO, ORPOConfig
from lmforge.recipes.simpo import SimPO, SimPOConfig

logsig = lambda x: -math.log1p(math.exp(-x)) if x > -30 else x - math.log1p(math.exp(x))  # noqa: E731
sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731


def pair_batch(tmp_path: Path, unpaired: bool = False):
    tok = ByteTokenizer()
    if unpaired:
        path = tmp_path / "pairs.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for _, r in task_pairs(9)))
        dataset, _ = build_unpaired_dataset(str(path), tok, ByteChatFormat(tok), 64, True)
    else:
        dataset, _ = build_preference_dataset(task_pairs(9), "t", tok, ByteChatFormat(tok), seq_len=64)
    return collate([dataset[i] for i in range(4)])


def sequences(batch, policy, ref_model):
    """Per sequence (chosen, rejected alternating): policy and reference log-prob sums, token counts."""
    seqs = [doc for i in range(batch.input_ids.shape[0]) for doc in split_documents(row_sample(batch, i))]
    with torch.no_grad():
        pol = [float(full_logit_logprob(policy, ids, labels)) for ids, labels in seqs]
        ref = [float(full_logit_logprob(ref_model, ids, labels)) for ids, labels in seqs]
    return pol, ref, [int((labels >= 0).sum()) for _, labels in seqs]


@pytest.fixture(scope="module")
def models():
    return tiny_model(1), tiny_model(2).requires_grad_(False)


def logged(policy, objective, batch) -> dict[str, float]:
    _, values = grads_and_values(policy, objective, [batch])
    return {k: float(v) for k, v in values.items()}


def dpo_formula(pol, ref, n, beta, loss_type="sigmoid", ls=0.0, nll=0.0, ipo_per_token=True) -> float:
    out = []
    for j in range(len(pol) // 2):
        c, r = 2 * j, 2 * j + 1
        if loss_type == "ipo":
            z = ((pol[c] - ref[c]) / n[c] - (pol[r] - ref[r]) / n[r]) if ipo_per_token else \
                (pol[c] - ref[c]) - (pol[r] - ref[r])
            loss = (z - 1 / (2 * beta)) ** 2
        else:
            z = (pol[c] - ref[c]) - (pol[r] - ref[r])
            loss = -(1 - ls) * logsig(beta * z) - ls * logsig(-beta * z)
        out.append(loss - nll * pol[c] / n[c])
    return sum(out) / len(out)


DPO_CASES = {  # flags -> the formula's arguments
    "defaults": ([], dict(beta=0.1)),
    "beta": (["--dpo.beta=0.7"], dict(beta=0.7)),
    "label_smoothing": (["--dpo.beta=0.7", "--dpo.label_smoothing=0.2"], dict(beta=0.7, ls=0.2)),
    "nll_weight": (["--dpo.nll_weight=0.5"], dict(beta=0.1, nll=0.5)),
    "ipo": (["--dpo.loss_type=ipo", "--dpo.beta=0.4"], dict(beta=0.4, loss_type="ipo")),
    "ipo_summed": (["--dpo.loss_type=ipo", "--dpo.beta=0.4", "--dpo.ipo_per_token=false"],
                   dict(beta=0.4, loss_type="ipo", ipo_per_token=False)),
}


@pytest.mark.parametrize("case", DPO_CASES)
def test_dpo_keys_reach_the_loss(case, models, tmp_path):
    policy, ref_model = models
    flags, args = DPO_CASES[case]
    batch = pair_batch(tmp_path)
    objective = DPO.objective(load_config(DPOConfig, None, flags), Reference(ref_model))
    want = dpo_formula(*sequences(batch, policy, ref_model), **args)
    assert logged(policy, objective, batch)["loss"] == pytest.approx(want, rel=1e-5)


def test_ipo_per_token_and_summed_differ_as_trl_says(models, tmp_path):
    """The two IPO forms are far apart on real pairs (a target margin per token or per sequence)."""
    policy, ref_model = models
    pol, ref, n = sequences(pair_batch(tmp_path), policy, ref_model)
    per_token, summed = (dpo_formula(pol, ref, n, 0.4, "ipo", ipo_per_token=f) for f in (True, False))
    assert abs(per_token - summed) > 0.1 * abs(per_token)


def test_kto_keys_reach_the_loss(models, tmp_path):
    """beta and both weights; the weights are unequal, so swapping them changes the loss."""
    policy, ref_model = models
    batch = pair_batch(tmp_path, unpaired=True)
    pol, ref, _ = sequences(batch, policy, ref_model)
    labels = [v for row in batch.document_values for v in row[0::2]]
    m = len(pol) // 2
    z0 = max(sum(pol[2 * j + 1] - ref[2 * j + 1] for j in range(m)) / m, 0.0)
    for beta, wd, wu in ((0.1, 1.0, 1.0), (0.7, 1.5, 0.6)):
        flags = [f"--kto.beta={beta}", f"--kto.desirable_weight={wd}", f"--kto.undesirable_weight={wu}"]
        objective = KTO.objective(load_config(KTOConfig, None, flags), policy, Reference(ref_model))
        want = [wd * (1 - sigmoid(beta * (pol[2 * j] - ref[2 * j] - z0))) if labels[j] else
                wu * (1 - sigmoid(beta * (z0 - pol[2 * j] + ref[2 * j]))) for j in range(m)]
        assert sum(labels) not in (0, m)  # both kinds present: each weight acts
        assert logged(policy, objective, batch)["loss"] == pytest.approx(sum(want) / m, rel=1e-5), (beta, wd, wu)


@pytest.mark.parametrize("flags, lam, nll", [([], 0.1, "pair"), (["--orpo.beta=0.3"], 0.3, "pair"),
                                             (["--orpo.beta=0.3", "--orpo.nll=token"], 0.3, "token")])
def test_orpo_keys_reach_the_loss(flags, lam, nll, models, tmp_path):
    policy, _ = models
    batch = pair_batch(tmp_path)
    pol, _, n = sequences(batch, policy, policy)
    m = len(pol) // 2
    odds = []
    for j in range(m):
        ac, ar = pol[2 * j] / n[2 * j], pol[2 * j + 1] / n[2 * j + 1]
        odds.append(logsig((ac - ar) - (math.log1p(-math.exp(ac)) - math.log1p(-math.exp(ar)))))
    if nll == "pair":
        sft = sum(-pol[2 * j] / n[2 * j] for j in range(m)) / m
    else:  # TRL: one cross-entropy over every chosen token of the batch
        sft = -sum(pol[0::2]) / sum(n[0::2])
    got = logged(policy, ORPO.objective(load_config(ORPOConfig, None, flags)), batch)
    assert got["loss"] == pytest.approx(sft - lam * sum(odds) / m, rel=1e-5)
    assert got["nll/chosen"] == pytest.approx(sft, rel=1e-5)


@pytest.mark.parametrize("flags, beta, gamma, ls, nll", [
    ([], 2.0, 1.0, 0.0, 0.0),
    (["--simpo.beta=2.5", "--simpo.gamma=0.3", "--simpo.label_smoothing=0.1", "--simpo.nll_weight=0.4"],
     2.5, 0.3, 0.1, 0.4)])
def test_simpo_keys_reach_the_loss(flags, beta, gamma, ls, nll, models, tmp_path):
    policy, _ = models
    batch = pair_batch(tmp_path)
    pol, _, n = sequences(batch, policy, policy)
    m = len(pol) // 2
    want = []
    for j in range(m):
        ac, ar = pol[2 * j] / n[2 * j], pol[2 * j + 1] / n[2 * j + 1]
        x = beta * (ac - ar) - gamma
        want.append(-(1 - ls) * logsig(x) - ls * logsig(-x) - nll * ac)
    got = logged(policy, SimPO.objective(load_config(SimPOConfig, None, flags)), batch)
    assert got["loss"] == pytest.approx(sum(want) / m, rel=1e-5)


# ---------------------------------------------------------------------------------------- GRPO
GRPO_CASES = {  # flags -> GRPOLoss arguments that differ from the defaults
    "epsilon_low": (["--grpo.epsilon_low=0.05"], dict(eps_low=0.05)),
    "epsilon_high": (["--grpo.epsilon_high=0.05"], dict(eps_high=0.05)),
    "beta": (["--grpo.beta=0.3"], dict(beta=0.3)),
    "loss_aggregation": (["--grpo.loss_aggregation=dapo"], dict(aggregation="dapo")),
    "max_new_tokens": (["--grpo.loss_aggregation=dr_grpo", "--grpo.max_new_tokens=11"],
                       dict(aggregation="dr_grpo", max_new_tokens=11)),
    "temperature": (["--grpo.temperature=0.7"], dict(temperature=0.7)),
    "tis_cap": (["--grpo.tis_cap=1.1"], dict(tis_cap=1.1)),
    "policy_loss": (["--grpo.policy_loss=cispo", "--grpo.epsilon_low=1", "--grpo.epsilon_high=0.1"],
                    dict(policy_loss="cispo", eps_low=1.0, eps_high=0.1)),
}


def grpo_value(loss_fn, logits, batch) -> float:
    from lmforge.objectives.grpo import loss_normalizer

    from test_grpo_policy_losses import Logits

    objective, _ = loss_fn(Logits(logits), batch)
    return float(objective.detach() / loss_normalizer([batch], loss_fn.aggregation, loss_fn.max_new_tokens))


@pytest.mark.parametrize("case", GRPO_CASES)
def test_grpo_keys_reach_the_loss(case):
    """The recipe's objective equals the loss built with the flag's value by hand (whose formulas
    tests/test_grpo_policy_losses.py checks), and differs from the default's."""
    from lmforge.objectives.grpo import GRPOLoss
    from lmforge.recipes.grpo import GRPO, GRPOConfig

    from test_grpo_policy_losses import _random_batch

    logits, batch = _random_batch(3, spread=0.4)
    g = torch.Generator().manual_seed(4)
    batch.ref_logprobs = (batch.old_logprobs + 0.3 * torch.randn(batch.mask.shape, generator=g)) * batch.mask
    batch.rollout_logprobs = (batch.old_logprobs + 0.2 * torch.randn(batch.mask.shape, generator=g)) * batch.mask
    defaults = dict(eps_low=0.2, eps_high=0.2, beta=0.0, aggregation="grpo", max_new_tokens=16, temperature=1.0,
                    tis_cap=0.0, policy_loss="ppo")
    flags, changed = GRPO_CASES[case]
    cfg = load_config(GRPOConfig, None, flags)
    got = grpo_value(GRPO.objective(cfg).loss_fn, logits, batch)
    want = grpo_value(GRPOLoss(**(defaults | changed)), logits, batch)
    default = grpo_value(GRPOLoss(**defaults), logits, batch)
    assert got == pytest.approx(want, rel=1e-6)
    assert abs(want - default) > 1e-4 * max(abs(default), 1e-3), "the case must move the loss"


@pytest.mark.parametrize("std", ["population", "sample"])
def test_grpo_rollout_keys_reach_the_advantages(std):
    """scale_rewards and advantage_std (and the keys the rollout reads) reach the rollout's settings,
    and the advantages divide by the standard deviation the key names."""
    from lmforge.objectives.grpo import STD_EPS, group_advantages
    from lmforge.recipes.grpo import GRPOConfig
    from lmforge.rl.rollout_source import rollout_settings

    cfg = load_config(GRPOConfig, None, ["--grpo.num_generations=4", f"--grpo.advantage_std={std}",
                                         "--grpo.scale_rewards=group", "--grpo.mask_truncated=true",
                                         "--grpo.num_iterations=2", "--grpo.tis_cap=2", "--grpo.max_new_tokens=9",
                                         "--grpo.temperature=0.5", "--grpo.top_p=0.9"])
    s = rollout_settings(cfg.grpo, cfg.training)
    assert (s.num_generations, s.advantage_std, s.advantage_scale, s.mask_truncated, s.need_old_logprobs,
            s.need_rollout_logprobs, s.max_new_tokens, s.temperature, s.top_p) == \
        (4, std, "group", True, True, True, 9, 0.5, 0.9)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 1.0, 1.0, 0.0])
    adv, _ = group_advantages(rewards, 4, s.advantage_scale, s.advantage_std)
    want = []
    for group in (rewards[:4].tolist(), rewards[4:].tolist()):
        mean = sum(group) / 4
        var = sum((r - mean) ** 2 for r in group) / (4 if std == "population" else 3)
        want += [(r - mean) / (math.sqrt(var) + STD_EPS) for r in group]
    assert adv.tolist() == pytest.approx(want, rel=1e-6)
    adv, _ = group_advantages(rewards, 4, "batch", s.advantage_std)  # one std over the whole batch
    mean, n = float(rewards.mean()), rewards.numel()
    var = float(((rewards - mean) ** 2).sum()) / (n if std == "population" else n - 1)
    centered = torch.cat([rewards[:4] - rewards[:4].mean(), rewards[4:] - rewards[4:].mean()])
    assert adv.tolist() == pytest.approx((centered / (math.sqrt(var) + STD_EPS)).tolist(), rel=1e-6)


def test_kto_reference_point_is_clamped_at_zero(tmp_path):
    """The mismatched completions' mean log-ratio is an estimate of a KL divergence, so never below 0:
    with the two models one way round it is positive and used as it is, the other way round negative
    and clamped, in the training step (step-global) and in eval (per batch) alike."""
    from lmforge.training.train_step import compute_global_loss

    batch = pair_batch(tmp_path, unpaired=True)
    labels = [v for row in batch.document_values for v in row[0::2]]
    a, b = tiny_model(1), tiny_model(2)
    signs = []
    for policy, ref_model in ((a, b), (b, a)):
        ref_model.requires_grad_(False)
        policy.requires_grad_(True)
        pol, ref, _ = sequences(batch, policy, ref_model)
        m = len(pol) // 2
        raw = sum(pol[2 * j + 1] - ref[2 * j + 1] for j in range(m)) / m
        signs.append(raw > 0)

        def formula(z0: float) -> float:
            return sum(1 - sigmoid(0.5 * (pol[2 * j] - ref[2 * j] - z0)) if labels[j] else
                       1 - sigmoid(0.5 * (z0 - pol[2 * j] + ref[2 * j])) for j in range(m)) / m

        objective = KTO.objective(load_config(KTOConfig, None, ["--kto.beta=0.5"]), policy, Reference(ref_model))
        train = logged(policy, objective, batch)
        with torch.no_grad():
            _, stats = objective.loss_fn(policy, batch)  # eval: no prepared step, the batch's own point
        evaluated = {k: float(v) for k, v in objective.log_values(compute_global_loss(stats)).items()}
        z0 = max(raw, 0.0)
        for values in (train, evaluated):
            assert values["kl"] == pytest.approx(z0, rel=1e-5, abs=1e-6)
            assert values["loss"] == pytest.approx(formula(z0), rel=1e-5)
        assert abs(formula(z0) - formula(raw)) > 1e-4 or raw > 0  # where clamped, the clamp moves the loss
    assert sorted(signs) == [False, True], "one ordering must give a negative estimate"


def test_orpo_token_nll_does_not_change_with_the_microbatch_split(models, tmp_path):
    """orpo.nll=token is one mean over the step's chosen tokens, whatever the split (TRL's is per
    device batch): the same gradient and values from one microbatch or three."""
    policy, _ = models
    batch = pair_batch(tmp_path)
    objective = ORPO.objective(load_config(ORPOConfig, None, ["--orpo.nll=token"]))
    whole, values = grads_and_values(policy, objective, [batch])
    parts = [collate([row_sample(batch, i) for i in idx]) for idx in ([0], [1, 2], [3])]
    split, split_values = grads_and_values(policy, objective, parts)
    for key in whole:
        assert torch.allclose(whole[key], split[key], rtol=1e-5, atol=1e-7), key
    assert float(split_values["nll/chosen"]) == pytest.approx(float(values["nll/chosen"]), rel=1e-5)
    assert float(split_values["loss"]) == pytest.approx(float(values["loss"]), rel=1e-5)
