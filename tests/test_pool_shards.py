"""A pool sharded over processes (atropos/slots/shards.py, issue 38 item 5): each lease lives in one
shard and its calls, release and status go to that shard; waiting is FIFO across shards; a shard
that dies fails its calls at once with HostUnavailable naming it, and the others go on. Real shard
processes on the local backend (real sandbox hosts)."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
from typing import Any

import pytest

from atropos.errors import (
    ERRORS,
    HostUnavailable,
    InfrastructureError,
    LeaseError,
    NomadAPIError,
    PathEscapeError,
    PoolReplyError,
    SlotUnavailable,
    ToolError,
)
from atropos.slots.shard_channel import error_from, error_tuple
from atropos.slots.shards import ShardedPool
from tests.pool_backends import local_shard_backend, pool_cfg

SLOTS = 2


def sharded(shards: int = 2, **kw: Any) -> ShardedPool:
    return ShardedPool(functools.partial(local_shard_backend, SLOTS), pool_cfg(**kw), shards=shards)


async def _calls_by_shard(pool: ShardedPool) -> dict[str, int]:
    return {s.pool_id: s.calls_total for s in (await pool.status()).shards}


def test_errors_cross_the_channel_as_their_own_class() -> None:
    for cls in ERRORS:
        if cls in (PoolReplyError, NomadAPIError):
            continue
        back = error_from(error_tuple(cls("why")))
        assert type(back) is cls and str(back) == "why"
    # a class with a constructor of its own comes back as its nearest base: the same family
    nomad = error_from(error_tuple(NomadAPIError("GET", "/v1/jobs", 500, "down")))
    assert type(nomad) is HostUnavailable and "/v1/jobs" in str(nomad)
    tool = error_from(error_tuple(PathEscapeError("out", code="path_escape", status=403)))
    assert isinstance(tool, PathEscapeError) and (tool.code, tool.status) == ("path_escape", 403)
    # what is not an error of the package's table comes back as the platform's, never lost
    other = error_from(error_tuple(RuntimeError("boom")))
    assert isinstance(other, InfrastructureError) and "RuntimeError: boom" in str(other)
    replied = error_from(error_tuple(PoolReplyError(503, "no_free_slot", "x")))
    assert "no_free_slot" in str(replied)


async def test_a_lease_lives_in_one_shard_and_its_calls_and_release_go_there() -> None:
    async with sharded() as pool:
        assert [s.slots for s in pool.shards] == [SLOTS, SLOTS]
        leases = [await pool.lease(f"t{i}") for i in range(2 * SLOTS)]
        # every slot of both shards, each slot once
        assert sorted(lease.shard.index for lease in leases) == [0, 0, 1, 1]
        assert len({lease.key for lease in leases}) == len(leases)
        status = await pool.status()
        assert [s.leased for s in status.shards] == [SLOTS, SLOTS] and status.double_leased == 0

        first = next(lease for lease in leases if lease.shard.index == 0)
        before = await _calls_by_shard(pool)
        out = await first.bash("echo $((6 * 7))")
        assert out.stdout.strip() == "42" and out.exit_code == 0
        after = await _calls_by_shard(pool)
        shard0, shard1 = (s.pool_id for s in status.shards)
        assert after[shard0] == before[shard0] + 1 and after[shard1] == before[shard1]

        # a tool's refusal comes back as the pool's would: ToolError with the host's code
        with pytest.raises(ToolError) as refused:
            await first.read_file("../../etc/passwd")
        assert refused.value.code == "path_escape"
        # the typed tools of a SlotPool lease, through the shard: files and the session keep state
        written = await first.write_file("notes/a.txt", "shard-written\n")
        assert written.path.endswith("notes/a.txt")
        assert await first.read_file("notes/a.txt") == "shard-written\n"
        await first.python_session("x = 6 * 7")
        assert (await first.python_session("print(x)")).stdout.strip() == "42"

        await first.release()
        await first.release()  # idempotent
        status = await pool.status()
        assert [s.leased for s in status.shards] == [SLOTS - 1, SLOTS]
        with pytest.raises(LeaseError):
            await first.bash("true")
        # the freed slot is the only room: the next lease goes to the shard that released it
        again = await pool.lease("t-again")
        assert again.shard.index == 0
        for lease in [*leases[1:], again]:
            await lease.release()
        assert (await pool.status()).leased == 0


async def test_a_shard_scales_its_hosts_up_to_max_hosts_and_the_front_counts_them() -> None:
    # the front's room for a shard is what the shard's pool can hold (its hosts, and those it may
    # still start), reported with every answer: not the slots it had when it started, which kept
    # every request beyond them queued in the front and the shard's pool from ever scaling up
    async with sharded(shards=1, min_hosts=1, max_hosts=2) as pool:
        leases = [await pool.lease(f"t{i}", timeout=120) for i in range(2 * SLOTS)]
        assert len({lease.key for lease in leases}) == 2 * SLOTS
        assert len({lease.host_id for lease in leases}) == 2  # the second host was started for them
        status = await pool.status()
        assert status.leased == 2 * SLOTS and status.double_leased == 0
        with pytest.raises(SlotUnavailable):  # and no further than max_hosts
            await pool.lease("one-too-many", timeout=2)
        for lease in leases:
            await lease.release()


async def test_a_shards_capacity_counts_the_hosts_it_may_start_from_the_backends_setting() -> None:
    # with no live host (none started yet, or every one died) a shard still offers the slots of the
    # hosts its pool will start: max_hosts x the backend's slots_per_host, not the last host count it saw
    from atropos.slots.pool import SlotPool
    from atropos.slots.shard_channel import Outbox
    from atropos.slots.shard_worker import ShardServer
    from tests.pool_backends import make_backend

    pool = SlotPool(make_backend("local", slots=3), pool_cfg(min_hosts=0, max_hosts=2))
    assert ShardServer(pool, Outbox(lambda data: None)).capacity() == 2 * 3


async def test_waiting_is_fifo_across_shards() -> None:
    async with sharded() as pool:
        held = [await pool.lease(f"h{i}") for i in range(2 * SLOTS)]
        first = asyncio.ensure_future(pool.lease("w1"))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(pool.lease("w2"))
        await asyncio.sleep(0.2)
        assert not first.done() and not second.done()
        # the slot freed in shard 1 goes to the first waiter, whichever shard it is in
        freed = next(lease for lease in held if lease.shard.index == 1)
        await freed.release()
        got = await first
        assert got.shard.index == 1 and not second.done()
        with pytest.raises(SlotUnavailable):
            await pool.lease("w3", timeout=0.3)
        await got.release()
        last = await second
        assert last.shard.index == 1
        for lease in [*held, last]:
            await lease.release()


async def test_a_dead_shard_fails_its_calls_fast_and_the_others_go_on() -> None:
    async with sharded() as pool:
        victim = await pool.lease("victim")
        other = await pool.lease("other")
        assert victim.shard.index != other.shard.index
        running = asyncio.ensure_future(victim.bash("sleep 300"))
        await asyncio.sleep(0.5)
        assert not running.done()
        os.kill(victim.shard.proc.pid, signal.SIGKILL)
        with pytest.raises(HostUnavailable) as died:
            await asyncio.wait_for(running, 60)  # a bound for a broken test, not a measurement
        assert f"pool shard {victim.shard.index}" in str(died.value)
        with pytest.raises(HostUnavailable, match="pool shard"):
            await victim.bash("true")
        await victim.release()  # nothing to send: ends quietly
        status = await pool.status()
        assert list(status.dead) == [victim.shard.index] and "exit code -9" in status.dead[victim.shard.index]
        assert len(status.shards) == 1
        # the live shard serves on, and new leases go only to it
        assert (await other.bash("echo ok")).stdout.strip() == "ok"
        extra = await pool.lease("extra")
        assert extra.shard is other.shard
        with pytest.raises(SlotUnavailable):  # its room is all there is now
            await pool.lease("more", timeout=0.3)
        await extra.release()
        await other.release()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_a_sharded_pools_status_is_exported_as_prometheus_metrics() -> None:
    # every shard's pool metrics under a shard label (the names of one pool's), the shards alive and
    # dead, the front's queue; scraped from another thread (prometheus_client's own server) and on
    # the pool's loop (sharded_exposition)
    from prometheus_client import generate_latest

    from atropos import metrics

    async with sharded() as pool:
        registry = metrics.sharded_registry(pool)
        lease = await pool.lease("m1")
        await lease.bash("true")
        await lease.bash("true")
        from_thread = _samples((await asyncio.to_thread(generate_latest, registry)).decode())
        mine = str(lease.shard.index)
        other = str(1 - lease.shard.index)
        assert from_thread[("atropos_pool_slots", (("shard", mine), ("state", "leased")))] == 1
        assert from_thread[("atropos_pool_slots", (("shard", other), ("state", "leased")))] == 0
        assert from_thread[("atropos_pool_slots", (("shard", other), ("state", "free")))] == SLOTS
        assert from_thread[("atropos_pool_calls_total", (("shard", mine),))] == 2
        assert from_thread[("atropos_pool_leases_total", (("shard", mine),))] == 1
        assert from_thread[("atropos_pool_hosts", (("health", "healthy"), ("shard", mine)))] == 1
        assert from_thread[("atropos_pool_shards", (("state", "live"),))] == 2
        assert from_thread[("atropos_pool_shards", (("state", "dead"),))] == 0
        assert from_thread[("atropos_pool_front_waiting", ())] == 0
        assert from_thread[("atropos_pool_double_leased_total", ())] == 0
        await lease.release()
        # on the pool's own loop: a fresh status is fetched before the registry renders it
        body, content_type = await metrics.sharded_exposition(pool, registry)
        on_loop = _samples(body.decode())
        assert content_type.startswith("text/plain")
        assert on_loop[("atropos_pool_slots", (("shard", mine), ("state", "leased")))] == 0
        assert on_loop[("atropos_pool_slots", (("shard", mine), ("state", "free")))] == SLOTS
        # a shard that dies is counted dead, and its pool metrics are gone with it
        victim = pool.shards[1]
        os.kill(victim.proc.pid, signal.SIGKILL)
        for _ in range(600):  # a bound for a broken test, not a measurement
            if victim.dead is not None:
                break
            await asyncio.sleep(0.1)
        after = _samples((await metrics.sharded_exposition(pool, registry))[0].decode())
        assert after[("atropos_pool_shards", (("state", "dead"),))] == 1
        assert ("atropos_pool_slots", (("shard", "1"), ("state", "free"))) not in after
        assert after[("atropos_pool_slots", (("shard", "0"), ("state", "free")))] == SLOTS
