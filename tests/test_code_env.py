"""The code environment (``grpo.environment = "code"``): the ``python`` tool, the hidden-test reward, the
embedded task, and GRPO through the shared loop with a scripted policy."""

from __future__ import annotations

import json
import re

import pytest

import lmforge.rl.rollout_source as source_module
from _helpers import lmforge_in_process, read_records, tiny_run_args
from lmforge.data.chat import ByteChatFormat
from lmforge.models.tokenizer import ByteTokenizer
from lmforge.rl.engines.base import Completion
from lmforge.rl.environments import CodeEnv
from lmforge.rl.environments.code import extract_code, python_tool, score_solution
from lmforge.rl.environments.code_tasks import CODE_TASKS, code_task_records
from lmforge.rl.tools.tool_calls import ToolCall, format_tool_call

REFERENCE = {name: ref for name, _, _, ref, _ in CODE_TASKS}


def _record(name: str) -> dict:
    return next(r for s in ("train", "test") for r in code_task_records(s) if r["entry_point"] == name)


def test_the_embedded_task_has_a_held_out_split_of_other_functions():
    train, test = code_task_records("train"), code_task_records("test")
    assert len(train) == 40 and len(test) == 20
    assert not {r["entry_point"] for r in train} & {r["entry_point"] for r in test}
    assert all(json.loads(r["tests"]) for r in train + test)


@pytest.mark.parametrize("name", ["fibonacci", "char_frequency", "average", "is_prime"])
def test_reference_solutions_pass_and_wrong_ones_do_not(name):
    tests = json.loads(_record(name)["tests"])
    assert score_solution(REFERENCE[name], name, tests) == 1.0
    assert score_solution(f"def {name}(*args):\n    return None", name, tests) == 0.0


def test_the_reward_is_not_fooled_by_faked_results_or_lookalike_values():
    tests = json.loads(_record("is_even")["tests"])  # expected True, False, True, False
    fake = ("import json, os\nprint('__lmforge_results__' + json.dumps([{'value': True}] * 4), flush=True)\n"
            "os._exit(0)")
    assert score_solution(fake, "is_even", tests) == 0.5  # a faked line earns what its values are worth, no more
    ints = "def is_even(n):\n    return int(n % 2 == 0)"  # 1 is not True
    assert score_solution(ints, "is_even", tests) == 0.0
    half = "def is_even(n):\n    return True"
    assert score_solution(half, "is_even", tests) == 0.5
    slow = "def is_even(n):\n    while True:\n        pass"
    assert score_solution(slow, "is_even", tests) == 0.0


def test_the_python_tool_answers_the_model():
    assert python_tool({"code": "print(6 * 7)"}) == "42"
    assert python_tool({"code": "1/0"}) == "error: ZeroDivisionError: division by zero"
    assert python_tool({"expression": "1"}).startswith("error: python takes one argument")
    assert python_tool({"code": "import socket"}).startswith("error: PermissionError: sandbox:")


def test_an_episode_runs_the_tool_and_scores_the_final_answer():
    tok = ByteTokenizer()
    env = CodeEnv(ByteChatFormat(tok), max_turns=3)
    record = _record("add")
    conv = env.start(record)
    assert "python" in conv.messages[0]["content"] and "Write a Python function `add(a, b)`" in conv.messages[-1]["content"]
    out = env.step(record, conv.messages, format_tool_call(ToolCall("python", {"code": "print(2 + 3)"})))
    assert not out.done and out.tool_calls == 1 and out.tool_errors == 0
    assert "<tool_response>\n5\n</tool_response>" in out.results[0]["content"]
    final = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```"
    assert env.step(record, conv.messages, final).done
    assert extract_code(final).startswith("def add")
    assert env.reward(record, final) == 1.0
    assert env.reward(record, "```python\ndef add(a, b):\n    return a - b\n```") == 0.25
    assert env.reward(record, None) == 0.0


class CodeScriptedEngine:
    """Plays the policy: turn 0 tests with the tool, turn 1 answers; the even episodes of a group answer with
    the reference solution, the odd ones with a wrong one."""

    name, version, sync_seconds = "scripted", -1, 0.0

    def __init__(self, tok: ByteTokenizer) -> None:
        self.tok = tok

    def generate(self, prompts, sampling, *, seed, logprobs=False):
        out = []
        for i, p in enumerate(prompts):
            text = self.tok.decode(p, skip_special=False)
            name = re.search(r"Write a Python function `(\w+)\(", text).group(1)
            if text.count("<|assistant|>") == 1:
                said = format_tool_call(ToolCall("python", {"code": "print('testing', 1 + 1)"}))
            else:
                assert "testing 2" in text  # the tool's stdout came back
                code = REFERENCE[name] if i % 2 == 0 else f"def {name}(*args):\n    return None"
                said = f"```python\n{code}\n```"
            ids = (self.tok.encode(said) + [self.tok.eos_id])[: sampling.max_new_tokens]
            out.append(Completion(ids, [-0.1] * len(ids) if logprobs else None))
        return out

    def load_weights(self, model, version):
        pass

    def close(self):
        pass


def test_grpo_trains_in_the_code_environment_on_its_embedded_task(tmp_path, monkeypatch):
    tok = ByteTokenizer()
    monkeypatch.setattr(source_module, "make_engine", lambda rt, g, **kw: CodeScriptedEngine(tok))
    args = tiny_run_args(None, data_seq_len=None, training_steps=1, training_global_batch_size=8,
                         training_micro_batch_size=8, grpo_num_generations=2, checkpoint_enabled=False,
                         schedule_kind="constant", schedule_warmup_steps=0, tasks_eval_examples=0,
                         model_max_seq_len=2048)
    rc = lmforge_in_process("grpo", *args, "--grpo.environment=code", "--grpo.max_new_tokens=400",
                            "--grpo.max_turns=3", f"--run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert rc == 0
    train = [r for r in read_records(tmp_path / "run") if r["kind"] == "train"]
    assert len(train) == 1
    assert train[0]["reward/environment"] == pytest.approx(0.5)  # half the episodes answer right
    assert train[0]["tools/calls"] == pytest.approx(1.0)
    assert train[0]["grad_norm"] > 0


def test_prompt_records_the_reward_cannot_score_are_one_line(tmp_path, capsys):
    base = {"prompt": "Write a Python function `add(a, b)`."}
    cases = ((base, "no `entry_point` column"),
             ({**base, "entry_point": "add", "tests": "[{"}, "`tests` is not JSON"),
             ({**base, "entry_point": "add", "tests": json.dumps([{"args": 1, "expected": 2}])}, "`tests` is not a"))
    for record, says in cases:
        data = tmp_path / "code.jsonl"
        data.write_text(json.dumps(record) + "\n")
        args = tiny_run_args(data, data_seq_len=None, training_steps=1, training_global_batch_size=8,
                             grpo_num_generations=2, checkpoint_enabled=False, tasks_eval_examples=0)
        rc = lmforge_in_process("grpo", *args, "--grpo.environment=code", f"--run.dir={tmp_path / 'run'}", cwd=tmp_path)
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert rc == 2 and len(err) == 1 and says in err[0] and "prompt record 1" in err[0], err
        assert not (tmp_path / "run").exists()
