"""One version-compatible read deadline (atropos/sandbox/contract/timeouts.py), shared by the lean
HTTP client and the host's sandbox reads: it returns the value, ends a read that overruns with
asyncio.TimeoutError and cancels it, adds no task of its own on Python 3.11+, and nothing else in the
package writes its own asyncio.timeout/wait_for switch."""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import pytest

from atropos.sandbox.contract.timeouts import within

ROOT = Path(__file__).resolve().parents[1] / "atropos"


async def test_within_returns_the_awaited_value() -> None:
    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    assert await within(answer(), 5.0) == 42


async def test_within_ends_a_read_that_overruns_and_cancels_it() -> None:
    reader = asyncio.StreamReader()
    read = asyncio.ensure_future(within(reader.read(10), 0.05))
    with pytest.raises(asyncio.TimeoutError):
        await read
    reader.feed_data(b"late")  # the cancelled read took none of it: the next read gets it all
    assert await within(reader.read(10), 5.0) == b"late"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.10's asyncio.wait_for needs a task per read")
async def test_within_starts_no_task_on_python_3_11() -> None:
    seen: list[int] = []

    async def count() -> None:
        seen.append(len(asyncio.all_tasks()))

    before = len(asyncio.all_tasks())
    await within(count(), 5.0)
    assert seen == [before]


def test_no_module_writes_its_own_version_switch() -> None:
    own = ROOT / "sandbox" / "contract" / "timeouts.py"
    bad = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if p != own
           and re.search(r"asyncio\.timeout\(|getattr\(asyncio, \"timeout\"", p.read_text())]
    assert not bad, f"use atropos.sandbox.contract.timeouts.within instead: {bad}"
