"""Hold nothing for a client that has gone: a request's work raced against its disconnect, and
an answer that cannot be delivered undone."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request

from atropos.asgi import ASGIApp, Receive, Send
from atropos.errors import ClientGone

T = TypeVar("T")


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


async def gone(receive: Receive) -> bool:
    """Whether the client has disconnected, without waiting: the server has already seen it go."""
    probe = asyncio.ensure_future(receive())
    await asyncio.sleep(0)  # one step: a server that saw the disconnect answers at once
    if not probe.done():
        probe.cancel()
        await asyncio.gather(probe, return_exceptions=True)
        return False
    return not probe.cancelled() and probe.exception() is None and probe.result()["type"] == "http.disconnect"


def release_undelivered(app: ASGIApp, undo: Callable[[dict[str, Any]], Awaitable[object]]) -> ASGIApp:
    """``app``, and ``undo(scope)`` when its answer cannot be delivered: the client had gone when the
    response was about to start, so what the route granted it (a lease) is given back, not held
    for nobody until an idle timeout. A client that leaves after the response was written looks
    to the server like one that read it; that is where HTTP's knowledge ends."""

    async def guarded(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        dropped = False

        async def deliver(message: dict[str, Any]) -> None:
            nonlocal dropped
            if message["type"] == "http.response.start" and await gone(receive):
                dropped = True
            if not dropped:
                await send(message)

        try:
            await app(scope, receive, deliver)
        finally:
            if dropped:
                await undo(scope)

    return guarded
