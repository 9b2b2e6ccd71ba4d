"""Waiting for a grant from a FIFO queue, shared by the pool's slot queue and the sharded front.

A waiter leaves either way, by timeout or by its caller's cancellation; a grant that landed in the
instant it left was made for nobody, so it is handed back (``give_back``) rather than lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def drop_grant(future: asyncio.Future[T], give_back: Callable[[T], object]) -> None:
    """The waiter left: cancel its future, or give back what it was granted in that instant."""
    if future.done() and not future.cancelled() and future.exception() is None:
        give_back(future.result())
    else:
        future.cancel()


async def await_grant(future: asyncio.Future[T], timeout: float, leave: Callable[[], object]) -> T | None:
    """The grant, or None when ``timeout`` passed first; ``leave`` (which should ``drop_grant``
    and take the waiter off its queue) runs on a timeout and on cancellation."""
    try:
        done, _ = await asyncio.wait({future}, timeout=timeout)
    except asyncio.CancelledError:
        leave()
        raise
    if not done:
        leave()
        return None
    return future.result()
