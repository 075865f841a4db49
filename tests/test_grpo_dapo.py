"""DAPO's pieces in GRPO: dynamic sampling, the soft overlong penalty, truncated importance sampling."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from _helpers import tiny_run_args
from lmforge.errors import UserError
from lmforge.metrics.records import read_records
from lmforge.objectives.grpo import GRPOLoss, PolicyBatch, tis_weights
from lmforge.rl.rewards import load_rewards, score_completions

# ---------------------------------------------------------------- overlong penalty


def test_overlong_penalty_by_hand_at_the_boundaries():
    """max_new_tokens 16, buffer 4: free up to 12 tokens, then -1/4 per token down to -1 at 16."""
    [r] = load_rewards(["overlong_penalty"], max_new_tokens=16, overlong_buffer=4)
    lengths = [0, 1, 11, 12, 13, 14, 15, 16]
    got = score_completions([r], ["p"] * 8, ["x"] * 8, {"completion_length": lengths}).total
    assert got == [0.0, 0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0]
    [whole] = load_rewards(["overlong_penalty"], max_new_tokens=8, overlong_buffer=8)  # the ramp from 0 tokens
    assert score_completions([whole], ["p"] * 3, ["x"] * 3, {"completion_length": [0, 4, 8]}).total == [0.0, -0.5, -1.0]
    for buffer in (0, 17):
        with pytest.raises(UserError, match="0 < grpo.overlong_buffer <= grpo.max_new_tokens"):
            load_rewards(["format", "overlong_penalty"], max_new_tokens=16, overlong_buffer=buffer)


# ---------------------------------------------------------------- truncated importance sampling


def test_tis_weights_and_loss_by_hand():
    """Each token's clipped surrogate times min(pi_old / pi_rollout, cap); KL untouched; gap logged."""
    old = torch.tensor([[math.log(0.5), math.log(0.2), math.log(0.9)]])
    rollout = torch.tensor([[math.log(0.25), math.log(0.4), math.log(0.3)]])
    # ratios pi_old / pi_rollout: 2.0, 0.5, 3.0 -> capped at 2.5: 2.0, 0.5, 2.5
    assert tis_weights(old, rollout, 2.5)[0].tolist() == pytest.approx([2.0, 0.5, 2.5], rel=1e-6)

    V = 4
    logits = torch.zeros(1, 3, V)  # uniform policy: log p = -log 4 for every target
    targets = torch.zeros(1, 3, dtype=torch.long)
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    batch = PolicyBatch(torch.zeros(1, 3, dtype=torch.long), targets, mask, torch.tensor([1.5]), old, None, rollout)

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.logits = torch.nn.Parameter(logits.clone())

        def forward(self, input_ids, head=None):
            return head(self.logits, torch.eye(V))

    eps = 0.2
    objective, stats = GRPOLoss(eps_low=eps, eps_high=eps, beta=0.0, aggregation="dapo", max_new_tokens=3,
                                temperature=1.0, tis_cap=2.5)(Logits(), batch)
    want = 0.0
    for t, w in enumerate([2.0, 0.5, 2.5]):
        ratio = math.exp(-math.log(V) - float(old[0, t]))
        want += -min(ratio * 1.5, min(max(ratio, 1 - eps), 1 + eps) * 1.5) * w
    assert float(objective.detach()) == pytest.approx(want, rel=1e-5)
    gap = sum(abs(float(o - r)) for o, r in zip(old[0], rollout[0]))
    assert float(stats.sums["rollout_gap_sum"]) == pytest.approx(gap, rel=1e-5)
    assert float(stats.sums["tis_weight_sum"]) == pytest.approx(5.0, rel=1e-6)
    off, _ = GRPOLoss(eps_low=eps, eps_high=eps, beta=0.0, aggregation="dapo", max_new_tokens=3,
                      temperature=1.0)(Logits(), batch)  # tis_cap 0: the rollout log-probs are ignored
    plain = sum(-min(r * 1.5, min(max(r, 1 - eps), 1 + eps) * 1.5)
                for r in (math.exp(-math.log(V) - float(o)) for o in old[0]))
    assert float(off.detach()) == pytest.approx(plain, rel=1e-5)


# ---------------------------------------------------------------- dynamic sampling
DAPO_REWARDS = '''
def half_flat(prompts, completions, id, **fields):
    """Even prompts: 1.0 whatever the completion (zero spread); odd: the lowercase fraction."""
    return [1.0 if i % 2 == 0 else sum("a" <= ch <= "z" for ch in c) / max(len(c), 1)
            for c, i in zip(completions, id)]

def flat(prompts, completions, **fields):
    return [0.5 for _ in completions]
'''


@pytest.fixture
def dapo_task(tmp_path, monkeypatch):
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Say something {i}", "id": i}) + "\n"
                                                    for i in range(16)))
    (tmp_path / "dapo_rewards.py").write_text(DAPO_REWARDS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


COMMON = dict(training_global_batch_size=16, training_micro_batch_size=8, grpo_num_generations=4,
              grpo_max_new_tokens=6, optimizer_lr=1e-2, schedule_kind="constant", schedule_warmup_steps=0)


def _source(path: Path, reward: str, **overrides):
    """A RolloutSource on a real single-process runtime, built as ``lmforge grpo`` builds it."""
    from lmforge.config import load_config
    from lmforge.rl.rollout_source import RolloutSource
    from lmforge.data.prompts import prompt_records
    from lmforge.recipes.grpo import GRPOConfig

    args = tiny_run_args("prompts.jsonl", data_seq_len=None, **(COMMON | overrides))
    cfg = load_config(GRPOConfig, None, [*args, f"--rewards={reward}", f"--run.dir={path / 'run'}"])
    from lmforge.runtime import build_runtime

    rt = build_runtime(cfg, "grpo")
    return RolloutSource(rt, cfg.grpo, load_rewards(cfg.grpo.rewards), prompt_records(cfg.data, cfg.tasks, "train"))


def test_dynamic_sampling_drops_zero_spread_groups_and_respects_the_cap(dapo_task):
    source = _source(dapo_task, "dapo_rewards:half_flat", grpo_dynamic_sampling=True, grpo_max_sampling_rounds=8)
    drawn = 0
    for step in (1, 2):
        batch = source.next_step(step)
        m = batch.metrics
        rewards = torch.tensor(source.rollout.rewards).view(-1, 4)
        assert len(rewards) == 4  # the batch is full: 16 completions
        assert bool((rewards.amax(1) > rewards.amin(1)).all()), rewards  # no zero-spread group trained on
        adv = torch.cat([b.advantages for b in batch.microbatches]).view(-1, 4)
        assert bool((adv.abs().sum(1) > 0).all())
        assert m["grpo/zero_std_groups"] == 0.0
        assert m["grpo/dropped_groups"] >= 2 and m["grpo/prompts_drawn"] == 4 * m["grpo/sampling_rounds"] >= 8
        drawn += m["grpo/prompts_drawn"]
    assert source.sampler.consumed == drawn  # the checkpointed position counts every round

    capped = _source(dapo_task, "dapo_rewards:flat", grpo_dynamic_sampling=True, grpo_max_sampling_rounds=3)
    m = capped.next_step(1).metrics
    assert m["grpo/sampling_rounds"] == 3 and m["grpo/prompts_drawn"] == 12 and capped.sampler.consumed == 12
    assert m["grpo/dropped_groups"] == 8  # 12 zero-spread groups drawn, 4 of them fill the batch
    assert m["grpo/zero_std_groups"] == 1.0 and len(capped.rollout.rewards) == 16
    plain = _source(dapo_task, "dapo_rewards:flat", grpo_top_p=0.9)
    assert "grpo/prompts_drawn" not in plain.next_step(1).metrics and plain.sampler.consumed == 4
    plain.rt.open_run_dir()
    [warning] = [r for r in read_records(plain.rt.world.run_dir) if r["kind"] == "top_p"]  # said once, at start
    assert "whole distribution" in warning["message"]
    plain.rt.metrics.close()


def test_tis_with_a_bfloat16_sampler_logs_the_gap(dapo_task):
    """Sampling in bfloat16 while training in float32: the rollout's log-probs differ a little from the
    training forward's, the weights stay near 1 and both are logged."""
    from lmforge.objectives.grpo import GRPOObjective
    from lmforge.training.train_step import compute_global_loss, gradient_computation

    source = _source(dapo_task, "dapo_rewards:half_flat", grpo_tis_cap=2.0, grpo_rollout_dtype="bfloat16")
    batch = source.next_step(1)
    assert all(mb.rollout_logprobs is not None and mb.old_logprobs is None for mb in batch.microbatches)
    objective = GRPOObjective(eps_low=0.2, eps_high=0.2, beta=0.0, aggregation="dapo", max_new_tokens=6,
                              temperature=1.0, tis_cap=2.0)
    stats = gradient_computation(source.rt.model.module, batch.microbatches, objective.loss_fn,
                                 objective.normalizer(batch.microbatches))
    values = {k: float(v) for k, v in objective.log_values(compute_global_loss(stats)).items()}
    # by hand: pi_old is the float32 training forward (one update per rollout), pi_rollout the bfloat16 one
    from lmforge.objectives.grpo import token_logprobs

    gap = weight = tokens = 0.0
    with torch.no_grad():
        for mb in batch.microbatches:
            old = token_logprobs(source.rt.model.module, mb, 1.0)
            gap += float(((old - mb.rollout_logprobs).abs() * mb.mask).sum())
            weight += float((tis_weights(old, mb.rollout_logprobs, 2.0) * mb.mask).sum())
            tokens += float(mb.mask.sum())
    assert 0 < values["grpo/rollout_logprob_gap"] < 0.1
    assert values["grpo/rollout_logprob_gap"] == pytest.approx(gap / tokens, rel=1e-5)
    assert values["grpo/tis_weight"] == pytest.approx(weight / tokens, rel=1e-6)
