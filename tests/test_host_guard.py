"""``PoolHost.guard`` (every tool call goes through it): the work fails with HostUnavailable the moment
its host is declared dead, a caller's own cancellation stays a cancellation, and a dead host's guard
refuses new work at once. Pure asyncio: no host is reached (the work is the test's own coroutine)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from atropos.backends.base import HostInfo
from atropos.errors import HostUnavailable
from atropos.slots.lease import PoolHost


def _host() -> PoolHost:
    # the client is never used by guard: the work awaited is the test's own
    return PoolHost(HostInfo(id="h", address="http://127.0.0.1:9", token="t", slots=1), cast(Any, None))


async def test_work_under_a_host_declared_dead_fails_with_host_unavailable() -> None:
    host = _host()
    started, finished = asyncio.Event(), []

    async def work() -> str:
        started.set()
        await asyncio.Event().wait()  # never ends by itself
        finished.append(True)
        return "never"

    call = asyncio.ensure_future(host.guard(work()))
    await started.wait()
    host.mark_dead("killed")
    with pytest.raises(HostUnavailable, match="died during the call: killed"):
        await call
    assert not finished and not host._guarded
    with pytest.raises(HostUnavailable, match="is dead: killed"):
        await host.guard(work())


async def test_a_cancelled_caller_stays_cancelled_and_its_work_stops() -> None:
    host = _host()
    started, stopped = asyncio.Event(), asyncio.Event()

    async def work() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            stopped.set()

    call = asyncio.ensure_future(host.guard(work()))
    await started.wait()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert stopped.is_set() and not host._guarded and not host.dead.is_set()


async def test_results_and_errors_of_the_work_pass_through() -> None:
    host = _host()

    async def ok() -> int:
        return 42

    async def bad() -> None:
        raise ValueError("the work's own error")

    assert await host.guard(ok()) == 42
    with pytest.raises(ValueError, match="own error"):
        await host.guard(bad())
    assert not host._guarded
