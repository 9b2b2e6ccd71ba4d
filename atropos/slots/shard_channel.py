"""The wire between a sharded pool's front (shards.py) and one shard process (shard_worker.py).

Frames are a 4-byte big-endian length and a pickle; each frame carries a list of messages, every
message of one turn of the sender's event loop: under load thousands of calls share one write and
one read, so the front pays a few microseconds per call where a pool pays its whole HTTP exchange.
Both ends are this package's own processes (the front spawns the shard as its child over a pipe
only the two hold), so pickle carries nothing it did not write itself.

Errors cross as ``(class name, message, code, status)`` and come back as the same class of
atropos/errors.py (the one error table): a caller of a sharded pool sees what a caller of a
``SlotPool`` sees.
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from collections.abc import Callable
from typing import Any

from atropos import errors
from atropos.errors import AtroposSandboxError, InfrastructureError, ToolError

_LEN = struct.Struct(">I")
MAX_FRAME = 1 << 30

# (request id, op, payload) from the front; (request id, ok, value) back, value an error tuple when not ok
Message = tuple[int, Any, Any]


def encode(messages: list[Message]) -> bytes:
    data = pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader) -> list[Message]:
    """The next frame's messages; IncompleteReadError at the end of the stream."""
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > MAX_FRAME:
        raise ValueError(f"shard frame of {n} bytes")
    messages: list[Message] = pickle.loads(await reader.readexactly(n))
    return messages


class Outbox:
    """Messages queued in one turn of the event loop, written as one frame at the next turn."""

    def __init__(self, write: Callable[[bytes], None]) -> None:
        self._write = write
        self._queued: list[Message] = []
        self._soon: asyncio.Handle | None = None

    def put(self, message: Message) -> None:
        self._queued.append(message)
        if self._soon is None:
            self._soon = asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self._soon = None
        if self._queued:
            queued, self._queued = self._queued, []
            self._write(encode(queued))


def error_tuple(exc: BaseException) -> tuple[str, str, str | None, int | None]:
    """An exception as it crosses: its class name (one of atropos/errors.py, else the platform's
    InfrastructureError) and message, with a ToolError's per-call code and status."""
    if isinstance(exc, AtroposSandboxError):
        code = exc.code if isinstance(exc, ToolError) else None
        status = exc.status if isinstance(exc, ToolError) else None
        return type(exc).__name__, str(exc), code, status
    return InfrastructureError.__name__, f"{type(exc).__name__}: {exc}", None, None


def error_from(value: tuple[str, str, str | None, int | None]) -> AtroposSandboxError:
    """The error a shard raised, as the same class of atropos/errors.py."""
    name, message, code, status = value
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, AtroposSandboxError)):
        return InfrastructureError(f"{name}: {message}")
    if issubclass(cls, ToolError):
        return cls(message, code=code, status=status)
    for klass in cls.__mro__:  # a class with a constructor of its own (NomadAPIError): its nearest base
        if issubclass(klass, AtroposSandboxError):
            try:
                error: AtroposSandboxError = klass(message)
            except TypeError:
                continue
            return error
    raise AssertionError("unreachable: AtroposSandboxError takes a message")
