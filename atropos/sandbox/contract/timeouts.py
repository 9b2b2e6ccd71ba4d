"""One deadline on an awaited read, the same on every supported Python: ``asyncio.timeout`` (a timer
on the calling task) on 3.11+, ``asyncio.wait_for`` on 3.10, which has no ``asyncio.timeout``.

Used where a read is on the hot path, on both sides of the contract: the lean HTTP client's socket
reads (http1.py) and the host's reads of a sandbox's reply frames
(host/isolation/sandbox_process.py). ``wait_for`` wraps each awaited read in a task of its own
(measured: 41 us a read against 15 us under ``asyncio.timeout``, about a tenth of the pool's CPU
per call); either way the deadline's end raises ``asyncio.TimeoutError``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

if sys.version_info >= (3, 11):
    async def within(awaitable: Awaitable[T], seconds: float) -> T:
        """``await awaitable``, cancelled and ``asyncio.TimeoutError`` after ``seconds``."""
        async with asyncio.timeout(seconds):
            return await awaitable
else:  # pragma: no cover - Python 3.10 has no asyncio.timeout
    async def within(awaitable: Awaitable[T], seconds: float) -> T:
        """``await awaitable``, cancelled and ``asyncio.TimeoutError`` after ``seconds``."""
        return await asyncio.wait_for(awaitable, seconds)
