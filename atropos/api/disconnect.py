"""Stop waiting for a client that has gone: a request's work raced against its disconnect."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request

from atropos.errors import AtroposSandboxError

T = TypeVar("T")


class ClientGone(AtroposSandboxError):
    """The client disconnected before the answer was ready; the work was cancelled."""


async def _disconnected(request: Request) -> None:
    # The body was read whole before the handler ran: what receive() yields next is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T],
                              undo: Callable[[T], Awaitable[object]] | None = None) -> T:
    """``work``'s result, or ClientGone once the client disconnected: ``work`` is then cancelled
    (whatever it acquired while being cancelled it gives back itself, as the pool does with a slot
    granted in that instant), and a result that was ready in the same instant goes to ``undo``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (watcher, task):
            if not pending.done():
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
    if watcher.done() and not watcher.cancelled():
        if undo is not None and not task.cancelled() and task.exception() is None:
            await undo(task.result())
        raise ClientGone("the client disconnected")
    return task.result()
