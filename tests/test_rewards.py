"""The math_answer reward: final-answer extraction and comparison, and GRPO on the GSM8K excerpt."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from _helpers import lmforge_in_process, run_lmforge, tail, tiny_run_args
from lmforge.errors import UserError
from lmforge.metrics.records import read_records
from lmforge.rl.math_answers import final_answer
from lmforge.rl.rewards import BUILTIN_REWARDS, load_rewards, score_completions

ROOT = Path(__file__).resolve().parents[1]
GSM8K_TRAIN = ROOT / "tests" / "fixtures" / "data" / "gsm8k_train.jsonl"

CASES = [  # (completion, reference answer, reward)
    ("Natalia sold 48/2 = 24 clips in May.\n48+24 = 72\n#### 72", "72", 1.0),
    ("#### 72", "The answer: 48/2 = <<48/2=24>>24\n48+24 = <<48+24=72>>72\n#### 72", 1.0),  # GSM8K solution
    ("#### 71", "Full solution ... #### 72", 0.0),
    ("So she earned $10.", "10", 1.0),                       # no marker: the last number
    ("She had 5, lost 2, so 3 remain. #### 3", "3", 1.0),
    ("#### 3\nCheck: 1 + 2 = 3, not 4", "3", 1.0),             # #### wins over later numbers
    ("Maybe 4? Final: \\boxed{5}. Then 6 pages.", "5", 1.0),   # boxed wins over later numbers
    ("#### 1,000", "1000", 1.0),
    ("The total is $1,000.00.", "1000", 1.0),
    ("#### 1000.0", "1,000", 1.0),
    ("#### $ 70,000", "70000", 1.0),
    ("#### 1,2", "12", 0.0),                                  # not a thousands separator
    ("The change is -5 degrees.", "-5", 1.0),
    ("It fell by \u22125.", "-5", 1.0),                        # unicode minus
    ("From 9-4 we get 5", "-4", 0.0),                          # a hyphen after a digit is no sign
    ("#### -3", "3", 0.0),
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),                    # nested braces, fractions as numbers
    ("#### 3/4", "\\boxed{\\dfrac{3}{4}}", 1.0),
    ("#### 0.333", "1/3", 0.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{\\text{18 dollars}}", "18dollars", 1.0),        # non-numeric: normalized strings
    ("\\boxed{x+1}", "x + 1", 1.0),
    ("\\boxed{x+2}", "x + 1", 0.0),
    ("#### 72 apples", "72", 1.0),
    ("I do not know.", "72", 0.0),
    ("", "0", 0.0),
    ("\\boxed{5", "5", 1.0),                                   # unclosed box: the last number
]


@pytest.mark.parametrize("completion,answer,reward", CASES)
def test_math_answer_table(completion, answer, reward):
    assert BUILTIN_REWARDS["math_answer"](["p"], [completion], answer=[answer]) == [reward]


def test_extraction_order_and_nested_braces():
    assert final_answer("a \\boxed{\\frac{1}{\\sqrt{2}}} b") == "\\frac{1}{\\sqrt{2}}"
    assert final_answer("\\boxed{1} then \\boxed{2}") == "2"
    assert final_answer("#### 4 \n\\boxed{5}") == "4"
    assert final_answer("no digits") is None


def test_math_answer_through_the_rewards_api():
    rewards = load_rewards(["math_answer", "format"], [1.0, 0.5])
    scores = score_completions(rewards, ["q1", "q2", "q3"], ["#### 72", "#### 5", "7"],
                               {"answer": ["72", None, 7]})  # no answer: does not apply; numbers are fine
    assert scores.per_function["math_answer"][0] == 1.0 and math.isnan(scores.per_function["math_answer"][1])
    assert scores.per_function["math_answer"][2] == 1.0
    with pytest.raises(UserError, match="reward `math_answer` needs an `answer` column"):
        score_completions(rewards, ["q"], ["#### 1"], {"task": ["x"]})


def test_grpo_on_gsm8k_with_math_answer(tmp_path):
    """The example config, two updates on the GSM8K excerpt with tiny settings: every completion is scored."""
    run = tmp_path / "run"
    r = run_lmforge("grpo", "--config", ROOT / "configs" / "grpo_gsm8k.toml",
                    *tiny_run_args(data_seq_len=None, training_steps=2, training_global_batch_size=4,
                                   training_micro_batch_size=4, grpo_num_generations=2, grpo_max_new_tokens=6,
                                   grpo_mask_truncated=False, grpo_log_completions_every=1, schedule_warmup_steps=0),
                    f"--run.dir={run}")
    assert r.returncode == 0, tail(r)
    train = read_records(run, "train")
    assert [x["step"] for x in train] == [1, 2]
    for x in train:  # a value, not NaN: every prompt's answer reached the reward
        assert 0.0 <= x["reward/math_answer"] <= 1.0 and 0.0 <= x["reward/mean"] <= 1.0
        assert x["total_weights"] > 0
    prompts = {json.loads(line)["prompt"] for line in GSM8K_TRAIN.read_text().splitlines()}
    logged = [x for x in read_records(run) if x["kind"] == "text"]
    assert logged and any(p in logged[0]["text"] for p in prompts)


# ------------------------------------------------------------- a user's reward function gone wrong
def _raises(prompts, completions, **fields):
    return [len(c.split()[0]) for c in completions]  # IndexError on an empty completion


BAD_REWARDS = {  # function -> words of the one-line error
    "raises": (_raises, ["reward `bad` raised IndexError", "fn(prompts, completions, **fields)"]),
    "string_values": (lambda p, c, **f: ["1.0" for _ in c], ["returned str '1.0'", "expected a number or None"]),
    "list_values": (lambda p, c, **f: [[1.0] for _ in c], ["returned list", "expected a number or None"]),
    "nan": (lambda p, c, **f: [math.nan for _ in c], ["returned NaN", "return None"]),
    "huge": (lambda p, c, **f: [1e308 for _ in c], ["returned 1e+308", "within +-1e+06"]),
    "infinite": (lambda p, c, **f: [math.inf for _ in c], ["returned inf"]),
    "scalar": (lambda p, c, **f: 1.0, ["returned a float", "expected a list"]),
    "wrong_count": (lambda p, c, **f: [1.0, 2.0, 3.0], ["returned 3 values for 1 completions"]),
    "wrong_signature": (lambda completions: [1.0 for _ in completions], ["raised TypeError"]),
}


@pytest.mark.parametrize("case", list(BAD_REWARDS))
def test_bad_reward_functions_fail_at_start_in_one_line(case):
    from lmforge.rl.rewards import WeightedReward, probe_rewards

    fn, words = BAD_REWARDS[case]
    with pytest.raises(UserError) as info:
        probe_rewards([WeightedReward("bad", fn, 1.0)], {"prompt": "What is 2+2?", "answer": "4"})
    message = str(info.value)
    assert "\n" not in message and "start-up check" in message
    for w in words:
        assert w in message, (w, message)


def test_reward_values_that_are_fine_pass():
    from lmforge.rl.rewards import WeightedReward

    import numpy as np

    ok = WeightedReward("ok", lambda p, c, **f: [np.float32(0.5), None, 1, True is False], 2.0)
    scores = score_completions([ok], ["p"] * 4, ["a", "b", "c", "d"], {})
    assert scores.total == [1.0, 0.0, 2.0, 0.0]


def test_reward_module_that_fails_to_import(tmp_path, monkeypatch):
    (tmp_path / "broken_reward.py").write_text("def reward(prompts, completions:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UserError, match=r"importing `broken_reward` failed: SyntaxError"):
        load_rewards(["broken_reward:reward"])


def test_grpo_with_a_failing_reward_writes_nothing(tmp_path, monkeypatch, capfd):
    """Refused by the start-up probe of the rewards, before the run directory is made. Run in this
    process with tmp_path first on sys.path, as ``python -m lmforge`` started in tmp_path has it."""
    (tmp_path / "my_rewards.py").write_text("def score(prompts, completions, **fields):\n    return ['high'] * len(completions)\n")
    run = tmp_path / "run"
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    try:
        rc = lmforge_in_process("grpo", *tiny_run_args(GSM8K_TRAIN, data_seq_len=None), "--rewards=my_rewards:score",
                                f"--run.dir={run}", cwd=tmp_path)
    finally:
        sys.modules.pop("my_rewards", None)  # another test's my_rewards is another file
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(errors) == 1 and "Traceback" not in err, err[-2000:]
    assert "reward `my_rewards:score` returned str 'high'" in errors[0]
    assert not run.exists()
