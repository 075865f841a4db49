"""MoE routing replay under expert parallelism: GRPO with ``grpo.router_replay`` and the experts split over
2 gloo ranks (real torchrun, ``parallel.ep=2`` in FSDP2's ``dp_shard=2``) logs what one process logs, for a
softmax top-k router (Qwen3-MoE) and a sigmoid, group-limited one with a correction bias (DeepSeek-V3)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from _helpers import cli_env, torchrun_cmd
from lmforge.metrics.records import read_records
from test_grpo import _grpo, _grpo_args, tiny_task  # noqa: F401 - the fixture is used by name

transformers = pytest.importorskip("transformers")


def start_dir(family: str, out: Path) -> Path:
    """A tiny random model of ``family`` with a real chat tokenizer, for ``model.from_hf``."""
    if family != "deepseek_v3":
        from _hf_models import hf_start

        return hf_start(family, out)
    from test_deepseek_v3 import write_chat_start

    return write_chat_start(out)


KEYS = ("loss", "grad_norm", "reward/mean", "grpo/route_flips", "grpo/rollout_logprob_gap")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_router_replay_under_expert_parallelism_matches_one_process(tiny_task, family):
    """One rollout (2 prompts x 4 completions, one prompt per generate call so 1 and 2 ranks sample alike,
    bf16 sampling, fp32 training) used for 2 updates. The second update's forwards run on weights an update
    newer than the engine's, where the trainer's routers would send most tokens elsewhere (route_flips):
    the EP run's loss there equals one process's replayed loss and differs from its re-routed one, so the
    experts each rank sends its tokens' rows to are the recorded ones, and the flips and the gap agree."""
    start = start_dir(family, tiny_task / f"{family}_start")
    common = dict(model_size=None, model_n_layers=None, model_dim=None, model_n_heads=None, model_n_kv_heads=None,
                  model_from_hf=str(start), training_steps=2, training_global_batch_size=8,
                  training_micro_batch_size=4, grpo_num_generations=4, grpo_max_new_tokens=5,
                  grpo_num_iterations=2, grpo_prompts_per_generation=1, optimizer_lr=1e-2,
                  grpo_rollout_dtype="bfloat16", grpo_tis_cap=2.0, grpo_router_replay=True,
                  checkpoint_enabled=False, tasks_eval_examples=0)
    ep_args = _grpo_args("ep", **common)
    ep = subprocess.Popen([*torchrun_cmd(*ep_args), "--parallel.mode=fsdp", "--parallel.ep=2"], cwd=tiny_task,
                          env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:  # the one-process runs in this process meanwhile
        one, rerouted = _grpo(tiny_task, {"one": common, "rerouted": dict(common, grpo_router_replay=False)})
    finally:
        out, err = ep.communicate(timeout=240)
    assert ep.returncode == 0, out[-2000:] + err[-3000:]
    assert read_records(tiny_task / "ep", "setup")[0]["parallel"] == "fsdp+ep"
    train = {name: {r["step"]: r for r in recs if r["kind"] == "train"}
             for name, recs in (("one", one), ("rerouted", rerouted), ("ep", read_records(tiny_task / "ep")))}
    assert sorted(train["ep"]) == [1, 2]
    for step in (1, 2):
        want = [train["one"][step][k] for k in KEYS]
        assert [train["ep"][step].get(k) for k in KEYS] == pytest.approx(want, rel=1e-4, abs=1e-6), step
    assert train["one"][2]["grpo/route_flips"] > 0.2  # replay decides the second update's routing
    assert train["one"][2]["loss"] != pytest.approx(train["rerouted"][2]["loss"], rel=1e-3, abs=1e-5)
    assert 0 < train["ep"][1]["grpo/rollout_logprob_gap"] < 0.05  # bf16 engine vs fp32 trainer, same routing


@pytest.mark.parametrize("flags, needle", [(dict(grpo_engine="vllm"), "with grpo.engine=vllm is not supported"),
                                           (dict(grpo_async_steps=1), "with grpo.async_steps is not supported")],
                         ids=["vllm", "async_steps"])
def test_what_expert_parallel_grpo_refuses_is_one_line(tiny_task, capfd, flags, needle):
    from _helpers import lmforge_in_process

    rc = lmforge_in_process(*_grpo_args("refused", training_steps=1, parallel_ep=2, **flags), cwd=tiny_task)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(lines) == 1, err[-1500:]
    assert f"parallel.ep=2 {needle}" in lines[0], lines
