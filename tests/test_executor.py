"""ToolExecutor on a real local pool: batching, no head-of-line blocking, no deadlock, scale."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from atropos.errors import HostUnavailable, LeaseError
from atropos.slots.pool import SlotPool
from atropos.tools.executor import AgentToolCall, ExecutorConfig, ToolExecutor
from tests.pool_backends import kill_host, local_pool


async def _pool(hosts: int, slots: int) -> SlotPool:
    pool = local_pool(slots, min_hosts=hosts, max_hosts=hosts, acquire_timeout_s=300)
    await pool.start()
    return pool


# One 8-slot pool for the module's tests that need no pool of their own: each test makes its own
# executor (whose counters the tests assert) and releases every trajectory it leased, and a release
# resets the slot, so a test meets the pool as a fresh one would be, without starting a host each time.
pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool() -> AsyncIterator[SlotPool]:
    async with local_pool(8, acquire_timeout_s=300) as p:
        yield p


def bash(cmd: str, call_id: str = "c1", **extra: object) -> AgentToolCall:
    return AgentToolCall(id=call_id, name="bash", arguments={"command": cmd, **extra})


async def test_calls_from_many_trajectories_share_requests(pool: SlotPool) -> None:
    ex = ToolExecutor(pool, cfg=ExecutorConfig(tool_batch_window_ms=100))
    try:
        outs = await asyncio.gather(*(ex.execute(f"t{i}", bash(f"echo {i}")) for i in range(8)))
        assert [o.content for o in outs] == [str(i) for i in range(8)]
        # 8 leases happen first; then the calls arrive within one window: far fewer requests than calls.
        assert ex.calls_sent == 8
        assert ex.requests_sent <= 3
    finally:
        for i in range(8):
            await ex.release_trajectory(f"t{i}")
        await ex.close()


async def test_slow_call_does_not_delay_another_trajectory(pool: SlotPool) -> None:
    ex = ToolExecutor(pool, cfg=ExecutorConfig(tool_batch_window_ms=20))
    try:
        await ex.execute("fast", bash("true"))  # lease both first so only the calls race
        await ex.execute("slow", bash("true"))
        slow = asyncio.create_task(ex.execute("slow", bash("sleep 600; echo slow")))
        await asyncio.sleep(0.2)
        fast = await ex.execute("fast", bash("echo fast"))
        assert fast.content == "fast"
        assert not slow.done()  # the 600 s call is still running: the echo did not wait for it
        slow.cancel()
    finally:
        await ex.release_trajectory("fast")
        await ex.release_trajectory("slow")
        await ex.close()


async def test_waiting_for_a_slot_does_not_block_holders() -> None:
    p = await _pool(1, 1)
    ex = ToolExecutor(p, cfg=ExecutorConfig(acquire_timeout_s=60))
    try:
        await ex.execute("holder", bash("true"))
        waiting = asyncio.create_task(ex.execute("waiter", bash("echo finally")))
        await asyncio.sleep(0.3)
        for i in range(5):  # the holder keeps working while the waiter waits for its slot
            assert (await ex.execute("holder", bash(f"echo {i}"))).content == str(i)
        assert not waiting.done()
        await ex.release_trajectory("holder")
        assert (await asyncio.wait_for(waiting, 30)).content == "finally"
    finally:
        await ex.release_trajectory("waiter")
        await ex.close()
        await p.stop()


async def test_tool_failures_are_results_and_timeouts_are_clamped(pool: SlotPool) -> None:
    ex = ToolExecutor(pool, cfg=ExecutorConfig(max_timeout_s=1.0, tool_batch_window_ms=0))
    try:
        failed = await ex.execute("t", bash("echo oops >&2; exit 3"))
        assert not failed.ok and "[exit code: 3]" in failed.content and "oops" in failed.content
        unknown = await ex.execute("t", AgentToolCall(id="x", name="rm_rf", arguments={}))
        assert not unknown.ok and "no tool named 'rm_rf'" in unknown.content
        bad = await ex.execute("t", AgentToolCall(id="y", name="read_file", arguments={"nope": 1}))
        assert not bad.ok and "invalid_arguments" in bad.content
        slow = await ex.execute("t", bash("sleep 5; echo never", timeout_s=10_000))
        assert not slow.ok and "timed out" in slow.content and "never" not in slow.content
        several = await ex.execute_many("t", [bash("echo 1 >> log", "a"), bash("echo 2 >> log", "b"),
                                              AgentToolCall(id="c", name="read_file", arguments={"path": "log"})])
        assert [o.call_id for o in several] == ["a", "b", "c"]
        assert several[2].content == "1\n2\n"
    finally:
        await ex.release_trajectory("t")
        await ex.close()


async def test_dead_host_raises_infrastructure_error() -> None:
    p = await _pool(1, 2)
    ex = ToolExecutor(p)
    try:
        await ex.execute("t", bash("true"))
        lease = ex.lease_of("t")
        assert lease is not None
        call = asyncio.create_task(ex.execute("t", bash("sleep 600")))
        await asyncio.sleep(0.5)
        kill_host(p.backend, lease.host.id)
        with pytest.raises(HostUnavailable):  # long before the command's end, however busy the machine
            await asyncio.wait_for(call, 120)
    finally:
        await ex.release_trajectory("t")
        await ex.close()
        await p.stop()


@pytest.mark.slow
async def test_1000_trajectories_times_10_calls_all_correct() -> None:
    p = await _pool(4, 16)
    ex = ToolExecutor(p, cfg=ExecutorConfig(acquire_timeout_s=600))

    async def trajectory(i: int) -> list[str]:
        try:
            outs = []
            for j in range(10):
                outs.append((await ex.execute(f"traj-{i}", bash(f"echo {i}-{j}", f"c{j}"))).content)
            return outs
        finally:
            await ex.release_trajectory(f"traj-{i}")

    try:
        results = await asyncio.gather(*(trajectory(i) for i in range(1000)))
        for i, outs in enumerate(results):
            assert outs == [f"{i}-{j}" for j in range(10)]
        assert ex.calls_sent == 10_000
        assert ex.requests_sent < ex.calls_sent  # batching took effect under load
    finally:
        await ex.close()
        await p.stop()


# -- adaptive batching: counted in requests, never timed --------------------------------------
HOUR_MS = 3_600_000  # a window no test could wait out: passing proves nothing waited for it


async def test_lone_calls_go_out_at_once_whatever_the_window(pool: SlotPool) -> None:
    ex = ToolExecutor(pool, cfg=ExecutorConfig(tool_batch_window_ms=HOUR_MS))
    try:
        for i in range(5):
            out = await asyncio.wait_for(ex.execute("t", bash(f"echo {i}")), 60)
            assert out.content == str(i)
        assert ex.requests_sent == ex.calls_sent == 5  # each lone call was its own request, sent at once
        turn = await asyncio.wait_for(ex.execute_many("t", [bash("echo a > f", "a"), bash("cat f", "b")]), 60)
        assert [o.content for o in turn] == ["(no output)", "a"]
        assert ex.requests_sent == 6  # a turn's calls share one request (and keep their order)
    finally:
        await ex.release_trajectory("t")
        await ex.close()


async def test_slow_call_does_not_hold_a_fast_one_even_with_a_huge_window(pool: SlotPool) -> None:
    ex = ToolExecutor(pool, cfg=ExecutorConfig(tool_batch_window_ms=HOUR_MS))
    try:
        await ex.execute("fast", bash("true"))
        await ex.execute("slow", bash("true"))
        slow = asyncio.create_task(ex.execute("slow", bash("sleep 120; echo slow")))
        while ex.requests_sent < 3:  # the slow call is in flight
            await asyncio.sleep(0.01)
        for i in range(3):
            assert (await asyncio.wait_for(ex.execute("fast", bash(f"echo {i}")), 60)).content == str(i)
        assert not slow.done()
        assert ex.requests_sent == 6  # each fast call went out alone, none waited for the slow one's request
        slow.cancel()
    finally:
        await ex.release_trajectory("fast")
        await ex.release_trajectory("slow")
        await ex.close()


async def test_calls_arriving_under_load_share_requests(pool: SlotPool) -> None:
    ex = ToolExecutor(pool)  # default window: an upper bound only

    async def loop(i: int) -> None:
        for j in range(25):
            assert (await ex.execute(f"t{i}", bash(f"echo {i}-{j}", f"c{j}"))).content == f"{i}-{j}"

    try:
        await asyncio.gather(*(ex.execute(f"t{i}", bash("true")) for i in range(8)))
        before_requests, before_calls = ex.requests_sent, ex.calls_sent
        await asyncio.gather(*(loop(i) for i in range(8)))
        calls, requests = ex.calls_sent - before_calls, ex.requests_sent - before_requests
        assert calls == 200
        assert requests <= calls * 0.6, f"{requests} requests for {calls} calls"
    finally:
        for i in range(8):
            await ex.release_trajectory(f"t{i}")
        await ex.close()


async def test_cancelled_call_is_stopped_on_the_host(pool: SlotPool) -> None:
    ex = ToolExecutor(pool)
    try:
        await ex.execute("t", bash("true"))
        call = asyncio.create_task(ex.execute("t", bash("sleep 300; echo late > late.txt")))
        while ex.requests_sent < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # let the host start it (cancelling earlier must hold as well)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        # the slot is free again long before the sleep could end: the host stopped the cancelled call
        out = await asyncio.wait_for(ex.execute("t", bash("ls; echo next")), 120)
        assert out.content == "next"
    finally:
        await ex.release_trajectory("t")
        await ex.close()


async def test_executor_state_stays_flat_over_many_trajectories(pool: SlotPool) -> None:
    ex = ToolExecutor(pool)
    try:
        for round_ in range(25):
            async def one(i: int, r: int = round_) -> None:
                tid = f"r{r}-t{i}"
                if i % 2:
                    lease = await pool.lease(tid, 60)
                    ex.bind(tid, lease)
                    try:
                        await ex.execute(tid, bash("true"))
                    finally:
                        ex.unbind(tid)
                        await lease.release()
                else:
                    await ex.execute(tid, bash("true"))
                    await ex.release_trajectory(tid)

            await asyncio.gather(*(one(i) for i in range(8)))
            assert ex.trajectories == 0
        assert ex.calls_sent == 200
        assert all(not q.turns and not q.inflight and q.holding == 0 for q in ex._queues.values())
        assert len(ex._queues) == 1
    finally:
        await ex.close()


async def test_a_lease_the_host_refuses_is_a_lease_error_on_both_call_paths(pool: SlotPool) -> None:
    """Issue 18: the host's ``lease_invalid`` was a LeaseError (retried on a fresh slot) through the
    executor, but an ordinary failed result (shown to the model) through ``Lease.call``."""
    lease = await pool.lease("stale", 60)
    ex = ToolExecutor(pool)
    # the host rotates a slot's lease token on every reset: reset it behind the Lease's back
    rotated = await lease.host.client.reset(lease.slot, lease.token)
    assert rotated.ok and rotated.lease is not None
    try:
        ex.bind("stale", lease)
        with pytest.raises(LeaseError):
            await lease.call("bash", {"command": "true"})
        with pytest.raises(LeaseError):
            await ex.execute("stale", bash("true"))
        with pytest.raises(LeaseError):  # Lease.ok and the typed helpers on top of it
            await lease.bash("true")
        assert lease.calls == 3  # one bookkeeping: each path counts on the lease itself
    finally:
        ex.unbind("stale")
        await ex.close()
        lease.token, lease.generation = rotated.lease.lease, rotated.lease.generation
        await lease.release()
