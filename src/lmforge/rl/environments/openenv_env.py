"""OpenEnv environments as GRPO environments: ``grpo.environment = "openenv:module:Class"`` or
``"openenv:http://HOST:PORT"``.

An `OpenEnv <https://github.com/meta-pytorch/OpenEnv>`_ environment (``openenv-core``) is a class deriving
``openenv.core.env_server.Environment``, Gym-style: ``reset(seed=...)`` gives an ``Observation``,
``step(action)`` takes an ``Action`` and gives the next one, with its ``reward`` and ``done``. OpenEnv
serves such a class over WebSocket (``create_app``; its Docker images run that server). lmforge takes it
either way: ``openenv:module:Class`` runs the class in the trainer's process, one instance per episode
(``Class()``, as OpenEnv's server builds one per session), no container, no server; ``openenv:URL`` opens
one session of a running server per episode, through openenv's ``GenericEnvClient``.

An episode: the reset observation is the first user message; each policy turn becomes an action (the reply's
text in the action's one text field) and is stepped; the observation that comes back is the next user
message, until the environment says ``done`` or ``grpo.max_turns`` turns are spent (the last turn is stepped
too: its action may be what earns the reward). The reward is the episode's return, the sum of its steps'
``reward`` (None counts 0), also for an episode cut off by a limit. Prompt records are reset seeds:
``0 .. PROMPTS-1`` (one, unseeded, for a class whose ``reset`` takes no seed); a group of episodes shares
its seed, so its start.

How an observation reads: the text of its one text field when it has one besides ``done``, ``reward`` and
``metadata``; otherwise those fields as JSON. Refused at start-up with one line: a class that is not an
OpenEnv ``Environment``, an action that is not one text field (a server's from its ``/schema``), a server
that cannot be reached, and an in-process class that reaches for the network while it is built, reset or
stepped once (:mod:`.offline`).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import json
import typing
import urllib.request
from typing import Any, Callable, ClassVar, Mapping, Sequence

from lmforge.data.chat import ChatFormat
from lmforge.errors import UserError
from lmforge.rl.environments.base import Conversation, Message, TurnOutcome
from lmforge.rl.environments.offline import NetworkUse, no_network

__all__ = ["PREFIX", "PROMPTS", "OpenEnvEnv", "openenv_environment_class", "observation_text", "action_field"]

PREFIX = "openenv:"
PROMPTS = 64
"""Reset seeds used as prompt records (when ``reset`` takes a seed)."""

INSTALL = "pip install 'lmforge[envs]' (or pip install openenv-core)"
_SKIPPED = {"done", "reward", "metadata"}


def _one_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:300]}" if lines else type(e).__name__


def observation_text(obs: Any) -> str:
    """What the policy reads of an observation (module docstring): an ``Observation``, or a server's dict."""
    fields = {k: v for k, v in (obs.model_dump() if hasattr(obs, "model_dump") else dict(obs)).items()
              if k not in _SKIPPED}
    text = [v for v in fields.values() if isinstance(v, str)]
    if len(fields) == 1 and len(text) == 1:
        return text[0]
    return json.dumps(fields, ensure_ascii=False, default=str)


def _action_class(cls: type) -> Any:
    """The action type ``cls.step`` takes: its annotation, else the ``Environment[Action, ...]`` parameter."""
    try:
        hint = typing.get_type_hints(cls.step).get("action")
    except Exception:  # noqa: BLE001 - unresolvable annotations: try the generic base
        hint = None
    if isinstance(hint, type):
        return hint
    for base in getattr(cls, "__orig_bases__", ()):
        args = typing.get_args(base)
        if args and isinstance(args[0], type):
            return args[0]
    return None


def action_field(action_cls: type) -> str | None:
    """The action's one text field (``metadata`` aside), or None when it has another shape."""
    fields = {k: f for k, f in action_cls.model_fields.items() if k != "metadata"}
    if len(fields) != 1:
        return None
    name, field = next(iter(fields.items()))
    return name if field.annotation is str else None


def _takes_seed(cls: type) -> bool:
    params = inspect.signature(cls.reset).parameters
    return "seed" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _load_class(name: str) -> type:
    where = f"grpo.environment={name}"
    target = name[len(PREFIX):]
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise UserError(f"{where}: expected openenv:module:Class (an OpenEnv Environment class, run in-process) "
                        "or openenv:http://HOST:PORT (a server)")
    try:
        from openenv.core.env_server import Environment
    except ImportError as e:
        raise UserError(f"{where}: needs the openenv-core package ({INSTALL}; import failed: {e})") from None
    try:
        cls = getattr(importlib.import_module(module), attr)
    except Exception as e:  # noqa: BLE001 - a user's module may fail however it likes on import
        raise UserError(f"{where}: cannot load it ({_one_line(e)})") from None
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise UserError(f"{where}: {attr} is not an OpenEnv Environment (openenv.core.env_server.Environment)")
    action = _action_class(cls)
    if action is None:
        raise UserError(f"{where}: cannot tell its action type (annotate step(self, action: MyAction))")
    if action_field(action) is None:
        fields = ", ".join(k for k in action.model_fields if k != "metadata") or "none"
        raise UserError(f"{where}: its action {action.__name__} has the fields {fields}; lmforge writes the policy's "
                        "reply into an action with one text (str) field")
    return cls


class _LocalSession:
    """An instance of the environment class, stepped in this process."""

    def __init__(self, cls: type) -> None:
        self.env = cls()
        self.action_cls = _action_class(cls)
        self.field = action_field(self.action_cls)

    def reset(self, seed: int | None) -> tuple[str, float, bool]:
        obs = self.env.reset(seed=seed) if seed is not None else self.env.reset()
        return observation_text(obs), float(obs.reward or 0.0), bool(obs.done)

    def step(self, text: str) -> tuple[str, float, bool]:
        obs = self.env.step(self.action_cls(**{self.field: text}))
        return observation_text(obs), float(obs.reward or 0.0), bool(obs.done)

    def close(self) -> None:
        self.env.close()


class _RemoteSession:
    """A session (a WebSocket) of an OpenEnv server, through openenv's own ``GenericEnvClient``; its calls run
    on the adapter's one event loop, so a run's many sessions need no thread each."""

    def __init__(self, url: str, field: str, runner: asyncio.Runner) -> None:
        from openenv.core.generic_client import GenericEnvClient

        self.client, self.field, self.runner = GenericEnvClient(base_url=url), field, runner

    def _result(self, r: Any) -> tuple[str, float, bool]:
        return observation_text(r.observation), float(r.reward or 0.0), bool(r.done)

    def reset(self, seed: int | None) -> tuple[str, float, bool]:
        return self._result(self.runner.run(self.client.reset(**({} if seed is None else {"seed": seed}))))

    def step(self, text: str) -> tuple[str, float, bool]:
        return self._result(self.runner.run(self.client.step({self.field: text})))

    def close(self) -> None:
        self.runner.run(self.client.close())


class OpenEnvEnv:
    """The adapter, shared by a run; :meth:`for_episode` gives each episode a session of its own (an instance of
    the class, or a server session)."""

    name: ClassVar[str] = ""
    prompts: ClassVar[list[dict[str, Any]]] = []
    open_session: ClassVar[Callable[[], Any]]

    def __init__(self, chat: ChatFormat, max_turns: int = 4, **_: Any) -> None:
        self.max_turns = max_turns

    @classmethod
    def embedded_records(cls, split: str) -> list[dict[str, Any]]:
        """The reset seeds as prompt records (``prompt`` the reset observation's text) when training."""
        return [dict(r) for r in cls.prompts] if split == "train" else []

    @classmethod
    def check_records(cls, records: list[dict[str, Any]]) -> None:
        for k, r in enumerate(records, start=1):
            if "openenv_seed" not in r:
                raise UserError(f"grpo.environment={cls.name}: prompt record {k} is not a reset seed of the "
                                "environment; its prompts are its own: leave data.train = embedded")

    def for_episode(self) -> "OpenEnvEpisode":
        return OpenEnvEpisode(self)


class OpenEnvEpisode:
    """One episode on one session."""

    def __init__(self, adapter: OpenEnvEnv) -> None:
        self.adapter = adapter
        self.max_turns = adapter.max_turns
        self.session: Any = None
        self.rewards: list[float] = []

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - the environment's own failure stops the run in one line
            raise UserError(f"grpo.environment={self.adapter.name}: {what} failed ({_one_line(e)})") from None

    def start(self, record: Mapping[str, Any]) -> Conversation:
        self.session = self._call("starting a session", type(self.adapter).open_session)
        text, _, _ = self._call("reset", lambda: self.session.reset(record.get("openenv_seed")))
        return Conversation([{"role": "user", "content": text}])

    def step(self, record: Mapping[str, Any], messages: Sequence[Message], text: str,
             execute: bool = True) -> TurnOutcome:
        # Stepped even when ``execute`` is False (the last allowed turn): the action itself may earn the reward.
        seen, reward, done = self._call("step", lambda: self.session.step(text))
        self.rewards.append(reward)
        assistant = {"role": "assistant", "content": text}
        if done:
            return TurnOutcome(assistant, done=True)
        return TurnOutcome(assistant, [{"role": "user", "content": seen}])

    def reward(self, record: Mapping[str, Any], final_text: str | None) -> float:
        self._call("closing the session", self.session.close)
        return sum(self.rewards)


def _check_session(session: Any, seeds: list[int | None]) -> list[dict[str, Any]]:
    """The prompt records, from real resets, then one step with an empty reply (which a model can write): the
    start-up check that the environment runs."""
    try:
        records = [{"prompt": session.reset(seed)[0], "openenv_seed": seed} for seed in seeds]
        session.reset(seeds[0])
        session.step("")
    finally:
        session.close()
    return records


_CLASSES: dict[str, type[OpenEnvEnv]] = {}


def _bound(name: str, prompts: list[dict[str, Any]], open_session: Callable[[], Any]) -> type[OpenEnvEnv]:
    _CLASSES[name] = type(f"OpenEnvEnv[{name}]", (OpenEnvEnv,), {
        "name": name, "prompts": prompts, "open_session": staticmethod(open_session)})
    return _CLASSES[name]


def _server_action_field(name: str, url: str) -> str:
    """The action's one text field, from the server's ``/schema``."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/schema", timeout=10) as r:
            schema = json.loads(r.read())
    except Exception as e:  # noqa: BLE001 - unreachable, not a server, not JSON: one line
        raise UserError(f"grpo.environment={name}: cannot read the server's /schema ({_one_line(e)})") from None
    props = {k: v for k, v in (schema.get("action", {}).get("properties") or {}).items() if k != "metadata"}
    if len(props) != 1 or next(iter(props.values())).get("type") != "string":
        raise UserError(f"grpo.environment={name}: its action has the fields {', '.join(props) or 'none'}; lmforge "
                        "writes the policy's reply into an action with one text (str) field")
    return next(iter(props))


def _server_class(name: str, url: str) -> type[OpenEnvEnv]:
    try:
        import openenv.core.generic_client  # noqa: F401
    except ImportError as e:
        raise UserError(f"grpo.environment={name}: needs the openenv-core package ({INSTALL}; "
                        f"import failed: {e})") from None
    field = _server_action_field(name, url)
    runner = asyncio.Runner()

    def open_session() -> _RemoteSession:
        return _RemoteSession(url, field, runner)

    try:
        prompts = _check_session(open_session(), list(range(PROMPTS)))
    except Exception as e:  # noqa: BLE001 - the server's failure, one line
        raise UserError(f"grpo.environment={name}: resetting or stepping it failed ({_one_line(e)})") from None
    return _bound(name, prompts, open_session)


def openenv_environment_class(name: str) -> type[OpenEnvEnv]:
    """``openenv:module:Class`` or ``openenv:URL`` -> an adapter class bound to it, checked now (a reset for every
    prompt record, one step with an empty reply; an in-process class without the network)."""
    if name in _CLASSES:
        return _CLASSES[name]
    target = name[len(PREFIX):]
    if target.split("://")[0] in ("http", "https", "ws", "wss"):
        return _server_class(name, target)
    with no_network() as net:
        try:
            cls = _load_class(name)
            seeds: list[int | None] = list(range(PROMPTS)) if _takes_seed(cls) else [None]
            prompts = _check_session(_LocalSession(cls), seeds)
        except UserError:
            raise
        except NetworkUse:
            pass
        except Exception as e:  # noqa: BLE001 - a third-party environment failing however it likes
            if net.first is None:
                raise UserError(f"grpo.environment={name}: resetting or stepping it failed ({_one_line(e)})") from None
    if net.first is not None:
        raise UserError(f"grpo.environment={name}: it needs the network (it connected to {net.first} while being "
                        "built, reset or stepped), which lmforge does not give an environment; serve it and name "
                        "its URL (openenv:http://HOST:PORT)")
    return _bound(name, prompts, functools.partial(_LocalSession, cls))
