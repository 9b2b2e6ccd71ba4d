"""The pool's background tasks (health probes, scaling, resets, prewarm requests): one owner, so
``SlotPool.stop`` can cancel every one of them and nothing starts after it."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class Background:
    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[None]] = set()
        self.running = False

    def start(self) -> None:
        self.running = True

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def stop(self) -> None:
        """Cancel every task and wait for them (a task's cleanup may still spawn: none runs then)."""
        self.running = False
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
