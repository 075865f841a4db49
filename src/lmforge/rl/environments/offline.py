"""Catch a third-party environment reaching for the network while it loads or scores, before a run starts.

An environment package may download its dataset or score with a judge model behind an API. lmforge runs
such packages in the trainer's process, and a run should not stall, fail at step 1 or spend money on an API
the user did not name; so the adapters load the tasks and score one of them inside :func:`no_network`, and a
connection attempt refuses the environment with one line naming where it tried to connect.

The guard replaces ``socket.socket.connect``/``connect_ex`` (IP sockets only: a Unix socket is not the
network) and ``socket.getaddrinfo`` for the duration of the block. What it raises is a ``BaseException``, so a
library's ``except Exception`` fallback cannot hide the attempt; attempts from other threads are recorded too.
"""

from __future__ import annotations

import socket
import threading
from contextlib import contextmanager
from typing import Any, Iterator

__all__ = ["NetworkUse", "no_network"]


class NetworkUse(BaseException):
    """Raised where code under :func:`no_network` opens a connection or resolves a name."""


class _Attempts:
    def __init__(self) -> None:
        self.first: str | None = None

    def note(self, where: str) -> None:
        if self.first is None:
            self.first = where


_lock = threading.Lock()


def _target(address: Any) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        host = address[0].decode(errors="replace") if isinstance(address[0], bytes) else address[0]
        return f"{host}:{address[1]}"
    return str(address)


@contextmanager
def no_network() -> Iterator[_Attempts]:
    """A block in which IP connections and name lookups raise :class:`NetworkUse`; the yielded object's
    ``first`` names the first attempt (``host:port``), None when there was none."""
    attempts = _Attempts()
    sock = socket.socket
    real_connect, real_connect_ex, real_getaddrinfo = sock.connect, sock.connect_ex, socket.getaddrinfo

    def refuse(where: str) -> NetworkUse:
        attempts.note(where)
        return NetworkUse(f"network use under lmforge's start-up check: {where}")

    def connect(self: socket.socket, address: Any) -> Any:
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise refuse(_target(address))
        return real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> Any:
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise refuse(_target(address))
        return real_connect_ex(self, address)

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        raise refuse(_target((host, port)))

    with _lock:
        sock.connect, sock.connect_ex, socket.getaddrinfo = connect, connect_ex, getaddrinfo  # type: ignore
        try:
            yield attempts
        finally:
            sock.connect, sock.connect_ex, socket.getaddrinfo = real_connect, real_connect_ex, real_getaddrinfo  # type: ignore
