"""Multi-turn GRPO with tools through the shared loop (``grpo.environment``).

The policy's turns come from a scripted engine (a tiny random model never writes a tool call), so the
test knows exactly which tokens the policy wrote: the GSM8K calculator environment runs the calls, appends
the results, and the update trains on the policy's tokens only.
"""

from __future__ import annotations

import json
import shutil

import pytest

import lmforge.rl.rollout as rollout_module
import lmforge.rl.rollout_source as source_module
from _helpers import lmforge_in_process, read_records, tiny_run_args
from test_multi_turn import GSM8K, RECORDS, SCRIPTS, ScriptedEngine


GIVE_UP = "I do not know.\n#### 0"


class TurnCountingEngine(ScriptedEngine):
    """The scripted turns, the turn told by the conversation itself (so every rollout starts at turn 0);
    the second episode of every group gives up at once (reward 0), so groups carry a signal."""

    def generate(self, prompts, sampling, *, seed, logprobs=False):
        turns = {self.tok.decode(p, skip_special=False).count("<|assistant|>") - 1 for p in prompts}
        assert len(turns) == 1  # one generate call per turn, all episodes at the same turn
        self.turn = turns.pop() - 1
        out = super().generate(prompts, sampling, seed=seed, logprobs=logprobs)
        if self.turn == 0:
            for i in range(1, len(out), 2):
                out[i].token_ids = self.tok.encode(GIVE_UP) + [self.stop_id]
        return out


def test_tool_episodes_train_on_the_policys_tokens_only(tmp_path, monkeypatch):
    from lmforge.models.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    monkeypatch.setattr(source_module, "make_engine", lambda rt, g, **kw: TurnCountingEngine(tok, tok.eos_id))
    laid_out = []
    real_layout = rollout_module.policy_rows

    def recording_layout(prompts, completions, keep, pad_id, advantages, device, masks=None):
        batch = real_layout(prompts, completions, keep, pad_id, advantages, device, masks)
        laid_out.append((prompts, completions, batch))
        return batch

    monkeypatch.setattr(rollout_module, "policy_rows", recording_layout)
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    args = tiny_run_args(data, data_seq_len=None, training_steps=2, training_global_batch_size=8,
                         training_micro_batch_size=8, grpo_num_generations=2, checkpoint_enabled=False,
                         schedule_kind="constant", schedule_warmup_steps=0, tasks_eval_examples=0,
                         model_max_seq_len=2048)
    rc = lmforge_in_process("grpo", *args, "--grpo.environment=gsm8k_calculator", "--grpo.max_new_tokens=120",
                            "--grpo.max_turns=3", f"--run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert rc == 0
    train = [r for r in read_records(tmp_path / "run") if r["kind"] == "train"]
    assert len(train) == 2
    first = train[0]
    # records 0 and 1 answer right after tool calls, 2 answers wrong without tools, 3 never answers;
    # the second episode of each group gives up in one turn
    assert first["reward/environment"] == pytest.approx(2 / 8)
    assert first["tools/calls"] == pytest.approx((2 + 2 + 0 + 2) / 8)  # calls made before the last turn
    assert first["tools/turns"] == pytest.approx((3 + 3 + 1 + 3 + 4) / 8)
    assert first["tools/truncated"] == pytest.approx(1 / 8)
    assert all(abs(r["loss"]) < 10 and r["grad_norm"] > 0 for r in train), [(r["loss"], r["grad_norm"]) for r in train]
    # the loss mask covers exactly the policy's turns (each with its stop token), never a tool result
    prompts, completions, batch = laid_out[0]
    for i, (p, c) in enumerate(zip(prompts, completions)):
        targets = batch.targets[i].tolist()
        mask = batch.mask[i].tolist()
        policy = [t for t, m in zip(targets, mask) if m > 0]
        env = [t for t, m in zip(targets[len(p) - 1: len(p) - 1 + len(c)], mask[len(p) - 1:]) if m == 0]
        question = next(q for q in SCRIPTS if q in tok.decode(p, skip_special=False))
        played = SCRIPTS[question][: 3 if question != RECORDS[2]["prompt"] else 1] if i % 2 == 0 else [GIVE_UP]
        assert tok.decode(policy, skip_special=False) == "".join(s + tok.decode([tok.eos_id], skip_special=False)
                                                                 for s in played)
        if i % 2 == 0 and question != RECORDS[2]["prompt"]:
            assert "<tool_response>" in tok.decode(env, skip_special=False)  # the results are in, unmasked
    shutil.rmtree(tmp_path / "run")


def test_an_unknown_environment_is_one_line_before_anything_is_written(tmp_path, capsys):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    args = tiny_run_args(data, data_seq_len=None, training_steps=1, training_global_batch_size=8,
                         grpo_num_generations=2, checkpoint_enabled=False, tasks_eval_examples=0)
    (tmp_path / "broken_env.py").write_text("raise RuntimeError('broken at import')\n")
    for name, says in (("calculator_world", "not a built-in (gsm8k_calculator, code), module:Class, verifiers:ID nor openenv:"),
                       ("no_such_module:Env", "cannot load it (ModuleNotFoundError"),
                       ("json:dumps", "a function, not an environment"),
                       ("os:sep", "a str, not an environment"),
                       ("json:JSONDecoder", "a class without start, step, reward, not an environment"),
                       ("broken_env:Env", "cannot load it (RuntimeError: broken at import)"),
                       (":Env", "module:Class, verifiers:ID")):
        with pytest.MonkeyPatch.context() as mp:
            mp.syspath_prepend(str(tmp_path))
            rc = lmforge_in_process("grpo", *args, f"--grpo.environment={name}", f"--run.dir={tmp_path / 'run'}",
                                    cwd=tmp_path)
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert rc == 2 and len(err) == 1 and says in err[0], err
        assert not (tmp_path / "run").exists()
