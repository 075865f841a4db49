"""A verifiers taskset's tools in lmforge's tool turns: its toolsets hosted in the trainer's process.

verifiers 0.4 gives a task tools through *toolsets* (``vf.Toolset`` subclasses with ``@vf.tool`` methods,
from ``Task.toolsets`` per rollout and ``Taskset.toolsets`` shared), each run as an MCP server in a runtime
(by default a local subprocess) and called by the harness through an MCP client. lmforge hosts each toolset
the way verifiers' server does (``setup()``, ``setup_task(task)`` for a task's own, ``register()`` on an
``MCPServer``) but in this process, without a transport: the tools are listed and called on the
``MCPServer`` object directly. Every episode gets fresh instances of every toolset, so the state a toolset
keeps belongs to one episode (verifiers gives each rollout its own state through a state channel).

Tools keep the names verifiers gives the model (``<server>_<tool>``: the toolset's snake-cased class name
or its ``TOOL_PREFIX``) and their MCP input schemas. A toolset configured to run elsewhere (a ``url``, a
container runtime) is refused by :func:`check_toolsets`.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

from lmforge.rl.environments.base import Tool

__all__ = ["HostedToolsets", "check_toolsets", "toolsets_for"]


def toolsets_for(task: Any, taskset: Any) -> list[tuple[Any, bool]]:
    """Fresh instances of the task's toolsets and the taskset's, each with whether it is the task's own."""
    return ([(t, True) for t in type(task).toolsets(task.config)]
            + [(t, False) for t in type(taskset).toolsets(taskset.config)])


def check_toolsets(toolsets: list[tuple[Any, bool]]) -> str | None:
    """Why these toolsets cannot be hosted in-process (None when they can)."""
    from verifiers.v1 import SubprocessConfig

    for toolset, _ in toolsets:
        config = getattr(toolset, "config", None)
        if getattr(config, "url", None):
            return f"its toolset {type(toolset).__name__} is a remote server ({config.url})"
        runtime = getattr(config, "runtime", None)
        if runtime is not None and not isinstance(runtime, SubprocessConfig):
            return f"its toolset {type(toolset).__name__} runs in a {type(runtime).__name__} runtime (a container or sandbox)"
    return None


def _result_text(result: Any) -> str:
    """An MCP tool result as the text the model reads (``error: ...`` when the tool reported an error)."""
    parts = [getattr(b, "text", None) if getattr(b, "type", "") == "text" else str(b) for b in result.content]
    text = "\n".join(p for p in parts if p is not None)
    if not text and getattr(result, "structured_content", None) is not None:
        text = json.dumps(result.structured_content, ensure_ascii=False, default=str)
    return f"error: {text}" if getattr(result, "is_error", False) else text


class HostedToolsets:
    """One episode's toolsets, set up for its task; :attr:`tools` is the name -> (schema, tool) mapping a
    :class:`~lmforge.rl.environments.base.ToolEnvironment` takes."""

    def __init__(self, toolsets: list[tuple[Any, bool]], task: Any, runner: asyncio.Runner) -> None:
        self.runner = runner
        self.toolsets = [t for t, _ in toolsets]
        self.tools: dict[str, tuple[dict[str, Any], Tool]] = {}
        runner.run(self._start(toolsets, task))

    async def _start(self, toolsets: list[tuple[Any, bool]], task: Any) -> None:
        from mcp.server.mcpserver import MCPServer

        for toolset, own in toolsets:
            await toolset.setup()
            if own:  # verifiers: "taskset-scoped servers skip this hook"
                await toolset.setup_task(task)
            prefix = toolset.server_name
            server = MCPServer(prefix or type(toolset).__name__)
            toolset.register(server)
            for tool in await server.list_tools():
                name = f"{prefix}_{tool.name}" if prefix else tool.name
                if name in self.tools:
                    raise ValueError(f"two toolsets give a tool named {name!r}")
                schema = {"type": "function", "function": {"name": name, "description": tool.description or "",
                                                           "parameters": tool.input_schema}}
                self.tools[name] = (schema, functools.partial(self._call, server, tool.name))

    def _call(self, server: Any, name: str, arguments: dict[str, Any]) -> str:
        return _result_text(self.runner.run(server.call_tool(name, arguments)))

    def close(self) -> None:
        """Run what the toolsets' setup left to clean up (their exit stacks, as their server would)."""
        async def close_all() -> None:
            for toolset in self.toolsets:
                stack = getattr(toolset, "_exit_stack", None)
                if stack is not None:
                    await stack.aclose()

        self.runner.run(close_all())
