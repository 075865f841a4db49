"""GRPO on two ranks (real torchrun, 2 CPU processes, gloo): DDP and FSDP2 rollouts, updates and task eval
reproduce one process with the same global batch, and sharded exact-match eval equals unsharded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import cli_env, lmforge_cmd, tiny_run_args, torchrun_cmd
from lmforge.data.chat import chat_format_for
from lmforge.data.tasks import TaskExample, extract_answer
from lmforge.evaluation.tasks import task_accuracy
from lmforge.metrics.records import read_records
from lmforge.models.args import model_args_for
from lmforge.models.generate import generate
from lmforge.models.model import Transformer
from lmforge.models.tokenizer import ByteTokenizer

TINY_REWARD = '''
def lowercase(prompts, completions, **fields):
    return [sum("a" <= ch <= "z" for ch in c) / max(len(c), 1) for c in completions]
'''


def test_grpo_ddp_and_fsdp_match_one_process(tmp_path):
    """Same global batch (4 prompts x 4 completions, 2 prompts per generate call, so each call is seeded
    alike on 1 or 2 ranks), KL to a reference, two updates per rollout, eval with answers: every
    logged value of the 2-rank runs equals the 1-process run's."""
    (tmp_path / "prompts.jsonl").write_text("".join(
        json.dumps({"prompt": f"Say something {i}", "answer": "abc" if i % 3 else "", "id": i}) + "\n"
        for i in range(8)))
    (tmp_path / "tiny_rewards.py").write_text(TINY_REWARD)
    common = tiny_run_args("prompts.jsonl", data_seq_len=None, training_steps=4, training_global_batch_size=16,
                           training_micro_batch_size=8, grpo_num_generations=4, grpo_max_new_tokens=6,
                           grpo_num_iterations=2, grpo_beta=0.1, grpo_prompts_per_generation=2, optimizer_lr=1e-2,
                           schedule_kind="constant", schedule_warmup_steps=0, eval_interval=2, tasks_eval_examples=5,
                           tasks_eval_max_new_tokens=6, checkpoint_enabled=False)
    runs = {"one": lmforge_cmd("grpo", *common), "ddp": torchrun_cmd("grpo", *common, "--parallel.mode=ddp"),
            "fsdp": torchrun_cmd("grpo", *common, "--parallel.mode=fsdp"),
            # sampling one step ahead on each rank's own copy of the weights: 2 DDP ranks = 1 process
            "one_async": lmforge_cmd("grpo", *common, "--grpo.async_steps=1"),
            "ddp_async": torchrun_cmd("grpo", *common, "--parallel.mode=ddp", "--grpo.async_steps=1")}
    procs = {name: subprocess.Popen([*cmd, "--rewards=tiny_rewards:lowercase", f"--run.dir={name}"], cwd=tmp_path,
                                    env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, cmd in runs.items()}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"{name}: {out[-2000:]}{err[-3000:]}"
    keys = ("loss", "reward/mean", "reward/std", "grpo/kl", "grpo/clip_high", "grad_norm", "completion/mean_length")
    got = {name: read_records(tmp_path / name) for name in runs}
    train = {name: {r["step"]: [r[k] for k in keys] for r in recs if r["kind"] == "train"}
             for name, recs in got.items()}
    evals = {name: {r["step"]: r["exact_match"] for r in recs if r["kind"] == "eval"} for name, recs in got.items()}
    assert sorted(train["one"]) == [1, 2, 3, 4] and sorted(evals["one"]) == [0, 2, 4]
    assert train["one"][4][3] > 0  # the KL is live: a wrong reference under FSDP would show
    for name in ("ddp", "fsdp"):
        assert read_records(tmp_path / name, "setup")[0]["parallel"] == name
        for step, values in train["one"].items():
            assert train[name][step] == pytest.approx(values, rel=1e-4, abs=1e-6), (name, step)
        assert evals[name] == evals["one"], name
    for step, values in train["one_async"].items():
        assert train["ddp_async"][step] == pytest.approx(values, rel=1e-4, abs=1e-6), ("ddp_async", step)
    stale = [r["rollout/staleness"] for r in got["ddp_async"] if r["kind"] == "train"]
    assert stale == [0.0, 0.0, 2.0, 2.0]  # the second rollout was sampled one rollout (2 updates) behind
    assert train["one_async"][3] != pytest.approx(train["one"][3], rel=1e-3)  # older weights sampled it


def test_task_eval_sharded_equals_unsharded(tmp_path):
    """7 examples on 2 ranks (4 + 3, one padded), batches of 2; answers chosen so the unsharded model
    scores 4/7 overall and differently per task: the sharded scores under DDP and FSDP2 are the same,
    twice (the second after a training forward and backward)."""
    tok = ByteTokenizer()
    model = Transformer(model_args_for("debug", tok.vocab_size, dim=64, n_layers=2))
    model.init_weights(seed=0)
    prompts = [f"Question number {i}?" for i in range(7)]
    chat = chat_format_for(tok)
    replies = [generate(model, [chat.prompt_ids([{"role": "user", "content": p}])], 8, pad_id=tok.pad_id,
                        temperature=0.0)[0] for p in prompts]
    answers = [extract_answer(tok.decode(r, skip_special=True)) if i % 2 == 0 else "no such answer"
               for i, r in enumerate(replies)]
    examples = [TaskExample("add" if i < 3 else "sort", p, a) for i, (p, a) in enumerate(zip(prompts, answers))]
    want = task_accuracy(model, tok, examples, max_new_tokens=8, batch_size=2)
    assert want == {"all": 4 / 7, "add": 2 / 3, "sort": 2 / 4}
    (tmp_path / "examples.json").write_text(json.dumps([vars(e) for e in examples]))
    procs = {mode: subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(Path(__file__).with_name("_task_eval_check.py")), mode, str(tmp_path / "examples.json"),
         str(tmp_path / f"{mode}.json")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
        for mode in ("ddp", "fsdp")}
    for mode, proc in procs.items():
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"{mode}: {err[-3000:]}"
        assert json.loads((tmp_path / f"{mode}.json").read_text()) == [want, want], mode
