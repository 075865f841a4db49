"""OpenEnv environments as GRPO environments: ``grpo.environment = "openenv:module:Class"``.

An `OpenEnv <https://github.com/meta-pytorch/OpenEnv>`_ environment (``openenv-core``) is a class deriving
``openenv.core.env_server.Environment``, Gym-style: ``reset(seed=...)`` gives an ``Observation``,
``step(action)`` takes an ``Action`` and gives the next one, with its ``reward`` and ``done``. OpenEnv
serves such a class over HTTP/WebSocket from a Docker image; the class itself runs in any process, and
lmforge runs it in the trainer's: one instance per episode (``Class()``, as OpenEnv's server builds one per
session), no container, no server.

An episode: the reset observation is the first user message; each policy turn becomes an action (the reply's
text in the action's one text field) and is stepped; the observation that comes back is the next user
message, until the environment says ``done`` or ``grpo.max_turns`` turns are spent (the last turn is stepped
too: its action may be what earns the reward). The reward is the episode's return, the sum of its steps'
``reward`` (None counts 0), also for an episode cut off by a limit. Prompt records are reset seeds:
``0 .. PROMPTS-1`` when ``reset`` takes a seed (a group of episodes shares its seed, so its start), else one.

How an observation reads: the text of its one text field when it has one besides ``done``, ``reward`` and
``metadata``; otherwise those fields as JSON. Refused at start-up with one line: a class that is not an
OpenEnv ``Environment``, an action that is not one text field, and an environment that reaches for the
network while it is built, reset or stepped once (:mod:`.offline`).
"""

from __future__ import annotations

import importlib
import inspect
import json
import typing
from typing import Any, ClassVar, Mapping, Sequence

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
    """What the policy reads of an observation (module docstring)."""
    fields = {k: v for k, v in obs.model_dump().items() if k not in _SKIPPED}
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
    if target.split("://")[0] in ("http", "https", "ws", "wss"):
        raise UserError(f"{where}: OpenEnv servers (a URL) are not supported yet, only an Environment class run "
                        "in-process: openenv:module:Class (docs/environments.md)")
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise UserError(f"{where}: expected openenv:module:Class (an OpenEnv Environment class, run in-process)")
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


class OpenEnvEnv:
    """The adapter, shared by a run; :meth:`for_episode` gives each episode its own environment instance."""

    env_class: ClassVar[type]
    name: ClassVar[str] = ""
    prompts: ClassVar[list[dict[str, Any]]] = []

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
    """One episode on one instance of the environment class."""

    def __init__(self, adapter: OpenEnvEnv) -> None:
        self.adapter = adapter
        self.max_turns = adapter.max_turns
        self.env = adapter.env_class()
        self.action_cls = _action_class(adapter.env_class)
        self.field = action_field(self.action_cls)
        self.rewards: list[float] = []

    def start(self, record: Mapping[str, Any]) -> Conversation:
        seed = record.get("openenv_seed")
        obs = self.env.reset(seed=seed) if seed is not None else self.env.reset()
        return Conversation([{"role": "user", "content": observation_text(obs)}])

    def step(self, record: Mapping[str, Any], messages: Sequence[Message], text: str,
             execute: bool = True) -> TurnOutcome:
        # Stepped even when ``execute`` is False (the last allowed turn): the action itself may earn the reward.
        try:
            obs = self.env.step(self.action_cls(**{self.field: text}))
        except Exception as e:  # noqa: BLE001 - the environment's own failure stops the run in one line
            raise UserError(f"grpo.environment={self.adapter.name}: step failed ({_one_line(e)})") from None
        self.rewards.append(float(obs.reward or 0.0))
        assistant = {"role": "assistant", "content": text}
        if obs.done:
            return TurnOutcome(assistant, done=True)
        return TurnOutcome(assistant, [{"role": "user", "content": observation_text(obs)}])

    def reward(self, record: Mapping[str, Any], final_text: str | None) -> float:
        self.env.close()
        return sum(self.rewards)


def _prompt_records(cls: type) -> list[dict[str, Any]]:
    """The prompt records, from real resets (also the start-up check that the class runs)."""
    seeds = list(range(PROMPTS)) if _takes_seed(cls) else [None]
    records = []
    for seed in seeds:
        env = cls()
        obs = env.reset(seed=seed) if seed is not None else env.reset()
        records.append({"prompt": observation_text(obs), "openenv_seed": seed})
        env.close()
    return records


def _probe_step(cls: type) -> None:
    env = cls()
    env.reset()
    action_cls = _action_class(cls)
    env.step(action_cls(**{action_field(action_cls): ""}))  # an empty reply, which a model can write
    env.close()


_CLASSES: dict[str, type[OpenEnvEnv]] = {}


def openenv_environment_class(name: str) -> type[OpenEnvEnv]:
    """``openenv:module:Class`` -> an adapter class bound to it, checked now (reset for every prompt record,
    one step with an empty reply, all without the network)."""
    if name in _CLASSES:
        return _CLASSES[name]
    with no_network() as net:
        try:
            cls = _load_class(name)
            prompts = _prompt_records(cls)
            _probe_step(cls)
        except UserError:
            raise
        except NetworkUse:
            pass
        except Exception as e:  # noqa: BLE001 - a third-party environment failing however it likes
            if net.first is None:
                raise UserError(f"grpo.environment={name}: resetting or stepping it failed ({_one_line(e)})") from None
    if net.first is not None:
        raise UserError(f"grpo.environment={name}: it needs the network (it connected to {net.first} while being "
                        "built, reset or stepped), which lmforge does not give an environment")
    _CLASSES[name] = type(f"OpenEnvEnv[{name}]", (OpenEnvEnv,), {"env_class": cls, "name": name, "prompts": prompts})
    return _CLASSES[name]
