"""``verifiers`` tasksets as GRPO environments: ``grpo.environment = "verifiers:ID"``.

`verifiers <https://github.com/PrimeIntellect-ai/verifiers>`_ 0.4 (``verifiers.v1``) splits an environment
into a *taskset* (an installed package exporting a ``vf.Taskset`` whose ``load()`` yields ``vf.Task``s: the
prompt in ``task.data``, the scoring in the task's ``@vf.reward`` methods, weighted; tools in its
``vf.Toolset``s) and a *harness* (the agent program that talks to the model, run in a runtime: a
subprocess, Docker, a Prime sandbox). Here lmforge plays the harness: the taskset's tasks are the prompt
records, and the policy answers each through lmforge's episodes (its tokens kept as sampled, the loss on
them alone): in one turn for a task without tools, in tool turns for a task with toolsets (hosted in this
process for each episode, :mod:`.verifiers_tools`). The task then scores a ``vf.Trace`` of that
conversation with its own reward functions (``async``, awaited on an event loop of the adapter's); the
trace's weighted total (``trace.reward``) is the reward.

Refused at start-up, with one line naming what the taskset needs (:func:`load_taskset`): a taskset that
reaches for the network while loading or scoring (a dataset download, a judge model behind an API: the
load, the first task's toolsets and one scoring of it run under
:func:`~lmforge.rl.environments.offline.no_network`), judges (``task.config.judges``: a model called
through an API client), reward functions that read a runtime (a sandbox lmforge does not start), tasks
that need a container, toolsets configured to run elsewhere (a URL, a container), and tasksets that bring
their own harness or ``Env``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
from typing import Any, ClassVar, Mapping, Sequence

from lmforge.data.chat import ChatFormat
from lmforge.errors import UserError
from lmforge.rl.environments.base import Conversation, Message, ToolEnvironment, TurnOutcome, tool_style_for
from lmforge.rl.environments.offline import NetworkUse, no_network
from lmforge.rl.environments.verifiers_tools import HostedToolsets, check_toolsets, toolsets_for

__all__ = ["PREFIX", "MAX_TASKS", "VerifiersEnv", "VerifiersEpisode", "verifiers_environment_class", "load_taskset",
           "load_tasks", "score_conversation", "score_reply", "task_messages"]

PREFIX = "verifiers:"
MAX_TASKS = 100_000
"""Tasks read from an infinite taskset (``Taskset.INFINITE``): the first this many."""

INSTALL = "pip install 'lmforge[envs]' (or pip install verifiers)"


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise UserError(f"grpo.environment=verifiers:...: needs the verifiers package ({INSTALL}; "
                        f"import failed: {e})") from None
    return vf


def _one_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:300]}" if lines else type(e).__name__


def _needs_runtime(fn: Any) -> bool:
    """verifiers' own rule (``Task.score``): a ``runtime`` parameter without a default needs a runtime."""
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def task_messages(task: Any) -> list[Any]:
    """The task's opening messages as verifiers messages: its system prompt, then its prompt."""
    vf = _vf()
    data = task.data
    prompt = data.prompt
    messages = [vf.UserMessage(content=prompt)] if isinstance(prompt, str) else list(prompt or [])
    if data.system_prompt is not None and not any(m.role == "system" for m in messages):
        messages.insert(0, vf.SystemMessage(content=data.system_prompt))
    return messages


async def _score(task: Any, conversation: Sequence[Any]) -> Any:
    vf = _vf()
    from verifiers.v1.state import state_cls

    nodes = [vf.MessageNode(parent=i - 1 if i else None, message=m, sampled=m.role == "assistant")
             for i, m in enumerate(conversation)]
    trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                     agent=vf.AgentInfo(config=vf.AgentConfig(), name="lmforge"), state=state_cls(type(task))(),
                     nodes=nodes, is_completed=True, ok=True, stop_condition="completed")
    await task.score(trace)
    return trace


def score_conversation(task: Any, turns: Sequence[Any], runner: asyncio.Runner | None = None) -> float:
    """The task's weighted reward for the policy's ``turns`` (verifiers messages: assistant turns, tool
    results) after its prompt: its ``@vf.reward`` functions on that trace, awaited; a function that returned
    None (not scored) adds nothing, as in verifiers."""
    coro = _score(task, [*task_messages(task), *turns])
    trace = runner.run(coro) if runner is not None else asyncio.run(coro)
    return float(trace.reward)


def score_reply(task: Any, reply: str, runner: asyncio.Runner | None = None) -> float:
    """The task's reward for a one-turn answer ``reply`` (:func:`score_conversation`)."""
    return score_conversation(task, [_vf().AssistantMessage(content=reply)], runner)


def _check_task(taskset_id: str, taskset: Any, task: Any) -> None:
    """What lmforge cannot run, named in one line (module docstring)."""
    where = f"grpo.environment=verifiers:{taskset_id}"
    cls = type(task)
    if getattr(cls, "NEEDS_CONTAINER", False):
        raise UserError(f"{where}: its tasks ({cls.__name__}) need a container runtime (Docker or a sandbox), "
                        "which lmforge does not start")
    judges = list(getattr(task.config, "judges", []) or [])
    if judges:
        names = ", ".join(getattr(j, "id", None) or type(j).__name__ for j in judges)
        raise UserError(f"{where}: its tasks are scored by judges ({names}), which call a model through an API "
                        "client: that needs the network and an API key, which lmforge does not give an environment")
    why = check_toolsets(toolsets_for(task, taskset))
    if why:
        raise UserError(f"{where}: {why}; lmforge hosts toolsets in its own process only")
    rewards = task.hooks("reward")
    if not rewards and not judges:
        raise UserError(f"{where}: its tasks ({cls.__name__}) have no @vf.reward function, so no reward")
    runtime = [fn.__name__ for fn in [*rewards, *task.hooks("metric")] if _needs_runtime(fn)]
    if runtime:
        raise UserError(f"{where}: its reward or metric functions ({', '.join(runtime)}) read the task's runtime "
                        "(a sandbox the harness runs in), which lmforge does not start")


@functools.lru_cache(maxsize=8)
def load_taskset(taskset_id: str) -> tuple[Any, tuple[Any, ...]]:
    """The taskset and its tasks, loaded once per process and checked (module docstring: what is refused)."""
    vf = _vf()
    where = f"grpo.environment=verifiers:{taskset_id}"
    if not taskset_id:
        raise UserError(f"{where}: name an installed taskset (verifiers:ID, the id of its package)")
    with no_network() as net:
        try:
            env_cls = vf.environment_class(taskset_id)
            if env_cls is not vf.SingleAgentEnv:
                raise UserError(f"{where}: it exports its own Env ({env_cls.__name__}), which lmforge does not run "
                                "(a taskset with the default single-agent env runs)")
            if vf.default_harness_id(taskset_id) == taskset_id:
                raise UserError(f"{where}: it brings its own harness (an agent program), which lmforge does not run")
            taskset = vf.load_taskset(vf.taskset_config_type(taskset_id)(id=taskset_id))
            tasks = tuple(taskset if taskset.bounded else taskset.take(MAX_TASKS))
            if not tasks:
                raise UserError(f"{where}: its taskset yielded no tasks")
            for task in {type(t): t for t in tasks}.values():  # one task of each class
                _check_task(taskset_id, taskset, task)
            # The start-up probe: the first task's tools hosted, and an empty reply (which a model can write) scored.
            toolsets = toolsets_for(tasks[0], taskset)
            if toolsets:
                with asyncio.Runner() as runner:
                    HostedToolsets(toolsets, tasks[0], runner).close()
            score_reply(tasks[0], "")
        except UserError:
            raise
        except NetworkUse:
            pass  # named below
        except Exception as e:  # noqa: BLE001 - a third-party package failing however it likes
            if net.first is None:
                raise UserError(f"{where}: cannot load it ({_one_line(e)})") from None
    if net.first is not None:
        raise UserError(f"{where}: it needs the network (it connected to {net.first} while loading its tasks or "
                        "scoring one: a dataset download, a judge or another API), which lmforge does not give "
                        "an environment")
    return taskset, tasks


def load_tasks(taskset_id: str) -> tuple[Any, ...]:
    """The taskset's tasks (:func:`load_taskset`)."""
    return load_taskset(taskset_id)[1]


class VerifiersEnv:
    """The adapter, shared by a run: the taskset, the chat format's tool style, the event loop that scoring and
    tools run on. Built by :func:`verifiers_environment_class`, which binds the taskset; each episode is
    played by :meth:`for_episode` (its own toolset instances)."""

    taskset_id: ClassVar[str] = ""

    def __init__(self, chat: ChatFormat, max_turns: int = 1, **_: Any) -> None:
        self.taskset, self.tasks = load_taskset(self.taskset_id)
        self.chat = chat
        self.max_turns = max_turns
        self.style = tool_style_for(chat)
        self.runner = asyncio.Runner()
        """One event loop for the run's scoring and tool calls (verifiers' functions are async)."""

    @classmethod
    def embedded_records(cls, split: str) -> list[dict[str, Any]]:
        """Every task as a prompt record when training (``vf_task`` its position, ``answer`` the task data's
        when it has one); verifiers tasksets have no held-out split of their own, so none for evaluation."""
        if split != "train":
            return []
        records = []
        for i, t in enumerate(load_tasks(cls.taskset_id)):
            record: dict[str, Any] = {"prompt": [_as_dict(m) for m in task_messages(t)], "vf_task": i}
            answer = getattr(t.data, "answer", None)
            if isinstance(answer, (str, int, float)) and not isinstance(answer, bool):
                record["answer"] = answer  # for rewards named in grpo.rewards as well
            records.append(record)
        return records

    @classmethod
    def check_records(cls, records: list[dict[str, Any]]) -> None:
        """The prompts are the taskset's: records from a file (``data.train``) name no task."""
        n = len(load_tasks(cls.taskset_id))
        for k, r in enumerate(records, start=1):
            i = r.get("vf_task")
            if not isinstance(i, int) or not 0 <= i < n:
                raise UserError(f"grpo.environment=verifiers:{cls.taskset_id}: prompt record {k} is not one of the "
                                "taskset's tasks; its prompts come from the taskset: leave data.train = embedded")

    def for_episode(self) -> "VerifiersEpisode":
        return VerifiersEpisode(self)


class VerifiersEpisode(ToolEnvironment):
    """One episode on one task: one turn for a task without tools; with tools, lmforge's tool turns on the
    task's toolsets, hosted for this episode (:mod:`.verifiers_tools`). The turns are kept as verifiers
    messages (assistant turns with their ``tool_calls``, ``tool`` results) for the task's scoring."""

    def __init__(self, adapter: VerifiersEnv) -> None:
        super().__init__(adapter.chat, {}, adapter.max_turns, adapter.style)
        self.adapter = adapter
        self.where = f"grpo.environment=verifiers:{adapter.taskset_id}"
        self.task: Any = None
        self.hosted: HostedToolsets | None = None
        self.turns: list[Any] = []
        self._called: list[tuple[Any, str]] = []

    def task_messages(self, record: Mapping[str, Any]) -> tuple[str | None, list[Message]]:
        messages = [_as_dict(m) for m in task_messages(self.task)]
        if messages and messages[0]["role"] == "system":
            return messages[0]["content"], messages[1:]
        return None, messages

    def start(self, record: Mapping[str, Any]) -> Conversation:
        self.task = self.adapter.tasks[record["vf_task"]]
        toolsets = toolsets_for(self.task, self.adapter.taskset)
        if toolsets:
            try:
                self.hosted = HostedToolsets(toolsets, self.task, self.adapter.runner)
            except Exception as e:  # noqa: BLE001 - the taskset's own code: one line
                raise UserError(f"{self.where}: setting up its toolsets failed ({_one_line(e)})") from None
            self.schemas = [schema for schema, _ in self.hosted.tools.values()]
            self.tools = {name: fn for name, (_, fn) in self.hosted.tools.items()}
            return super().start(record)
        system, messages = self.task_messages(record)
        if system is None:
            return Conversation(messages)
        if self.style.system_message:
            return Conversation([{"role": "system", "content": system}, *messages])
        first = next(i for i, m in enumerate(messages) if m["role"] == "user")
        messages[first] = {**messages[first], "content": f"{system}\n\n{messages[first]['content']}"}
        return Conversation(messages)

    def run_tool(self, call: Any) -> str:
        result = super().run_tool(call)
        self._called.append((call, result))
        return result

    def step(self, record: Mapping[str, Any], messages: Sequence[Message], text: str,
             execute: bool = True) -> TurnOutcome:
        if not self.tools:  # a task without tools: the first answer is the answer
            return TurnOutcome({"role": "assistant", "content": text}, done=True)
        self._called = []
        outcome = super().step(record, messages, text, execute)
        if not outcome.done:  # the answer itself joins the trace in reward()
            vf = _vf()
            n = len(self.turns)
            calls = [vf.ToolCall(id=f"call_{n}_{k}", name=c.name, arguments=json.dumps(c.arguments))
                     for k, (c, _) in enumerate(self._called)]
            self.turns.append(vf.AssistantMessage(content=self.parse(text).content or None, tool_calls=calls or None))
            self.turns += [vf.ToolMessage(tool_call_id=tc.id, name=tc.name, content=result)
                           for tc, (_, result) in zip(calls, self._called)]
        return outcome

    def reward(self, record: Mapping[str, Any], final_text: str | None) -> float:
        if self.hosted is not None:
            self.hosted.close()
        if final_text is None:
            return 0.0
        try:
            return score_conversation(self.task, [*self.turns, _vf().AssistantMessage(content=final_text)],
                                      self.adapter.runner)
        except Exception as e:  # noqa: BLE001 - the taskset's scoring: one line, not a traceback
            raise UserError(f"{self.where}: scoring task {record['vf_task']} failed ({_one_line(e)})") from None


def _as_dict(message: Any) -> Message:
    from verifiers.v1.types import content_text

    return {"role": message.role, "content": content_text(message.content)}


@functools.lru_cache(maxsize=8)
def verifiers_environment_class(name: str) -> type[VerifiersEnv]:
    """``verifiers:ID`` -> an environment class bound to that taskset, its tasks loaded and checked now (before
    any work), so every refusal is a start-up error."""
    taskset_id = name[len(PREFIX):]
    load_tasks(taskset_id)
    return type(f"VerifiersEnv[{taskset_id}]", (VerifiersEnv,), {"taskset_id": taskset_id})
