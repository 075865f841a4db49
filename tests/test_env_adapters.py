"""Third-party environments in GRPO: ``verifiers:ID`` (a verifiers taskset) and ``openenv:module:Class`` (an
OpenEnv environment, in-process), with the toy packages of tests/fixtures/envs; what needs the network, a
judge, a runtime or another shape is refused in one line before the run starts."""

from __future__ import annotations

import importlib
import importlib.util
import re
import socket
import textwrap
import threading
import time
from pathlib import Path

import pytest

import lmforge.rl.rollout_source as source_module
from _helpers import lmforge_in_process, read_records, tiny_run_args
from lmforge.data.chat import ByteChatFormat
from lmforge.errors import UserError
from lmforge.models.tokenizer import ByteTokenizer
from lmforge.rl.engines.base import Completion
from lmforge.rl.tools.tool_calls import ToolCall, format_tool_call
from lmforge.rl.environments.offline import NetworkUse, no_network

from lmforge.rl.environments.openenv_env import action_field, observation_text
from lmforge.rl.environments.verifiers_env import load_tasks, score_reply
from lmforge.rl.episode_groups import environment_class, load_environment

needs_verifiers = pytest.mark.skipif(importlib.util.find_spec("verifiers") is None,
                                     reason="the verifiers package (pip install 'lmforge[envs]')")
needs_openenv = pytest.mark.skipif(importlib.util.find_spec("openenv") is None,
                                   reason="the openenv-core package (pip install 'lmforge[envs]')")

ENVS = Path(__file__).resolve().parent / "fixtures" / "envs"
TOY = "verifiers:lmforge-toy-env"
TOOLS = "verifiers:lmforge-toy-tools-env"
GUESS = "openenv:lmforge_toy_openenv:GuessEnv"


@pytest.fixture(autouse=True)
def fixture_envs_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ENVS))


def _grpo_args(tmp_path, **overrides):
    values = dict(data_seq_len=None, training_steps=1, training_global_batch_size=8, training_micro_batch_size=8,
                  grpo_num_generations=2, checkpoint_enabled=False, schedule_kind="constant",
                  schedule_warmup_steps=0, tasks_eval_examples=0, model_max_seq_len=1024)
    return [*tiny_run_args(None, **(values | overrides)), f"--run.dir={tmp_path / 'run'}"]


def _one_error(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1, err
    return err[0]


# ---------------------------------------------------------------------------------------------- the guard
def test_the_network_guard_refuses_connections_and_lookups_and_restores_them():
    real = socket.getaddrinfo
    with no_network() as net:
        with pytest.raises(NetworkUse):
            socket.create_connection(("192.0.2.1", 80), timeout=1)
        try:
            socket.getaddrinfo("example.com", 443)
        except Exception:  # noqa: BLE001 - a library's broad except must not hide the attempt
            raise AssertionError("NetworkUse must not be an Exception")
        except NetworkUse:
            pass
    assert net.first == "192.0.2.1:80"
    assert socket.getaddrinfo is real
    with no_network() as net:
        a, b = socket.socketpair()  # a Unix socket is not the network
        a.close(), b.close()
    assert net.first is None


# ---------------------------------------------------------------------------------------------- verifiers
@needs_verifiers
def test_the_toy_rubric_scores_known_completions_with_its_weights():
    tasks = load_tasks("lmforge-toy-env")
    assert len(tasks) == 8 and tasks[1].data.answer == "blue"
    # correct (weight 1) + brief (weight 0.5), both async reward functions, awaited
    assert score_reply(tasks[1], "blue") == 1.5
    assert score_reply(tasks[1], " Blue ") == 1.5
    assert score_reply(tasks[1], "red") == 0.5
    assert score_reply(tasks[1], "the answer is blue") == 0.0


@needs_verifiers
def test_a_verifiers_episode_is_the_tasks_prompt_and_one_answer():
    env = load_environment(TOY, ByteChatFormat(ByteTokenizer()), max_turns=3, prompt_field="prompt",
                           answer_field="answer")
    records = type(env).embedded_records("train")
    assert len(records) == 8 and type(env).embedded_records("test") == []
    episode = env.for_episode()
    conv = episode.start(records[2])
    assert conv.messages == [{"role": "system", "content": "Answer with one word."},
                             {"role": "user", "content": "Reply with the word green."}]
    assert episode.step(records[2], conv.messages, "green").done
    assert episode.reward(records[2], "green") == 1.5
    assert episode.reward(records[2], "GREEN!") == 0.5
    assert episode.reward(records[2], None) == 0.0  # no answer: cut off by a limit


@needs_verifiers
def test_a_task_with_a_toolset_plays_tool_turns_on_its_own_instances():
    env = load_environment(TOOLS, ByteChatFormat(ByteTokenizer()), max_turns=3, prompt_field="prompt",
                           answer_field="answer")
    record = type(env).embedded_records("train")[0]  # 17 + 25
    a, b = env.for_episode(), env.for_episode()
    conv = a.start(record)
    b.start(record)
    assert '"name": "adder_add"' in conv.messages[0]["content"]  # the name verifiers gives the model
    out = a.step(record, conv.messages, format_tool_call(ToolCall("adder_add", {"a": 17, "b": 25})))
    assert not out.done and out.tool_calls == 1 and "<tool_response>\n42\n</tool_response>" in out.results[0]["content"]
    bad = a.step(record, conv.messages, format_tool_call(ToolCall("adder_add", {"a": "x"})))
    assert bad.tool_errors == 1 and "error:" in bad.results[0]["content"]
    assert a.hosted.toolsets[0].calls == 1 and b.hosted.toolsets[0].calls == 0  # state per episode
    assert a.step(record, conv.messages, "42").done
    assert a.reward(record, "42") == 1.5  # correct + used_tool: the tool's result is in the trace
    assert b.step(record, [], "42").done and b.reward(record, "42") == 1.0  # right, without the tool


def _taskset(tmp_path: Path, name: str, body: str) -> str:
    """A taskset package ``name`` in tmp_path (on the path): Data has ``answer``; ``body`` defines ``T`` (the
    task class) and may add to the module."""
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent('''
        import verifiers.v1 as vf

        class Data(vf.TaskData):
            answer: str = "x"
        ''') + textwrap.dedent(body) + textwrap.dedent('''
        class TS(vf.Taskset[T]):
            def load(self):
                yield from (T(Data(prompt=f"say {i}"), self.config.task) for i in range(LOAD))
        LOAD = globals().get("LOAD", 2)
        __all__ = ["TS"]
        '''))
    importlib.invalidate_caches()
    return name


OK_TASK = '''
class T(vf.Task[Data]):
    @vf.reward
    async def r(self, trace) -> float:
        return 1.0
'''


@needs_verifiers
@pytest.mark.parametrize("name, body, says", [
    ("vf_downloads", '''
        import urllib.request
        class T(vf.Task[Data]):
            @vf.reward
            async def r(self, trace) -> float:
                return 1.0
        urllib.request.urlopen("http://192.0.2.7:8080/data.json", timeout=2)  # a dataset download at import
        ''', "needs the network (it connected to 192.0.2.7:8080"),
    ("vf_api_judge", '''
        import socket
        class T(vf.Task[Data]):
            @vf.reward
            async def r(self, trace) -> float:  # a judge behind an API, asked while scoring
                socket.create_connection(("api.judge.example", 443), timeout=2)
                return 1.0
        ''', "needs the network (it connected to api.judge.example:443"),
    ("vf_runtime", '''
        class T(vf.Task[Data]):
            @vf.reward
            async def r(self, trace, runtime) -> float:
                return 1.0
        ''', "reward or metric functions (r) read the task's runtime"),
    ("vf_container", '''
        class T(vf.Task[Data]):
            NEEDS_CONTAINER = True
            @vf.reward
            async def r(self, trace) -> float:
                return 1.0
        ''', "need a container runtime"),
    ("vf_no_reward", '''
        class T(vf.Task[Data]):
            pass
        ''', "have no @vf.reward function"),
    ("vf_empty", OK_TASK + "LOAD = 0\n", "yielded no tasks"),
    ("vf_remote_tools", '''
        class T(vf.Task[Data]):
            @vf.reward
            async def r(self, trace) -> float:
                return 1.0
        class Search(vf.Toolset):
            @vf.tool
            async def search(self, q: str) -> str:
                return q
        T.toolsets = classmethod(lambda cls, config: [Search(vf.ToolsetConfig(url="http://tools.example:9000"))])
        ''', "its toolset Search is a remote server (http://tools.example:9000)"),
    ("vf_raises", '''
        class T(vf.Task[Data]):
            @vf.reward
            async def r(self, trace) -> float:
                raise KeyError("OPENAI_API_KEY")
        ''', "cannot load it (TaskError"),
])
def test_what_lmforge_cannot_run_is_one_line_before_the_run(tmp_path, monkeypatch, capsys, name, body, says):
    monkeypatch.syspath_prepend(str(tmp_path))
    _taskset(tmp_path, name, body)
    rc = lmforge_in_process("grpo", *_grpo_args(tmp_path), f"--grpo.environment=verifiers:{name}", cwd=tmp_path)
    line = _one_error(capsys)
    assert rc == 2 and f"grpo.environment=verifiers:{name}" in line and says in line, line
    assert not (tmp_path / "run").exists()


@needs_verifiers
def test_a_judge_behind_the_openai_api_is_refused_for_its_key_or_its_network(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    _taskset(tmp_path, "vf_openai_judge", '''
        import openai
        class T(vf.Task[Data]):
            @vf.reward
            async def judge(self, trace) -> float:
                client = openai.AsyncOpenAI(max_retries=0)
                r = await client.chat.completions.create(
                    model="gpt-4o-mini", messages=[{"role": "user", "content": "Is this right? " + trace.last_reply}])
                return float("yes" in r.choices[0].message.content.lower())
        ''')
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(UserError, match=r"verifiers:vf_openai_judge: cannot load it \(TaskError: .*OPENAI_API_KEY"):
        environment_class("verifiers:vf_openai_judge")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-a-key")
    with pytest.raises(UserError, match=r"it needs the network \(it connected to api\.openai\.com:443"):
        environment_class("verifiers:vf_openai_judge")


@needs_verifiers
def test_a_missing_taskset_and_a_prompt_file_are_one_line(tmp_path, capsys):
    with pytest.raises(UserError, match=r"verifiers:no-such-taskset: cannot load it \(ModuleNotFoundError"):
        environment_class("verifiers:no-such-taskset")
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "hi", "answer": "x"}\n')
    rc = lmforge_in_process("grpo", *_grpo_args(tmp_path, data_train=data, data_validation=data),
                            f"--grpo.environment={TOY}", cwd=tmp_path)
    line = _one_error(capsys)
    assert rc == 2 and "leave data.train = embedded" in line, line


class WordEngine:
    """Plays the policy on the toy taskset: even episodes of a group say the word asked for, odd ones "no"."""

    name, version, sync_seconds = "scripted", -1, 0.0

    def __init__(self, tok: ByteTokenizer) -> None:
        self.tok, self.seen = tok, []

    def generate(self, prompts, sampling, *, seed, logprobs=False):
        out = []
        for i, p in enumerate(prompts):
            text = self.tok.decode(p, skip_special=False)
            self.seen.append(text)
            said = re.search(r"Reply with the word (\w+)\.", text).group(1) if i % 2 == 0 else "no"
            ids = self.tok.encode(said) + [self.tok.eos_id]
            out.append(Completion(ids, [-0.1] * len(ids) if logprobs else None))
        return out

    def load_weights(self, model, version):
        pass

    def close(self):
        pass


@needs_verifiers
def test_grpo_trains_on_a_verifiers_taskset_with_its_rubric_as_the_reward(tmp_path, monkeypatch):
    engine = WordEngine(ByteTokenizer())
    monkeypatch.setattr(source_module, "make_engine", lambda rt, g, **kw: engine)
    rc = lmforge_in_process("grpo", *_grpo_args(tmp_path), f"--grpo.environment={TOY}", "--grpo.max_new_tokens=16",
                            cwd=tmp_path)
    assert rc == 0
    train = [r for r in read_records(tmp_path / "run") if r["kind"] == "train"]
    assert len(train) == 1
    # the rubric's: the word scores 1.5 (correct + 0.5 brief), "no" 0.5 (brief only)
    assert train[0]["reward/environment"] == pytest.approx(1.0)
    assert train[0]["tools/turns"] == pytest.approx(1.0)
    assert train[0]["grad_norm"] > 0
    assert len(engine.seen) == 8 and all("Answer with one word." in s for s in engine.seen)


class SumEngine:
    """Plays the policy on the tool taskset: even episodes of a call use the tool, then answer what it said;
    odd ones answer a wrong number at once."""

    name, version, sync_seconds = "scripted", -1, 0.0

    def __init__(self, tok: ByteTokenizer) -> None:
        self.tok, self.results = tok, []

    def generate(self, prompts, sampling, *, seed, logprobs=False):
        out = []
        for i, p in enumerate(prompts):
            text = self.tok.decode(p, skip_special=False)
            a, b = map(int, re.search(r"What is (\d+) \+ (\d+)\?", text).groups())
            got = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text)
            if got:
                self.results.append(got[-1])
                said = got[-1]
            elif "<tool_call>" in text.split("<|user|>What is")[-1]:
                raise AssertionError("the tool's result did not come back")
            else:
                said = format_tool_call(ToolCall("adder_add", {"a": a, "b": b})) if i % 2 == 0 else "7"
            ids = self.tok.encode(said) + [self.tok.eos_id]
            out.append(Completion(ids, [-0.1] * len(ids) if logprobs else None))
        return out

    def load_weights(self, model, version):
        pass

    def close(self):
        pass


@needs_verifiers
def test_grpo_trains_on_a_verifiers_taskset_with_tools(tmp_path, monkeypatch):
    engine = SumEngine(ByteTokenizer())
    monkeypatch.setattr(source_module, "make_engine", lambda rt, g, **kw: engine)
    rc = lmforge_in_process("grpo", *_grpo_args(tmp_path, model_max_seq_len=2048), f"--grpo.environment={TOOLS}",
                            "--grpo.max_turns=3", "--grpo.max_new_tokens=64", "--grpo.max_total_tokens=400",
                            cwd=tmp_path)
    assert rc == 0
    train = [r for r in read_records(tmp_path / "run") if r["kind"] == "train"]
    # tool then the sum: 1.5 (correct + used_tool); "7" at once: 0.0
    assert train[0]["reward/environment"] == pytest.approx(0.75)
    assert train[0]["tools/calls"] == pytest.approx(0.5) and train[0]["tools/error_rate"] == 0.0
    assert train[0]["tools/turns"] == pytest.approx(1.5)
    assert len(engine.results) == 4 and all(r.isdigit() for r in engine.results)


# ---------------------------------------------------------------------------------------------- OpenEnv
@needs_openenv
def test_openenv_observations_and_actions_map_to_text():
    from lmforge_toy_openenv import GuessAction, GuessObservation

    assert action_field(GuessAction) == "guess"
    assert observation_text(GuessObservation(text="higher", reward=-0.1)) == "higher"
    from openenv.core.env_server import Action, Observation

    class Two(Action):
        a: str
        b: int

    class Rich(Observation):
        board: str = ""
        moves: int = 0

    assert action_field(Two) is None
    assert observation_text(Rich(board="x.o", moves=2)) == '{"board": "x.o", "moves": 2}'


@needs_openenv
def test_an_openenv_episode_steps_until_done_and_returns_the_sum_of_rewards():
    env = load_environment(GUESS, ByteChatFormat(ByteTokenizer()), max_turns=4, prompt_field="prompt",
                           answer_field="answer")
    records = type(env).embedded_records("train")
    assert len(records) == 64 and records[5]["openenv_seed"] == 5
    record = records[1]  # secret 2
    a, b = env.for_episode(), env.for_episode()  # one instance each: their state is their own
    assert a.start(record).messages[0]["content"].startswith("Guess my number")
    b.start(record)
    out = a.step(record, [], "4")
    assert not out.done and out.results == [{"role": "user", "content": "lower"}]
    assert "not a number" in a.step(record, [], "two").results[0]["content"]
    assert a.step(record, [], "2").done
    assert b.step(record, [], "2").done
    assert a.reward(record, "2") == pytest.approx(-0.1 - 0.5 + 1.0)
    assert b.reward(record, "2") == pytest.approx(1.0)


@needs_openenv
@pytest.mark.parametrize("name, says", [
    ("openenv:lmforge_toy_openenv:GuessAction", "is not an OpenEnv Environment"),
    ("openenv:no_such_module:Env", "cannot load it (ModuleNotFoundError"),
    ("openenv:lmforge_toy_openenv", "expected openenv:module:Class (an OpenEnv Environment class, run in-process) "
                                    "or openenv:http://HOST:PORT"),
])
def test_openenv_refusals_are_one_line(name, says):
    with pytest.raises(UserError, match=re.escape(says)):
        environment_class(name)


@needs_openenv
def test_an_openenv_env_with_a_two_field_action_or_the_network_is_refused(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "oe_bad.py").write_text(textwrap.dedent('''
        import socket
        from openenv.core.env_server import Action, Environment, Observation, State

        class Move(Action):
            row: int
            col: int

        class Say(Action):
            text: str

        class Board(Environment):
            def reset(self, seed=None, episode_id=None, **kw): return Observation()
            def step(self, action: Move, timeout_s=None, **kw): return Observation()
            @property
            def state(self): return State()

        class Remote(Environment):
            def reset(self, seed=None, episode_id=None, **kw):
                socket.create_connection(("198.51.100.3", 9000), timeout=2)
            def step(self, action: Say, timeout_s=None, **kw): return Observation()
            @property
            def state(self): return State()
        '''))
    importlib.invalidate_caches()
    with pytest.raises(UserError, match=r"its action Move has the fields row, col"):
        environment_class("openenv:oe_bad:Board")
    with pytest.raises(UserError, match=r"needs the network \(it connected to 198\.51\.100\.3:9000"):
        environment_class("openenv:oe_bad:Remote")


class GuessEngine:
    """Plays the guessing game: half the episodes reply "x" (not a number: -0.5 a turn), half "9" (wrong: -0.1 a
    turn), every turn; from the second turn on it checks that the environment's answer came back."""

    name, version, sync_seconds = "scripted", -1, 0.0

    def __init__(self, tok: ByteTokenizer) -> None:
        self.tok, self.turns = tok, 0

    def generate(self, prompts, sampling, *, seed, logprobs=False):
        self.turns += 1
        out = []
        for i, p in enumerate(prompts):
            text = self.tok.decode(p, skip_special=False)
            said = re.findall(r"<\|assistant\|>(\w)", text)
            if said:  # a later turn: the environment's answer to the first came back; say the same again
                assert ("That is not a number" if said[0] == "x" else "lower") in text, text
            ids = self.tok.encode(said[0] if said else "x" if i % 2 == 0 else "9") + [self.tok.eos_id]
            out.append(Completion(ids, [-0.1] * len(ids) if logprobs else None))
        return out

    def load_weights(self, model, version):
        pass

    def close(self):
        pass


@needs_openenv
def test_grpo_trains_on_an_openenv_environment_turn_by_turn(tmp_path, monkeypatch):
    engine = GuessEngine(ByteTokenizer())
    monkeypatch.setattr(source_module, "make_engine", lambda rt, g, **kw: engine)
    rc = lmforge_in_process("grpo", *_grpo_args(tmp_path), f"--grpo.environment={GUESS}", "--grpo.max_turns=2",
                            "--grpo.max_new_tokens=8", "--grpo.max_total_tokens=200", cwd=tmp_path)
    assert rc == 0 and engine.turns == 2
    train = [r for r in read_records(tmp_path / "run") if r["kind"] == "train"]
    # two steps each: "x" twice is -1.0, "9" twice -0.2; the mean -0.6 whatever the seeds
    assert train[0]["reward/environment"] == pytest.approx(-0.6)
    assert train[0]["tools/turns"] == pytest.approx(2.0)
    assert train[0]["grad_norm"] > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def guess_server():
    """The toy environment behind OpenEnv's own server (``create_app``, as its Docker images run it), in a thread."""
    import sys

    sys.path.insert(0, str(ENVS))
    from openenv.core.env_server.http_server import create_app
    import uvicorn
    from lmforge_toy_openenv import GuessAction, GuessEnv, GuessObservation

    app = create_app(GuessEnv, GuessAction, GuessObservation, max_concurrent_envs=32)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@needs_openenv
def test_grpo_trains_on_an_openenv_server_one_session_per_episode(tmp_path, monkeypatch, guess_server):
    engine = GuessEngine(ByteTokenizer())
    monkeypatch.setattr(source_module, "make_engine", lambda rt, g, **kw: engine)
    rc = lmforge_in_process("grpo", *_grpo_args(tmp_path), f"--grpo.environment=openenv:{guess_server}",
                            "--grpo.max_turns=2", "--grpo.max_new_tokens=8", "--grpo.max_total_tokens=200",
                            cwd=tmp_path)
    assert rc == 0 and engine.turns == 2
    train = [r for r in read_records(tmp_path / "run") if r["kind"] == "train"]
    assert train[0]["reward/environment"] == pytest.approx(-0.6)  # as in-process: the same game, served


@needs_openenv
def test_an_unreachable_openenv_server_is_one_line():
    with pytest.raises(UserError, match=r"cannot read the server's /schema \(URLError"):
        environment_class(f"openenv:http://127.0.0.1:{_free_port()}")
