"""GRPO: loss formulas against hand computations, rewards API, batch refusal, and end-to-end runs."""

from __future__ import annotations

import importlib
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from _helpers import lmforge_in_process, tiny_run_args
from lmforge.errors import UserError
from lmforge.metrics.records import read_records
from lmforge.objectives.grpo import (
    GRPOLoss, PolicyBatch, STD_EPS, aggregate, aggregation_weight, group_advantages, k3_kl, loss_normalizer,
)
from lmforge.rl.rewards import BUILTIN_REWARDS, load_rewards, resolve_reward, score_completions
from lmforge.training.train_step import gradient_computation

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- advantages
def _pstd(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def test_group_advantages_each_scale_matches_hand_computation():
    groups = [[1.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.5, 1.5, 0.0, 1.0]]
    rewards = torch.tensor([x for g in groups for x in g])
    flat = [x for g in groups for x in g]
    centered = [x - sum(g) / 4 for g in groups for x in g]
    expect = {
        "none": centered,
        "group": [c / (_pstd(g) + STD_EPS) for g in groups for c in [x - sum(g) / 4 for x in g]],
        "batch": [c / (_pstd(flat) + STD_EPS) for c in centered],
    }
    for scale, want in expect.items():
        adv, zero = group_advantages(rewards, 4, scale)
        assert adv.tolist() == pytest.approx(want, rel=1e-5, abs=1e-6), scale
        assert int(zero) == 1  # the all-2.0 group carries no signal
    assert group_advantages(rewards, 4, "group")[0][:4].tolist() == pytest.approx(
        [0.75 / (math.sqrt(0.1875) + STD_EPS)] + [-0.25 / (math.sqrt(0.1875) + STD_EPS)] * 3, rel=1e-5)


# ---------------------------------------------------------------- the loss
class FixedLogits(nn.Module):
    """A 'model' whose logits are a parameter: the loss's gradient is then easy to inspect."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = nn.Parameter(logits.clone())

    def forward(self, input_ids: torch.Tensor, head=None):
        return self.project(self.logits, head)

    def project(self, logits: torch.Tensor, head):
        """Logits as they are, or through ``head`` with the logits as hidden states and an identity
        output weight (exact in fp32), as ``Transformer.forward(..., head=...)`` does."""
        return logits if head is None else head(logits, torch.eye(logits.shape[-1]))


def _setup(seed: int = 0, B: int = 4, T: int = 5, V: int = 7):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 1, 0, 0, 0], [0, 0, 1, 1, 0]], dtype=torch.float)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])
    old = torch.log_softmax(logits, -1).gather(-1, targets[..., None]).squeeze(-1) + torch.randn(B, T, generator=g) * 0.3
    ref = old + torch.randn(B, T, generator=g) * 0.2
    batch = PolicyBatch(torch.zeros(B, T, dtype=torch.long), targets, mask, adv, old, ref)
    return logits, batch


def _hand_loss(logits, batch, mode, eps_low, eps_high, beta, max_new_tokens, temperature=1.0):
    """The GRPO objective written out token by token in plain Python."""
    logp_all = torch.log_softmax(logits / temperature, -1)
    B, T = batch.targets.shape
    per_seq, n_tokens = [], 0
    for i in range(B):
        terms = []
        for t in range(T):
            if batch.mask[i, t] == 0:
                continue
            lp = float(logp_all[i, t, batch.targets[i, t]])
            ratio = math.exp(lp - float(batch.old_logprobs[i, t]))
            a = float(batch.advantages[i])
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            term = -min(ratio * a, clipped * a)
            d = float(batch.ref_logprobs[i, t]) - lp
            term += beta * (math.exp(d) - d - 1)
            terms.append(term)
        per_seq.append(terms)
        n_tokens += len(terms)
    if mode == "grpo":
        return sum(sum(s) / len(s) for s in per_seq) / B
    if mode == "dapo":
        return sum(sum(s) for s in per_seq) / n_tokens
    return sum(sum(s) for s in per_seq) / (B * max_new_tokens)


@pytest.mark.parametrize("mode", ["grpo", "dapo", "dr_grpo"])
def test_loss_matches_hand_computation_for_each_aggregation(mode):
    logits, batch = _setup()
    for beta, temperature in ((0.0, 1.0), (0.05, 0.7)):
        loss_fn = GRPOLoss(eps_low=0.2, eps_high=0.28, beta=beta, aggregation=mode, max_new_tokens=6,
                           temperature=temperature)
        model = FixedLogits(logits)
        objective, stats = loss_fn(model, batch)
        normalizer = aggregation_weight(batch.mask, mode, 6)
        want = _hand_loss(logits, batch, mode, 0.2, 0.28, beta, 6, temperature)
        assert float(objective.detach() / normalizer) == pytest.approx(want, rel=1e-5, abs=1e-7)
        assert float(stats.loss_sum / stats.loss_weight) == pytest.approx(want, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("mode", ["grpo", "dapo", "dr_grpo"])
def test_microbatch_split_gives_the_same_gradient(mode):
    """The global normalizer makes two microbatches equal one batch, for every aggregation."""
    logits, batch = _setup(seed=3)
    loss_fn = GRPOLoss(eps_low=0.2, eps_high=0.2, beta=0.1, aggregation=mode, max_new_tokens=5, temperature=1.0)

    class RowLogits(FixedLogits):
        def forward(self, input_ids, head=None):
            return self.project(self.logits[input_ids[:, 0]], head)

    whole = PolicyBatch(torch.arange(4)[:, None].expand(4, 5).clone(), batch.targets, batch.mask, batch.advantages,
                        batch.old_logprobs, batch.ref_logprobs)
    halves = [PolicyBatch(*(t[s] for t in (whole.input_ids, whole.targets, whole.mask, whole.advantages,
                                           whole.old_logprobs, whole.ref_logprobs))) for s in (slice(0, 1), slice(1, 4))]
    grads = []
    for mbs in ([whole], halves):
        model = RowLogits(logits)
        gradient_computation(model, mbs, loss_fn, loss_normalizer(mbs, mode, 5))
        grads.append(model.logits.grad)
    torch.testing.assert_close(grads[0], grads[1])


def test_clip_fractions_and_clipped_tokens_get_no_gradient():
    V = 3
    logits = torch.zeros(1, 4, V)  # uniform: log p = -log 3 for every target
    lp = -math.log(V)
    ratios = [1.5, 0.5, 1.5, 1.0]
    old = torch.tensor([[lp - math.log(r) for r in ratios]])
    targets = torch.zeros(1, 4, dtype=torch.long)
    mask = torch.ones(1, 4)
    for adv, low, high, dead in ((1.0, 0, 2, {0, 2}), (-1.0, 1, 0, {1})):
        batch = PolicyBatch(torch.zeros(1, 4, dtype=torch.long), targets, mask, torch.tensor([adv]), old, None)
        model = FixedLogits(logits)
        objective, stats = GRPOLoss(eps_low=0.2, eps_high=0.2, beta=0.0, aggregation="dapo", max_new_tokens=4,
                                    temperature=1.0)(model, batch)
        assert float(stats.sums["clip_low_count"]) == low and float(stats.sums["clip_high_count"]) == high
        objective.backward()
        for t in range(4):
            moved = model.logits.grad[0, t].abs().sum() > 0
            assert moved == (t not in dead), (adv, t)


def test_k3_kl_is_nonnegative_and_zero_for_identical_policies():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(1000, generator=g) * 3, torch.randn(1000, generator=g) * 3
    assert (k3_kl(a, b) >= 0).all()
    assert torch.equal(k3_kl(a, a), torch.zeros_like(a))
    # Monte-Carlo check that k3 is unbiased for KL(p || q) when sampling from p
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.2, 0.5, 0.3])
    x = torch.multinomial(p, 200_000, replacement=True, generator=g)
    est = k3_kl(p.log()[x], q.log()[x]).mean()
    assert float(est) == pytest.approx(float((p * (p / q).log()).sum()), rel=0.03)


def test_aggregate_grpo_weights_sequences_equally():
    per_token = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    assert float(aggregate(per_token, mask, "grpo") / aggregation_weight(mask, "grpo", 8)) == pytest.approx(2.5)
    assert float(aggregate(per_token, mask, "dapo") / aggregation_weight(mask, "dapo", 8)) == pytest.approx(8 / 5)
    assert float(aggregate(per_token, mask, "dr_grpo") / aggregation_weight(mask, "dr_grpo", 8)) == pytest.approx(0.5)


# ---------------------------------------------------------------- rewards
def test_builtin_rewards_and_weights():
    rewards = load_rewards(["exact_answer", "format"], [1.0, 0.5])
    scores = score_completions(rewards, ["p"] * 3, ["85", "85 is it", "olleh"], {"answer": ["85", "85", "x"]})
    assert scores.per_function == {"exact_answer": [1.0, 0.0, 0.0], "format": [1.0, 0.0, 1.0]}
    assert scores.total == [1.5, 0.0, 0.5]
    assert set(BUILTIN_REWARDS) >= {"exact_answer", "format"}


def test_module_function_rewards_none_and_errors(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(
        "def maybe(prompts, completions, kind, **kw):\n"
        "    return [None if k == 'skip' else float(len(c)) for c, k in zip(completions, kind)]\n"
        "def short(prompts, completions, **kw):\n    return [1.0]\n"
        "NOT_CALLABLE = 3\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    rewards = load_rewards(["my_rewards_mod:maybe", "format"], [2.0, 1.0])
    scores = score_completions(rewards, ["a", "b"], ["abc", "x y"], {"kind": ["skip", "keep"]})
    assert math.isnan(scores.per_function["my_rewards_mod:maybe"][0])
    assert scores.total == [1.0, 6.0]  # None counts 0; "abc" passes the format reward
    with pytest.raises(UserError, match="returned 1 values for 2"):
        score_completions(load_rewards(["my_rewards_mod:short"]), ["a", "b"], ["x", "y"], {})
    for name, msg in (("nope", "unknown reward `nope`"), ("no_such_mod_xyz:f", "module `no_such_mod_xyz` not found"),
                      ("my_rewards_mod:missing", "has no attribute"), ("my_rewards_mod:NOT_CALLABLE", "not callable")):
        with pytest.raises(UserError, match=msg):
            resolve_reward(name)
    with pytest.raises(UserError, match="rewards_weights has 1 values for 2"):
        load_rewards(["format", "exact_answer"], [1.0])
    with pytest.raises(UserError, match="needs an `answer` column"):
        score_completions(load_rewards(["exact_answer"]), ["p"], ["1"], {})


# ---------------------------------------------------------------- config and refusal
def test_top_level_reward_flags_and_group_size_refusal(tmp_path):
    from lmforge.config import load_config
    from lmforge.recipes import get_recipe
    from lmforge.recipes.grpo import GRPOConfig
    from lmforge.recipes.skeleton import run_recipe

    cfg = load_config(GRPOConfig, None, ["--rewards=mod:a,format", "--rewards_weights=1,0.2", "--grpo.beta=0.1"])
    assert cfg.grpo.rewards == ["mod:a", "format"] and cfg.grpo.rewards_weights == [1.0, 0.2]
    assert cfg.grpo.beta == 0.1
    bad = load_config(GRPOConfig, None, ["--training.global_batch_size=12", "--grpo.num_generations=8",
                                         f"--run.dir={tmp_path / 'r'}"])
    with pytest.raises(UserError, match=r"training.global_batch_size \(12\).*grpo.num_generations \(8\)"):
        run_recipe(get_recipe("grpo"), bad)
    assert not (tmp_path / "r").exists()  # refused before anything was built


# ---------------------------------------------------------------- end to end (the real CLI)
TINY_REWARD = '''
def lowercase(prompts, completions, **fields):
    """Fraction of the completion's characters that are lowercase ASCII letters."""
    return [sum("a" <= ch <= "z" for ch in c) / max(len(c), 1) for c in completions]

def half_flat(prompts, completions, id, **fields):
    """Even prompts: 1.0 whatever the completion (a group without signal); odd: lowercase()."""
    return [1.0 if i % 2 == 0 else x for i, x in zip(id, lowercase(prompts, completions))]
'''


@pytest.fixture
def tiny_task(tmp_path):
    """Eight prompts and a reward module in a fresh directory (the CLI finds module:function there)."""
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Say something {i}", "id": i}) + "\n"
                                                    for i in range(8)))
    (tmp_path / "tiny_rewards.py").write_text(TINY_REWARD)
    return tmp_path


def _grpo_args(run_dir: str, rewards: str = "tiny_rewards:lowercase", **overrides) -> list[str]:
    return ["grpo", *tiny_run_args("prompts.jsonl", data_seq_len=None,  # lengths: the prompts' and max_new_tokens
                                   schedule_kind="constant", schedule_warmup_steps=0, **overrides),
            f"--rewards={rewards}", f"--run.dir={run_dir}"]


def _grpo(cwd: Path, runs: dict[str, dict]) -> list[list[dict]]:
    """Run the CLI's entry point in this process in ``cwd`` once per run directory with its overrides
    (one after the other; ``cwd`` first on sys.path, as ``python -m lmforge`` started there has it, so
    ``tiny_rewards`` is this test's), return each run's metrics records. In-process, not a subprocess
    per run: the same code path without seconds of imports per run (test_grpo_distributed.py runs the
    real CLI under torchrun)."""
    sys.path.insert(0, str(cwd))
    sys.modules.pop("tiny_rewards", None)  # an earlier test's tiny_rewards is another directory's file
    importlib.invalidate_caches()
    out = []
    try:
        for run_dir, overrides in runs.items():
            rc = lmforge_in_process(*_grpo_args(run_dir, **overrides), cwd=cwd)
            assert rc == 0, f"{run_dir}: exit {rc} (its output is in the captured stdout/stderr)"
            out.append(read_records(cwd / run_dir))
    finally:
        sys.path.remove(str(cwd))
        sys.modules.pop("tiny_rewards", None)
    return out


def test_mean_reward_rises_on_a_tiny_setting(tiny_task):
    """A random tiny model learns to emit lowercase letters: the reward climbs from ~8% (26 of 320 ids)."""
    [recs] = _grpo(tiny_task, {"rise": dict(
        training_steps=12, training_global_batch_size=32, training_micro_batch_size=32, grpo_num_generations=8,
        grpo_max_new_tokens=8, optimizer_lr=1e-2, checkpoint_enabled=False, grpo_log_completions_every=10)})
    train = [r for r in recs if r["kind"] == "train"]
    rewards = [r["reward/mean"] for r in train]
    assert len(rewards) == 12
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.2, rewards
    for key in ("grpo/kl", "grpo/clip_low", "grpo/clip_high", "grpo/entropy", "grpo/policy_loss",
                "grpo/zero_std_groups", "reward/std", "reward/tiny_rewards:lowercase", "completion/mean_length",
                "completion/truncated", "rollout/tokens_per_sec"):
        assert key in train[-1], key
    texts = [r for r in recs if r["kind"] == "text"]
    assert [t["step"] for t in texts] == [1, 10] and "| reward |" in texts[0]["text"]


def test_resume_continues_exactly_with_reference_and_dynamic_sampling(tiny_task):
    """2 steps + resume to 4 equals 4 straight steps: weights, optimizer, prompts, sampling seeds, reference,
    with dynamic sampling drawing extra rounds (the saved position counts them) and the overlong penalty."""
    common = dict(training_global_batch_size=16, training_micro_batch_size=8, grpo_num_generations=4,
                  grpo_max_new_tokens=6, grpo_num_iterations=2, grpo_beta=0.1, optimizer_lr=1e-2, checkpoint_interval=2,
                  grpo_dynamic_sampling=True, grpo_max_sampling_rounds=6, grpo_overlong_buffer=2,
                  rewards="tiny_rewards:half_flat,overlong_penalty", grpo_rewards_weights="1,0.5")
    straight, _ = _grpo(tiny_task, {"a": dict(common, training_steps=4, checkpoint_enabled=False),
                                    "b": dict(common, training_steps=2)})
    [resumed] = _grpo(tiny_task, {"b": dict(common, training_steps=4)})
    keys = ("loss", "reward/mean", "grpo/kl", "grpo/clip_low", "grpo/clip_high", "grad_norm", "grpo/prompts_drawn")
    pick = lambda recs: {r["step"]: [r[k] for k in keys] for r in recs if r["kind"] == "train"}  # noqa: E731
    a, b = pick(straight), pick(resumed)
    assert [r["kind"] for r in resumed].count("resume") == 1
    assert a[3] == pytest.approx(b[3], rel=1e-5) and a[4] == pytest.approx(b[4], rel=1e-5)
    assert a[4][2] > 0  # the KL to the reference is live, so a wrong reference would show
    train = [r for r in straight if r["kind"] == "train"]
    assert all(r["grpo/zero_std_groups"] == 0 for r in train) and sum(r["grpo/dropped_groups"] for r in train) > 0
    assert all(-1 <= r["reward/overlong_penalty"] <= 0 for r in train)  # completion lengths reach the reward
    assert min(r["reward/overlong_penalty"] for r in train) < 0
    state = json.loads((tiny_task / "b" / "checkpoints" / "step_00000004" / "trainer_state.json").read_text())
    assert state["data"]["reference"] == "init:0" and "rollout_rng" not in state["data"]  # seeded by position
    drawn = sum(r["grpo/prompts_drawn"] for r in train if r["step"] in (1, 3))  # 2 rollouts, 2 updates each
    assert state["data"]["prompts_consumed"] == drawn > 8  # more than one round of 4 prompts per rollout


def test_prompt_records_for_a_task_subset_and_a_jsonl_file(tmp_path):
    from lmforge.config import load_config
    from lmforge.data.prompts import prompt_records
    from lmforge.recipes.grpo import GRPOConfig

    cfg = load_config(GRPOConfig, None, ["--tasks.names=add", "--tasks.eval_examples=300"])
    train, test = (prompt_records(cfg.data, cfg.tasks, split) for split in ("train", "test"))
    assert {r["task"] for r in train} == {"add"} and len(test) == 200  # add's share of the 600 held-out problems
    assert not {r["prompt"] for r in test} & {r["prompt"] for r in train}
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi", "answer": "1"}\n{"question": "no prompt"}\n')
    cfg = load_config(GRPOConfig, None, [f"--data.train={tmp_path / 'p.jsonl'}"])
    with pytest.raises(UserError, match="record 2 has no string `prompt` column"):
        prompt_records(cfg.data, cfg.tasks, "train")


def test_resume_at_every_position_within_a_rollout_is_exact(tiny_task):
    """num_iterations=3: a run resumed from the checkpoint after any update (1..5 of 6: mid-rollout or
    at a boundary) trains on the same rollouts and logs what the uninterrupted run logged."""
    common = dict(training_global_batch_size=8, training_micro_batch_size=4, grpo_num_generations=4,
                  grpo_max_new_tokens=5, grpo_num_iterations=3, grpo_beta=0.1, optimizer_lr=1e-2,
                  checkpoint_interval=1, checkpoint_keep=10)
    [straight] = _grpo(tiny_task, {"a": dict(common, training_steps=6)})
    ckpts = tiny_task / "a" / "checkpoints"
    for k in range(1, 6):
        shutil.copytree(ckpts / f"step_{k:08d}", tiny_task / f"from{k}" / "checkpoints" / f"step_{k:08d}")
    assert (ckpts / "step_00000001" / "rank_state0.pt").is_file()  # mid-rollout: the rollout is saved
    assert not (ckpts / "step_00000003" / "rank_state0.pt").exists()  # at a boundary: nothing to save
    resumed = _grpo(tiny_task, {f"from{k}": dict(common, training_steps=6) for k in range(1, 6)})
    keys = ("loss", "reward/mean", "grpo/kl", "grpo/clip_high", "grad_norm")
    pick = lambda recs: {r["step"]: [r[key] for key in keys] for r in recs if r["kind"] == "train"}  # noqa: E731
    want = pick(straight)
    for k, recs in zip(range(1, 6), resumed):
        got = pick(recs)
        assert sorted(got) == list(range(k + 1, 7)), (k, sorted(got))
        for step in got:
            assert got[step] == pytest.approx(want[step], rel=1e-5), (k, step)
