"""grpo.policy_loss: GSPO and CISPO against the papers' formulas (loss and gradient), PPO unchanged,
the refusal of gspo with a token-level aggregation, and tiny end-to-end runs of each."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lmforge.errors import UserError
from lmforge.objectives.grpo import GRPOLoss, PolicyBatch, aggregation_weight, loss_normalizer
from lmforge.training.train_step import gradient_computation
from test_grpo import TINY_REWARD, _grpo


class Logits(nn.Module):
    """A 'model' whose logits are the parameter, projected through the loss head with an identity weight."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = nn.Parameter(logits.clone())

    def forward(self, input_ids: torch.Tensor, head=None):
        rows = self.logits[input_ids[:, 0]]  # input_ids[:, 0] is the row index: microbatches may split rows
        return head(rows, torch.eye(rows.shape[-1]))


def _run(loss_fn: GRPOLoss, logits: torch.Tensor, batch: PolicyBatch) -> tuple[float, torch.Tensor, dict]:
    """Normalized loss, gradient of the logits and the summed stats, as one microbatch of a step."""
    model = Logits(logits)
    objective, stats = loss_fn(model, batch)
    normalizer = aggregation_weight(batch.mask, loss_fn.aggregation, loss_fn.max_new_tokens)
    (objective / normalizer).backward()
    return float(objective.detach() / normalizer), model.logits.grad, {k: float(v) for k, v in stats.sums.items()}


def _target_logp(logits: torch.Tensor, batch: PolicyBatch, temperature: float = 1.0) -> torch.Tensor:
    return torch.log_softmax(logits / temperature, -1).gather(-1, batch.targets[..., None])[..., 0]


def _denominator(mask: torch.Tensor, mode: str, max_new_tokens: int) -> float:
    lengths = mask.sum(1)
    return {"grpo": float((lengths > 0).sum()), "dapo": float(lengths.sum()),
            "dr_grpo": float(mask.shape[0] * max_new_tokens)}[mode]


# ------------------------------------------------------------------ references from the papers
def gspo_reference(logits, batch, eps_low, eps_high, tis=None):
    """GSPO's objective: one ratio s_i per completion, clipped, averaged over completions. Written
    directly (the gradient flows through s_i); with ``tis`` in the paper's GSPO-token form
    s_it = sg[s_i] pi(t) / sg[pi(t)], each token's term times its own weight tis_t."""
    logits = logits.clone().requires_grad_(True)
    logp = _target_logp(logits, batch)
    total, n = 0.0, 0
    for i in range(logp.shape[0]):
        on = batch.mask[i] > 0
        if not on.any():
            continue
        s = torch.exp((logp[i][on] - batch.old_logprobs[i][on]).mean())
        a = batch.advantages[i]
        if tis is None:
            total = total - torch.minimum(s * a, s.clamp(1 - eps_low, 1 + eps_high) * a)
        else:
            s_t = s.detach() * torch.exp(logp[i][on]) / torch.exp(logp[i][on]).detach()
            token = -torch.minimum(s_t * a, s_t.clamp(1 - eps_low, 1 + eps_high) * a)
            total = total + (token * tis[i][on]).mean()
        n += 1
    total = total / n
    total.backward()
    return float(total.detach()), logits.grad


def gspo_paper_gradient(logits, batch, eps_low, eps_high, tis=None):
    """The paper's gradient, by hand: -(A_i s_i / |o_i|) grad log pi(t) for every token of an unclipped
    completion, nothing for one clipped on the side A_i pushes; chained to the logits by autograd."""
    logits = logits.clone().requires_grad_(True)
    logp = _target_logp(logits, batch)
    d_logp = torch.zeros_like(logp)
    n = int((batch.mask.sum(1) > 0).sum())
    for i in range(logp.shape[0]):
        on = batch.mask[i] > 0
        if not on.any():
            continue
        s = math.exp(float((logp[i][on] - batch.old_logprobs[i][on]).mean().detach()))
        a = float(batch.advantages[i])
        if (a > 0 and s > 1 + eps_high) or (a < 0 and s < 1 - eps_low):
            continue
        w = torch.ones(int(on.sum())) if tis is None else tis[i][on]
        d_logp[i, on] = -a * s / int(on.sum()) * w / n
    (grad,) = torch.autograd.grad(logp, logits, grad_outputs=d_logp)
    return grad


def cispo_reference(logits, batch, eps_low, eps_high, mode, max_new_tokens):
    """MiniMax-M1's CISPO: -sg(clip(r_t)) A_i log pi(t) per token, aggregated as ``mode``."""
    logits = logits.clone().requires_grad_(True)
    logp = _target_logp(logits, batch)
    terms = []
    for i in range(logp.shape[0]):
        on = batch.mask[i] > 0
        w = torch.exp(logp[i][on] - batch.old_logprobs[i][on]).clamp(1 - eps_low, 1 + eps_high).detach()
        terms.append(-w * batch.advantages[i] * logp[i][on])
    if mode == "grpo":
        total = sum(t.mean() for t in terms if t.numel()) / _denominator(batch.mask, mode, max_new_tokens)
    else:
        total = sum(t.sum() for t in terms) / _denominator(batch.mask, mode, max_new_tokens)
    total.backward()
    return float(total.detach()), logits.grad


# ------------------------------------------------------------------ batches
EPS = 0.2
V = 3
LP = -math.log(V)  # uniform logits: log pi = -log 3 for every target
RATIOS = [  # pi / pi_old per token (None: masked), one advantage per completion
    ([1.5, 0.82, 0.9, None], 1.0),  # s = 1.034: gspo keeps it whole, ppo drops token 0 (1.5 > 1.2, A > 0)
    ([None, 0.6, 0.85, None], -1.0),  # s = 0.714 < 0.8, A < 0: gspo drops it, ppo keeps token 2
    ([1.3, 1.3, 1.1, 1.25], 2.0),   # s = 1.236 > 1.2, A > 0: gspo drops it, ppo keeps token 2
    ([1.3, None, None, None], -0.5),  # s > 1.2 but A < 0: the min keeps s * A, the gradient flows
    ([0.5, 0.6, None, None], 1.0),  # s < 0.8 but A > 0: flows
    ([None, None, None, None], 1.0),  # no completion tokens (e.g. masked as truncated)
]


def _clip_batch() -> tuple[torch.Tensor, PolicyBatch, list[float]]:
    B, T = len(RATIOS), 4
    mask = torch.tensor([[float(r is not None) for r in rs] for rs, _ in RATIOS])
    old = torch.tensor([[LP - math.log(r) if r is not None else 0.0 for r in rs] for rs, _ in RATIOS])
    adv = torch.tensor([a for _, a in RATIOS])
    seq_ratio = [math.exp(sum(math.log(r) for r in rs if r is not None) / max(sum(r is not None for r in rs), 1))
                 for rs, _ in RATIOS]
    batch = PolicyBatch(torch.arange(B)[:, None].expand(B, T).clone(), torch.zeros(B, T, dtype=torch.long),
                        mask, adv, old)
    return torch.zeros(B, T, V), batch, seq_ratio


def _random_batch(seed: int, spread: float) -> tuple[torch.Tensor, PolicyBatch]:
    """Random logits and targets, ragged masks, both advantage signs, pi_old off by ``spread`` in log."""
    g = torch.Generator().manual_seed(seed)
    B, T, Vr = 6, 7, 11
    logits = torch.randn(B, T, Vr, generator=g)
    targets = torch.randint(0, Vr, (B, T), generator=g)
    lengths = [7, 2, 5, 1, 4, 6]
    mask = torch.tensor([[float(i < n) for i in range(T)] for n in lengths])
    mask[2, 0] = mask[5, 3] = 0.0  # holes: prompt or tool tokens inside the span
    adv = torch.tensor([1.2, -0.7, 0.4, -1.5, 2.0, -0.3])
    logp = _target_logp(logits, PolicyBatch(targets, targets, mask, adv))
    old = (logp + spread * torch.randn(B, T, generator=g)) * mask
    return logits, PolicyBatch(torch.arange(B)[:, None].expand(B, T).clone(), targets, mask, adv, old)


def _loss(policy_loss: str, mode: str = "grpo", eps_low: float = EPS, eps_high: float = EPS, **kw) -> GRPOLoss:
    return GRPOLoss(eps_low=eps_low, eps_high=eps_high, beta=kw.pop("beta", 0.0), aggregation=mode,
                    max_new_tokens=kw.pop("max_new_tokens", 8), temperature=1.0, policy_loss=policy_loss, **kw)


# ------------------------------------------------------------------ GSPO
def test_gspo_clips_whole_completions_where_ppo_clips_tokens():
    logits, batch, seq_ratio = _clip_batch()
    loss, grad, sums = _run(_loss("gspo"), logits, batch)
    want_loss, want_grad = gspo_reference(logits, batch, EPS, EPS)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, gspo_paper_gradient(logits, batch, EPS, EPS), rtol=1e-5, atol=1e-7)
    moved = grad.abs().sum(-1) > 0
    alive_seq = [True, False, False, True, True, False]
    for i, (rs, _) in enumerate(RATIOS):
        for t, r in enumerate(rs):
            assert bool(moved[i, t]) == (r is not None and alive_seq[i]), (i, t)
    # the clip counts are the tokens of the clipped completions, on the side the advantage pushes
    assert seq_ratio[1] < 1 - EPS and seq_ratio[2] > 1 + EPS
    assert sums["clip_low_count"] == 2 and sums["clip_high_count"] == 4

    _, ppo_grad, ppo_sums = _run(_loss("ppo"), logits, batch)
    ppo_moved = ppo_grad.abs().sum(-1) > 0
    assert not ppo_moved[0, 0] and moved[0, 0]  # token-level clip drops it, the sequence ratio keeps it
    assert ppo_moved[1, 2] and ppo_moved[2, 2] and not moved[1, 2] and not moved[2, 2]
    assert ppo_sums["clip_low_count"] == 1 != sums["clip_low_count"]


@pytest.mark.parametrize("spread,eps", [(0.3, (0.2, 0.28)), (0.002, (3e-4, 4e-4))])
def test_gspo_matches_the_paper_on_ragged_random_batches(spread, eps):
    """Random ratios, the paper's tiny clip range among them; the gradient is the sequence-level one,
    which differs from the token-level ratio's (the test would pass a wrong ratio otherwise)."""
    logits, batch = _random_batch(1, spread)
    loss, grad, _ = _run(_loss("gspo", eps_low=eps[0], eps_high=eps[1]), logits, batch)
    want_loss, want_grad = gspo_reference(logits, batch, *eps)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, gspo_paper_gradient(logits, batch, *eps), rtol=1e-5, atol=1e-7)
    unclipped = _run(_loss("ppo", eps_low=10.0, eps_high=10.0), logits, batch)[1]  # sum_t r_t grad log pi / |o|
    assert not torch.allclose(unclipped, grad, rtol=1e-3, atol=1e-6)


def test_gspo_with_truncated_importance_weights():
    """Each token's term times min(pi_old / pi_rollout, cap): the value is loss_i times the completion's
    mean weight, the gradient weights each token's grad log pi by its own."""
    logits, batch = _random_batch(2, 0.1)
    g = torch.Generator().manual_seed(9)
    batch.rollout_logprobs = batch.old_logprobs + 0.3 * torch.randn(batch.mask.shape, generator=g)
    tis = torch.exp(batch.old_logprobs - batch.rollout_logprobs).clamp(max=1.5)
    loss, grad, sums = _run(_loss("gspo", tis_cap=1.5), logits, batch)
    want_loss, want_grad = gspo_reference(logits, batch, EPS, EPS, tis=tis)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, gspo_paper_gradient(logits, batch, EPS, EPS, tis=tis), rtol=1e-5, atol=1e-7)
    assert sums["tis_weight_sum"] == pytest.approx(float((tis * batch.mask).sum()), rel=1e-5)


def test_gspo_refuses_token_level_aggregations():
    from lmforge.config import load_config
    from lmforge.recipes.grpo import GRPOConfig

    for mode in ("dapo", "dr_grpo"):
        want = rf"grpo.policy_loss = 'gspo'.*grpo.loss_aggregation = 'grpo' \(got '{mode}'\)"
        with pytest.raises(UserError, match=want):
            load_config(GRPOConfig, None, ["--grpo.policy_loss=gspo", f"--grpo.loss_aggregation={mode}"])
        with pytest.raises(ValueError, match="loss_aggregation"):
            _loss("gspo", mode)
    cfg = load_config(GRPOConfig, None, ["--grpo.policy_loss=cispo", "--grpo.loss_aggregation=dapo",
                                         "--grpo.epsilon_low=1"])
    assert (cfg.grpo.policy_loss, cfg.grpo.epsilon_low) == ("cispo", 1.0)
    assert GRPOConfig().grpo.policy_loss == "ppo"


# ------------------------------------------------------------------ CISPO
@pytest.mark.parametrize("mode", ["grpo", "dapo", "dr_grpo"])
def test_cispo_matches_minimax_and_keeps_every_token(mode):
    logits, batch, _ = _clip_batch()
    for eps_low in (EPS, 1.0):  # 1.0: no lower bound, MiniMax's setting
        loss, grad, sums = _run(_loss("cispo", mode, eps_low=eps_low, max_new_tokens=6), logits, batch)
        want_loss, want_grad = cispo_reference(logits, batch, eps_low, EPS, mode, 6)
        assert loss == pytest.approx(want_loss, rel=1e-5)
        torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)
        moved = grad.abs().sum(-1) > 0
        assert torch.equal(moved, batch.mask > 0)  # clipping never drops a token
        ratios = [r for rs, _ in RATIOS for r in rs if r is not None]
        high, low = sum(r > 1 + EPS for r in ratios), sum(r < 1 - eps_low for r in ratios)
        assert sums["clip_high_count"] == high > 0 and sums["clip_low_count"] == low  # capped, either sign
        assert (low > 0) == (eps_low < 1)
    # a capped token's gradient is its weight's cap times the policy gradient: by hand for token (0, 0)
    # (ratio 1.5, A = 1; the grpo aggregation first averages over the completion's 3 tokens)
    d = torch.zeros(batch.mask.shape)
    d[0, 0] = -(1 + EPS) * 1.0 / (3 if mode == "grpo" else 1) / _denominator(batch.mask, mode, 6)
    (by_hand,) = _chain_to_logits(logits, batch, d)
    torch.testing.assert_close(grad[0, 0], by_hand[0, 0], rtol=1e-5, atol=1e-7)


def _chain_to_logits(logits, batch, d):
    """The gradient of the logits for hand-written coefficients ``d`` of each token's log pi."""
    leaf = logits.clone().requires_grad_(True)
    logp = _target_logp(leaf, batch)
    return torch.autograd.grad(logp, leaf, grad_outputs=d)


def test_cispo_random_batch_differs_from_ppo():
    logits, batch = _random_batch(3, 0.4)
    loss, grad, _ = _run(_loss("cispo", "dapo", eps_low=1.0, eps_high=0.28), logits, batch)
    want_loss, want_grad = cispo_reference(logits, batch, 1.0, 0.28, "dapo", 8)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)
    _, ppo_grad, _ = _run(_loss("ppo", "dapo", eps_low=1.0, eps_high=0.28), logits, batch)
    assert not torch.allclose(ppo_grad, grad, rtol=1e-3, atol=1e-6)


def test_on_policy_all_three_are_the_policy_gradient():
    """pi_old = pi (one update per rollout): every ratio is 1, nothing clips, and all three losses give
    -(A_i / |o_i|) grad log pi(t) per token under the grpo aggregation."""
    logits, batch = _random_batch(6, 0.0)
    batch.old_logprobs = None
    grads = [_run(_loss(name, eps_low=3e-4, eps_high=4e-4), logits, batch)[1] for name in ("ppo", "gspo", "cispo")]
    lengths = batch.mask.sum(1, keepdim=True)
    d = -batch.advantages[:, None] * batch.mask / lengths.clamp(min=1) / float((lengths > 0).sum())
    (want,) = _chain_to_logits(logits, batch, d)
    for g in grads:
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ PPO unchanged, every loss split-invariant
def ppo_as_before(logits, batch, eps_low, eps_high, beta, mode, max_new_tokens, tis_cap):
    """The token-level surrogate with the operations of the loss before policy_loss existed."""
    logits = logits.clone().requires_grad_(True)
    logp = _target_logp(logits, batch) * batch.mask
    mask, adv = batch.mask, batch.advantages.unsqueeze(1)
    ratio = torch.exp(logp - batch.old_logprobs)
    surrogate = -torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
    if tis_cap:
        surrogate = surrogate * torch.exp(batch.old_logprobs - batch.rollout_logprobs).clamp(max=tis_cap)

    def agg(x):
        summed = (x * mask).sum(1)
        return (summed / mask.sum(1).clamp(min=1)).sum() if mode == "grpo" else summed.sum()

    objective = agg(surrogate)
    if beta:
        d = batch.ref_logprobs - logp
        objective = objective + beta * agg(torch.exp(d) - d - 1)
    total = objective / aggregation_weight(mask, mode, max_new_tokens)
    total.backward()
    clip_low = (((ratio < 1 - eps_low) & (adv < 0)).float() * mask).sum()
    clip_high = (((ratio > 1 + eps_high) & (adv > 0)).float() * mask).sum()
    return float(total.detach()), logits.grad, float(clip_low), float(clip_high)


@pytest.mark.parametrize("mode", ["grpo", "dapo", "dr_grpo"])
def test_ppo_is_the_loss_it_was(mode):
    logits, batch = _random_batch(4, 0.3)
    g = torch.Generator().manual_seed(11)
    batch.ref_logprobs = (batch.old_logprobs + 0.2 * torch.randn(batch.mask.shape, generator=g)) * batch.mask
    batch.rollout_logprobs = (batch.old_logprobs + 0.2 * torch.randn(batch.mask.shape, generator=g)) * batch.mask
    for beta, tis_cap in ((0.0, 0.0), (0.05, 2.0)):
        default = GRPOLoss(eps_low=0.2, eps_high=0.28, beta=beta, aggregation=mode, max_new_tokens=8, temperature=1.0,
                           tis_cap=tis_cap)
        assert default.policy_loss == "ppo"
        loss, grad, sums = _run(default, logits, batch)
        want_loss, want_grad, low, high = ppo_as_before(logits, batch, 0.2, 0.28, beta, mode, 8, tis_cap)
        assert loss == pytest.approx(want_loss, rel=1e-6)
        torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-8)
        assert (sums["clip_low_count"], sums["clip_high_count"]) == (low, high) and low + high > 0


@pytest.mark.parametrize("policy_loss,mode", [("gspo", "grpo"), ("cispo", "dapo"), ("cispo", "dr_grpo")])
def test_microbatch_split_gives_the_same_gradient(policy_loss, mode):
    logits, batch = _random_batch(5, 0.3)
    loss_fn = _loss(policy_loss, mode, beta=0.1, max_new_tokens=7)
    batch.ref_logprobs = batch.old_logprobs * 0.9
    fields = (batch.input_ids, batch.targets, batch.mask, batch.advantages, batch.old_logprobs, batch.ref_logprobs)
    halves = [PolicyBatch(*(t[s] for t in fields)) for s in (slice(0, 2), slice(2, 6))]
    grads = []
    for mbs in ([batch], halves):
        model = Logits(logits)
        gradient_computation(model, mbs, loss_fn, loss_normalizer(mbs, mode, 7))
        grads.append(model.logits.grad)
    torch.testing.assert_close(grads[0], grads[1])


# ------------------------------------------------------------------ end to end
def test_grpo_runs_with_gspo_and_cispo(tmp_path):
    """Three updates of the real CLI per policy loss, two per rollout so pi moves away from pi_old."""
    import json

    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Say something {i}", "id": i}) + "\n"
                                                    for i in range(8)))
    (tmp_path / "tiny_rewards.py").write_text(TINY_REWARD)
    common = dict(training_steps=3, training_global_batch_size=8, training_micro_batch_size=8,
                  grpo_num_generations=4, grpo_max_new_tokens=6, grpo_num_iterations=2, optimizer_lr=1e-2,
                  checkpoint_enabled=False)
    runs = _grpo(tmp_path, {
        "ppo": common,
        "gspo": dict(common, grpo_policy_loss="gspo", grpo_epsilon_low=3e-4, grpo_epsilon_high=4e-4),
        "cispo": dict(common, grpo_policy_loss="cispo", grpo_loss_aggregation="dapo", grpo_epsilon_low=1.0),
    })
    train = {name: [r for r in recs if r["kind"] == "train"] for name, recs in zip(("ppo", "gspo", "cispo"), runs)}
    for name, recs in train.items():
        assert [r["step"] for r in recs] == [1, 2, 3], name
        for r in recs:
            for key in ("loss", "grad_norm", "grpo/policy_loss", "grpo/clip_low", "grpo/clip_high", "grpo/entropy"):
                assert math.isfinite(r[key]), (name, key, r[key])
            assert 0 <= r["grpo/clip_low"] + r["grpo/clip_high"] <= 1, (name, r)
        # steps 1 and 3 start a rollout: on-policy, every ratio 1, nothing clipped, a gradient
        assert all(recs[k]["grpo/clip_low"] + recs[k]["grpo/clip_high"] == 0 for k in (0, 2)), name
        assert recs[0]["grad_norm"] > 0 and recs[2]["grad_norm"] > 0, name
    assert train["gspo"][0]["reward/mean"] == train["ppo"][0]["reward/mean"] == train["cispo"][0]["reward/mean"]
    # step 2 reuses the rollout after one update: gspo's 4e-4 range clips whole completions (here every
    # one that has an advantage, so no gradient is left), cispo caps weights and keeps every gradient
    gspo, cispo = train["gspo"][1], train["cispo"][1]
    assert gspo["grpo/clip_low"] + gspo["grpo/clip_high"] > 0 and gspo["loss"] != pytest.approx(train["ppo"][1]["loss"])
    assert cispo["grpo/clip_low"] == 0 < cispo["grpo/clip_high"] and cispo["grad_norm"] > 0  # eps_low 1: no lower cap
