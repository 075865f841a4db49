"""LLM-as-judge rewards (``judge:URL``) against a local OpenAI-compatible server started in the test:
scores, the cache, retries, a slow and a failing server, failures counted and the run stopped past the
allowed share, and GRPO through the shared loop with the judge as its reward."""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from _helpers import lmforge_in_process, read_records, tiny_run_args
from lmforge.errors import UserError
from lmforge.rl.judge import JudgeReward, JudgeSettings, parse_score


class Judge:
    """A chat-completions server whose score is the length of the graded answer (capped at 10); ``mode``
    makes it fail: ``"500"`` always, ``"flaky"`` every other request, ``"slow"`` sleeps past the timeout,
    ``"noscore"`` answers without a number."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode, self.requests, self.bodies = mode, 0, []
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                judge.requests += 1
                judge.bodies.append((self.path, self.headers.get("Authorization"), body))
                if judge.mode == "500" or (judge.mode == "flaky" and judge.requests % 2 == 1):
                    self.send_response(500)
                    self.end_headers()
                    return
                if judge.mode == "slow":
                    time.sleep(1.0)
                text = body["messages"][0]["content"]
                answer = re.search(r"Answer to grade:\n(.*)\n\nRate", text, re.DOTALL).group(1)
                reply = "no idea" if judge.mode == "noscore" else f"Looks fine.\nSCORE: {min(len(answer), 10)}"
                data = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except OSError:  # the client gave up (slow mode)
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def judge():
    servers: list[Judge] = []

    def start(mode: str = "ok") -> Judge:
        servers.append(Judge(mode))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_parse_score():
    assert parse_score("Good.\nSCORE: 7") == 7.0
    assert parse_score("score = 3.5 then SCORE: 8") == 8.0
    assert parse_score("I give it 4 out of 10") == 10.0  # no SCORE line: the last number
    assert parse_score("no number") is None


def test_scores_are_normalized_cached_and_sent_with_the_settings(judge, monkeypatch):
    server = judge()
    monkeypatch.setenv("JUDGE_KEY", "sk-test")
    reward = JudgeReward(server.url, JudgeSettings(model="grader", api_key_env="JUDGE_KEY"))
    got = reward(["q1", "q1", "q2"], ["abc", "abc", "abcdefghijklmnop"], answer=["1", "1", "2"])
    assert got == [0.3, 0.3, 1.0]
    assert server.requests == 2  # the repeated (prompt, completion) is asked once
    path, auth, body = server.bodies[0]
    assert path == "/v1/chat/completions" and auth == "Bearer sk-test" and body["model"] == "grader"
    assert reward(["q1"], ["abc"], answer=["1"]) == [0.3] and server.requests == 2  # from the cache
    assert reward.batch_metrics() == {"judge/failed": 0.0, "judge/cache_hits": 1.0}


def test_a_flaky_judge_is_retried(judge):
    server = judge("flaky")
    reward = JudgeReward(server.url, JudgeSettings(retries=1))
    assert reward(["q"], ["abcd"]) == [0.4]
    assert server.requests == 2 and reward.failures == 0


def test_failures_are_counted_not_scored_zero_and_stop_the_run_past_the_share(judge, capsys):
    for mode, says in (("500", "HTTP 500"), ("slow", "timed out"), ("noscore", "no score in the reply")):
        server = judge(mode)
        reward = JudgeReward(server.url, JudgeSettings(retries=1, timeout_s=0.3, max_failed=0.5))
        with pytest.raises(UserError, match=f"could not score 2 of 2 completions.*{says}"):
            reward(["q", "q"], ["a", "b"])
        assert reward.failures == 2 and server.requests == 4  # each tried twice
    lenient = JudgeReward(judge("500").url, JudgeSettings(retries=0, max_failed=1.0))
    assert lenient(["q"], ["a"]) == [None]  # no score, not 0.0
    assert lenient.batch_metrics()["judge/failed"] == 1.0
    assert "warning: the judge at" in capsys.readouterr().err


def test_an_unreachable_judge_and_a_bad_rubric_are_one_line(tmp_path, capsys):
    args = tiny_run_args(None, data_seq_len=None, training_steps=1, training_global_batch_size=8,
                         grpo_num_generations=2, checkpoint_enabled=False, tasks_eval_examples=0)
    for extra, says in ((["--grpo.rewards=judge:http://127.0.0.1:9/v1", "--grpo.judge_retries=0"],
                         "could not score 1 of 1 completions"),
                        (["--grpo.rewards=judge:ftp://x"], "must start with http:// or https://"),
                        (["--grpo.rewards=judge:http://127.0.0.1:9", "--grpo.judge_rubric={nope}"],
                         "grpo.judge_rubric: not a template")):
        rc = lmforge_in_process("grpo", *args, *extra, f"--run.dir={tmp_path / 'run'}", cwd=tmp_path)
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert rc == 2 and len(err) == 1 and says in err[0], err
        assert not (tmp_path / "run").exists()


def test_grpo_trains_with_the_judge_as_its_reward(tmp_path, judge):
    server = judge()
    args = tiny_run_args(None, data_seq_len=None, training_steps=2, training_global_batch_size=8,
                         training_micro_batch_size=8, grpo_num_generations=4, checkpoint_enabled=False,
                         tasks_eval_examples=0)
    rc = lmforge_in_process("grpo", *args, f"--grpo.rewards=judge:{server.url}", "--grpo.max_new_tokens=8",
                            f"--run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert rc == 0
    train = [r for r in read_records(tmp_path / "run") if r["kind"] == "train"]
    assert len(train) == 2 and server.requests > 0
    key = f"reward/judge:{server.url}"
    assert all(0.0 <= r[key] <= 1.0 and r["judge/failed"] == 0.0 for r in train), train
