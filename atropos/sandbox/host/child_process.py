"""Short-lived helper programs the host starts (cp, tar, git, the egress route writer)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


@contextlib.asynccontextmanager
async def killed_if_left(proc: asyncio.subprocess.Process) -> AsyncIterator[None]:
    """Kill and reap ``proc`` if the block is left while it still runs (an error, a timeout, the
    caller cancelled): a helper never outlives the call that started it."""
    try:
        yield
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
