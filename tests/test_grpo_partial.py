"""Partial rollouts (``grpo.partial_rollouts``) and the staleness bound (``grpo.max_staleness``).

The tiny CLI runs of test_grpo.py with ``async_steps = 2``: every round is decoded in two segments of
3 tokens, the first by weights two updates older than the policy it trains, the second by weights one
update older, so its tokens carry two versions and the per-token staleness is logged.
"""

from __future__ import annotations

import pytest

from test_grpo import _grpo, tiny_task  # noqa: F401 - the fixture is used by name

COMMON = dict(training_global_batch_size=16, training_micro_batch_size=8, grpo_num_generations=4,
              grpo_max_new_tokens=6, optimizer_lr=1e-2, grpo_tis_cap=2.0, grpo_async_steps=2,
              grpo_partial_rollouts=True)


def _train(recs: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in recs if r["kind"] == "train"}


def test_partial_rollouts_span_two_versions_and_the_bound_masks_the_older(tiny_task):
    """Past the starting rounds, a completion's first segment lags 2 updates and its second 1: the
    per-token staleness has max 2 and a mean strictly between 1 and 2, while without partial rollouts
    every token lags 2. max_staleness=1 masks the first segments' tokens out of the loss (counted)."""
    whole, part, bound = _grpo(tiny_task, {
        "whole": dict(COMMON, grpo_partial_rollouts=False, training_steps=5, checkpoint_enabled=False),
        "part": dict(COMMON, training_steps=5, checkpoint_enabled=False),
        "bound": dict(COMMON, training_steps=5, checkpoint_enabled=False, grpo_max_staleness=1)})
    w, p, b = _train(whole), _train(part), _train(bound)
    assert [w[k]["rollout/token_staleness_max"] for k in (3, 4, 5)] == [2.0, 2.0, 2.0]
    assert [w[k]["rollout/token_staleness_mean"] for k in (3, 4, 5)] == [2.0, 2.0, 2.0]
    for k in (3, 4, 5):
        assert p[k]["rollout/token_staleness_max"] == 2.0
        assert 1.0 < p[k]["rollout/token_staleness_mean"] < 2.0, p[k]
        assert p[k]["rollout/stale_tokens_masked"] == 0.0
        assert b[k]["rollout/stale_tokens_masked"] > 0  # the first segments: 3 tokens a completion
        assert b[k]["rollout/stale_tokens_masked"] <= 16 * 3
        assert 0.5 < p[k]["grpo/tis_weight"] < 1.5
    # the first rollout is sampled by the starting weights whole: nothing is stale
    assert p[1]["rollout/token_staleness_max"] == 0.0 and b[1]["rollout/stale_tokens_masked"] == 0.0
    assert b[3]["loss"] != pytest.approx(p[3]["loss"], rel=1e-6)  # the masked tokens left the loss


def test_partial_rollouts_resume_exactly(tiny_task):
    """A checkpoint saves the rounds in flight part-way through: 3 steps + resume to 6 logs what 6
    straight steps log (losses, rewards, staleness)."""
    common = dict(COMMON, checkpoint_interval=3, grpo_max_staleness=1)
    [straight] = _grpo(tiny_task, {"a": dict(common, training_steps=6, checkpoint_enabled=False)})
    _grpo(tiny_task, {"b": dict(common, training_steps=3)})
    [resumed] = _grpo(tiny_task, {"b": dict(common, training_steps=6)})
    keys = ("loss", "reward/mean", "grad_norm", "rollout/token_staleness_mean", "rollout/stale_tokens_masked",
            "grpo/rollout_logprob_gap")
    assert [r["kind"] for r in resumed].count("resume") == 1
    after = resumed[[r["kind"] for r in resumed].index("resume"):]
    a, b = _train(straight), _train(after)
    assert sorted(b) == [4, 5, 6]
    for step in (4, 5, 6):
        assert [b[step][k] for k in keys] == pytest.approx([a[step][k] for k in keys], rel=1e-5), step


def test_partial_rollout_refusals():
    from lmforge.config import load_config
    from lmforge.recipes.grpo import GRPOConfig

    cases = {("--grpo.max_staleness=2",): "grpo.max_staleness bounds the lag of rollouts sampled ahead",
             ("--grpo.partial_rollouts=true", "--grpo.async_steps=1"): "needs grpo.async_steps >= 2",
             ("--grpo.partial_rollouts=true", "--grpo.async_steps=2", "--grpo.engine=other"):
                 "engine 'other' cannot continue a generation",
             ("--grpo.partial_rollouts=true", "--grpo.async_steps=2", "--grpo.environment=gsm8k_calculator"):
                 "partial_rollouts with grpo.environment",
             ("--grpo.partial_rollouts=true", "--grpo.async_steps=2", "--grpo.router_replay=true"):
                 "partial_rollouts with grpo.router_replay",
             ("--grpo.partial_rolouts=true",): "did you mean `grpo.partial_rollouts`"}
    for args, line in cases.items():
        with pytest.raises(Exception, match=line.replace("(", r"\(").replace(")", r"\)")):
            load_config(GRPOConfig, None, list(args))
    # vLLM continues a row as a completion request of its token ids: accepted (tests/test_vllm_engine.py runs it)
    cfg = load_config(GRPOConfig, None, ["--grpo.partial_rollouts=true", "--grpo.async_steps=2", "--grpo.engine=vllm"])
    assert cfg.grpo.partial_rollouts and cfg.grpo.engine == "vllm"


def test_a_round_continues_under_new_weights_with_each_tokens_own_logprob():
    """Two segments of 4 tokens, the engine's weights changed in between: each token carries the version
    that sampled it, and its behaviour log-prob is the teacher-forced one under *those* weights (the
    first segment's under the old, the second's under the new, which differ)."""
    import torch

    from lmforge.models.model import ModelArgs, Transformer
    from lmforge.rl.engines.base import SamplingSettings
    from lmforge.rl.engines.lmforge_engine import LmforgeEngine
    from lmforge.rl.partial_rollouts import PartialRound, advance_round

    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32))
    old = {k: v.clone() for k, v in model.state_dict().items()}
    engine = LmforgeEngine(pad_id=0, copy_weights=True)
    engine.load_weights(model, 0)
    rnd = PartialRound([0, 1], [{}, {}], [[5, 6, 7], [9, 10]], group_size=2)
    sampling = SamplingSettings(8, 1.0)
    seeds = lambda position, segment: 100 * position + segment  # noqa: E731
    advance_round(engine, rnd, sampling, 2, 4, seeds)
    assert [len(c) for c in rnd.completion_ids] == [4] * 4 and rnd.segments == 1 and not any(rnd.done)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    engine.load_weights(model, 7)
    advance_round(engine, rnd, sampling, 2, 4, seeds)
    assert all(rnd.done) and rnd.token_versions == [[0] * 4 + [7] * 4] * 4
    prompts = [[5, 6, 7]] * 2 + [[9, 10]] * 2
    new_lp = engine.sampled_logprobs(prompts, rnd.completion_ids, 1.0)
    model.load_state_dict(old)
    engine.load_weights(model, 0)
    old_lp = engine.sampled_logprobs(prompts, rnd.completion_ids, 1.0)
    for row, o, n in zip(rnd.logprobs, old_lp, new_lp):
        assert row[:4] == pytest.approx(o[:4], abs=1e-5) and row[4:] == pytest.approx(n[4:], abs=1e-5)
        assert row[4:] != pytest.approx(o[4:], abs=1e-3)  # the weights did change what the tokens weigh


def test_rows_the_engine_cut_short_are_not_continued():
    """A row that got fewer tokens than its segment asked for without a stop token (vLLM at its
    max_model_len) has ended: the next segment does not ask for it again. Full rows and rows that hit a
    stop token are told apart as before."""
    from lmforge.rl.engines.base import Completion, SamplingSettings
    from lmforge.rl.partial_rollouts import PartialRound, advance_round

    class Scripted:  # row r of the first call gets lengths[r] tokens; stop id 2 ends row 1
        version = 0
        calls: list[list[list[int]]] = []

        def generate(self, prompts, sampling, *, seed, logprobs=False):
            self.calls.append([list(p) for p in prompts])
            lengths = [sampling.max_new_tokens, 2, 1, sampling.max_new_tokens] if len(self.calls) == 1 else \
                [sampling.max_new_tokens] * len(prompts)
            out = []
            for p, n in zip(prompts, lengths):
                ids = [7] * n if len(out) != 1 or len(self.calls) > 1 else [7, 2]
                out.append(Completion(ids, [-0.5] * len(ids)))
            return out

    engine = Scripted()
    rnd = PartialRound([0, 1], [{}, {}], [[5], [6]], group_size=2)
    sampling = SamplingSettings(8, 1.0, stop_ids=(2,))
    advance_round(engine, rnd, sampling, 2, 8, lambda position, segment: 0)
    assert rnd.done == [False, True, True, False]  # row 1: its stop token; row 2: cut short at 1 of 4
    engine.version = 1
    advance_round(engine, rnd, sampling, 2, 8, lambda position, segment: 0)
    assert engine.calls[1] == [[5] + [7] * 4, [6] + [7] * 4]  # rows 0 and 3 only, prompt + their tokens
    assert [len(c) for c in rnd.completion_ids] == [8, 2, 1, 8] and all(rnd.done)
    assert rnd.token_versions[0] == [0] * 4 + [1] * 4 and rnd.token_versions[2] == [0]
