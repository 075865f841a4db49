"""Asynchronous GRPO (``grpo.async_steps``): rollouts sampled ahead by older weights, corrected, resumable.

The tiny CLI runs of test_grpo.py, with lmforge's engine holding its own copy of the weights and a
background thread sampling the next rollout while the current update trains.
"""

from __future__ import annotations

import shutil

import pytest

from test_grpo import _grpo, tiny_task  # noqa: F401 - the fixture is used by name

COMMON = dict(training_global_batch_size=16, training_micro_batch_size=8, grpo_num_generations=4,
              grpo_max_new_tokens=6, optimizer_lr=1e-2, grpo_tis_cap=2.0)


def _train(recs: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in recs if r["kind"] == "train"}


def test_async_rollouts_are_one_step_stale_and_corrected(tiny_task):
    """async_steps=1: the first rollout is sampled by the starting weights and every later one by the
    weights one update older than the policy being trained (staleness 1 on the log). The sampler's
    log-probs are the behaviour policy's, so the logged gap is 0 on the first step (same weights, same
    precision) and positive after; the TIS weight averages near 1. Sync mode has staleness 0."""
    sync, ahead = _grpo(tiny_task, {"sync": dict(COMMON, training_steps=4, checkpoint_enabled=False),
                                    "ahead": dict(COMMON, training_steps=4, checkpoint_enabled=False,
                                                  grpo_async_steps=1)})
    s, a = _train(sync), _train(ahead)
    assert [a[k]["rollout/staleness"] for k in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
    assert all(s[k]["rollout/staleness"] == 0.0 for k in s)
    assert "grpo/rollout_logprob_gap" in a[1] and a[1]["grpo/rollout_logprob_gap"] < 1e-5
    assert min(a[k]["grpo/rollout_logprob_gap"] for k in (2, 3, 4)) > 1e-4  # lr 1e-2 moves the policy
    assert all(0.5 < a[k]["grpo/tis_weight"] < 1.5 for k in (2, 3, 4))
    # the first rollout is the same draw (same weights, same seeds): the first update is the same
    assert a[1]["reward/mean"] == pytest.approx(s[1]["reward/mean"], rel=1e-6)
    assert a[1]["loss"] == pytest.approx(s[1]["loss"], rel=1e-4, abs=1e-6)


def test_async_resume_trains_on_the_rounds_that_were_in_flight(tiny_task):
    """A checkpoint holds the rounds sampled ahead: 3 steps + resume to 6 logs what 6 straight steps log
    (async_steps=2, so two rounds sampled by older weights are in flight at every checkpoint)."""
    common = dict(COMMON, grpo_async_steps=2, checkpoint_interval=3)
    [straight] = _grpo(tiny_task, {"a": dict(common, training_steps=6, checkpoint_enabled=False)})
    _grpo(tiny_task, {"b": dict(common, training_steps=3)})
    [resumed] = _grpo(tiny_task, {"b": dict(common, training_steps=6)})
    keys = ("loss", "reward/mean", "grad_norm", "rollout/staleness", "grpo/rollout_logprob_gap")
    assert [r["kind"] for r in resumed].count("resume") == 1
    after = resumed[[r["kind"] for r in resumed].index("resume"):]
    a, b = _train(straight), _train(after)
    assert sorted(b) == [4, 5, 6]
    for step in (4, 5, 6):
        assert [b[step][k] for k in keys] == pytest.approx([a[step][k] for k in keys], rel=1e-5), step
    assert a[6]["rollout/staleness"] == 2.0


def test_async_refusals(tiny_task, tmp_path):
    from lmforge.config import load_config
    from lmforge.recipes.grpo import GRPOConfig
    from lmforge.errors import UserError

    with pytest.raises((UserError, ValueError), match="async_steps with grpo.dynamic_sampling"):
        load_config(GRPOConfig, None, ["--grpo.async_steps=1", "--grpo.dynamic_sampling=true"])
    with pytest.raises((UserError, ValueError), match="vllm_mode=server"):
        load_config(GRPOConfig, None, ["--grpo.vllm_url=http://127.0.0.1:1"])


def test_vllm_engine_without_vllm_is_one_line(tiny_task):
    """grpo.engine=vllm where vLLM does not import: one error line naming the install, exit 2."""
    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401
        pytest.skip("vLLM is installed here")
    except ImportError:
        pass
    import glob

    from _helpers import lmforge_in_process
    from test_grpo import _grpo_args

    before = set(glob.glob("/dev/shm/lmforge-weights-*"))
    rc = lmforge_in_process(*_grpo_args("v", **dict(COMMON, training_steps=1, grpo_engine="vllm",
                                                    checkpoint_enabled=False)), cwd=tiny_task)
    assert rc == 2
    assert set(glob.glob("/dev/shm/lmforge-weights-*")) == before  # the run's snapshot directory is gone
    shutil.rmtree(tiny_task / "v", ignore_errors=True)


def test_an_unreachable_vllm_server_is_one_line(tiny_task, tmp_path, capsys):
    """grpo.vllm_url naming nothing that listens: the start-up check fails with one line naming the
    URL and the key, exit 2; no weight snapshot directory is left behind."""
    import glob

    from _helpers import lmforge_in_process
    from test_grpo import _grpo_args

    before = set(glob.glob("/dev/shm/lmforge-weights-*"))
    rc = lmforge_in_process(*_grpo_args("v", **dict(COMMON, training_steps=1, grpo_engine="vllm",
                                                    grpo_vllm_mode="server", grpo_vllm_url="http://127.0.0.1:9",
                                                    grpo_vllm_sync_dir=str(tmp_path / "sync"),
                                                    checkpoint_enabled=False)), cwd=tiny_task)
    err = capsys.readouterr().err
    assert rc == 2
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "http://127.0.0.1:9" in lines[0] and "grpo.vllm_url" in lines[0], err
    assert set(glob.glob("/dev/shm/lmforge-weights-*")) == before
