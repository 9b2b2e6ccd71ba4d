"""The pool decides when its hosts prewarm (issue 19, item 4): hosts start with ``--no-prewarm`` and
the pool asks each one (``POST /v1/prewarm``) once its whole initial fleet is up, a later host as
soon as it is ready; the host's request warms only the slots that may be warmed, and a failed
request costs nothing but the warm start. Real hosts, real HTTP; the pool's requests are observed
by wrapping ``HostClient.prewarm`` (the real request still goes out)."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import RunningHost, start_host, stop_host, wait_until

from atropos.backends.base import Backend, HostInfo
from atropos.sandbox.contract.client import HostClient
from atropos.sandbox.contract.protocol import PrewarmResult, SlotInfo
from atropos.slots.pool import SlotPool
from tests.pool_backends import BACKENDS, host_pid, make_backend, pool_cfg

Events = list[tuple[str, str]]


class Recorded(Backend):
    """The real backend, recording when each host it starts is ready. ``hold_last``: the last host
    of the initial fleet starts only once the pool holds all the others (so a pool that asked a
    host to prewarm as soon as that host was up would be seen asking before the fleet is up)."""

    def __init__(self, inner: Backend, events: Events, hold_last: int = 0) -> None:
        self.inner, self.events, self.hold_last = inner, events, hold_last
        self.cfg = inner.cfg  # type: ignore[attr-defined]  # Backend.prewarm() and host_slots() read it
        self.name = inner.name
        self.pool: SlotPool | None = None
        self._started = 0
        self.early: list[SlotInfo] = []  # the other hosts' slots once the held host is up

    async def start_host(self) -> HostInfo:
        self._started += 1
        if self.hold_last and self._started == self.hold_last:
            pool = self.pool
            assert pool is not None
            assert await wait_until(lambda: len(pool.hosts) == self.hold_last - 1, timeout=240)
        info = await self.inner.start_host()
        self.events.append(("ready", info.address))
        if self.hold_last and self._started == self.hold_last:
            # the others have been up for the whole start of this one: none may have a sandbox yet
            assert self.pool is not None
            self.early = [i for h in list(self.pool.hosts.values()) for i in await h.client.slots()]
        return info

    async def stop_host(self, host_id: str) -> None:
        await self.inner.stop_host(host_id)

    async def alive(self, host_id: str) -> bool:
        return await self.inner.alive(host_id)

    async def reap_orphans(self) -> int:
        return await self.inner.reap_orphans()

    async def close(self) -> None:
        await self.inner.close()


@pytest.fixture
def prewarm_requests(monkeypatch: pytest.MonkeyPatch) -> Iterator[Events]:
    """Every ``HostClient.prewarm`` the pool makes, in order with the backend's "ready" events."""
    events: Events = []
    real = HostClient.prewarm

    async def recorded(self: HostClient, timeout: float = 10.0) -> PrewarmResult:
        events.append(("prewarm", self.base_url))
        return await real(self, timeout)

    monkeypatch.setattr(HostClient, "prewarm", recorded)
    yield events


async def _all_running(pool: SlotPool) -> bool:
    infos = [i for h in list(pool.hosts.values()) for i in await h.client.slots()]
    return bool(infos) and all(i.sandbox_running for i in infos)


async def _poll(pred: Any, timeout: float = 240.0) -> bool:
    end = asyncio.get_running_loop().time() + timeout
    while not await pred():
        if asyncio.get_running_loop().time() > end:
            return False
        await asyncio.sleep(0.1)
    return True


def _cmdline(pid: int | None) -> list[str]:
    assert pid is not None
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


@pytest.mark.parametrize("kind", BACKENDS)
async def test_the_fleet_is_asked_to_prewarm_once_all_of_it_is_up_and_every_slot_warms(
        kind: str, prewarm_requests: Events) -> None:
    hosts = 3 if kind == "local" else 2
    inner = make_backend(kind, slots=2)
    backend = Recorded(inner, prewarm_requests, hold_last=hosts)
    pool = SlotPool(backend, pool_cfg(min_hosts=hosts, max_hosts=hosts))
    backend.pool = pool
    async with pool:
        addresses = {h.info.address for h in pool.hosts.values()}
        assert len(addresses) == hosts
        assert len(backend.early) == (hosts - 1) * 2
        assert not any(i.sandbox_running for i in backend.early), backend.early
        # every slot's sandbox comes up with no call made (the free slots are the pool's leases)
        assert await _poll(lambda: _all_running(pool)), [i for h in pool.hosts.values() for i in await h.client.slots()]
        kinds = [k for k, _ in prewarm_requests]
        # all hosts were ready before the first prewarm request, and each host was asked once
        assert kinds == ["ready"] * hosts + ["prewarm"] * hosts, prewarm_requests
        assert {a for k, a in prewarm_requests if k == "prewarm"} == addresses
        if kind == "local":  # the hosts themselves did not prewarm at start: the pool picked the moment
            for h in pool.hosts.values():
                assert "--no-prewarm" in _cmdline(host_pid(inner, h.id))
        # a slot warmed by the pool's request runs its first call in the sandbox already there
        async with pool.leased("t") as lease:
            assert (await lease.bash("echo warm")).stdout == "warm\n"


async def test_a_pool_without_prewarm_never_asks_and_no_slot_warms(prewarm_requests: Events) -> None:
    backend = make_backend("local", slots=2)
    backend.cfg.prewarm = False  # type: ignore[attr-defined]
    async with SlotPool(backend, pool_cfg()) as pool:
        [host] = pool.hosts.values()
        assert "--no-prewarm" in _cmdline(host_pid(backend, host.id))
        async with pool.leased("t") as lease:
            assert (await lease.bash("echo lazy")).stdout == "lazy\n"
            infos = {i.slot: i for i in await host.client.slots()}
            assert infos[lease.slot].sandbox_running
            other = next(i for s, i in infos.items() if s != lease.slot)
            assert not other.sandbox_running  # started on first use only
    assert prewarm_requests == []


async def test_a_host_added_later_is_asked_as_soon_as_it_is_ready(prewarm_requests: Events) -> None:
    async with SlotPool(make_backend("local", slots=1), pool_cfg(min_hosts=1, max_hosts=2)) as pool:
        first = await pool.lease("first")
        second = await pool.lease("second", timeout=240)  # no free slot: the pool scales up
        assert first.host is not second.host
        assert ("prewarm", second.host.info.address) in prewarm_requests
        # the slot the trajectory holds (no network) is warmed for its first call
        assert await _poll(lambda: _slot_running(second.host.client, second.slot))
        await pool.release(first)
        await pool.release(second)


async def _slot_running(client: HostClient, slot: int) -> bool:
    return next(i for i in await client.slots() if i.slot == slot).sandbox_running


@pytest.fixture
def cold_host(tmp_path: Path) -> Iterator[RunningHost]:
    data = Path(f"/tmp/atropos-test-prewarm-{os.getpid()}-{secrets.token_hex(3)}")
    host = start_host(data, slots=4, extra=["--no-prewarm"])
    yield host
    stop_host(host)


async def test_a_prewarm_request_leaves_network_and_sealed_slots_alone_and_is_idempotent(
        cold_host: RunningHost) -> None:
    async with cold_host.client() as client:
        net = await client.lease("net", network=True)
        sealed = await client.lease("sealed")
        await client.seal(sealed.slot, sealed.lease)
        plain = await client.lease("plain")  # leased without network: warmed like a free slot
        before = {i.slot: i for i in await client.slots()}
        assert not any(i.sandbox_running for i in before.values())  # --no-prewarm: nothing started yet

        out = await client.prewarm()
        warm = sorted(set(before) - {net.slot, sealed.slot})
        assert sorted(out.slots) == warm and out.warming == len(warm) and out.skipped == 2, out
        assert plain.slot in out.slots
        assert await _poll(lambda: _all_of(client, warm))

        again = await client.prewarm()  # idempotent: nothing new to start
        assert again.warming == 0 and again.slots == [] and again.running == len(warm), again
        after = {i.slot: i for i in await client.slots()}
        assert not after[net.slot].sandbox_running and after[net.slot].network
        assert not after[sealed.slot].sandbox_running and after[sealed.slot].sealed
        assert after[plain.slot].state == "leased" and after[plain.slot].sandbox_running


async def _all_of(client: HostClient, slots: list[int]) -> bool:
    infos = {i.slot: i for i in await client.slots()}
    return all(infos[s].sandbox_running for s in slots)


async def test_a_failing_prewarm_request_fails_neither_start_nor_the_host(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # A real failed request: the host answers 404 (as a host without the route would).
    async def missing_route(self: HostClient, timeout: float = 10.0) -> PrewarmResult:
        await self._send("POST", "/v1/prewarm-missing", timeout=timeout)
        raise AssertionError("the host answered a route it does not have")

    monkeypatch.setattr(HostClient, "prewarm", missing_route)
    caplog.set_level(logging.WARNING, logger="atropos.slots.pool")
    async with SlotPool(make_backend("local", slots=2), pool_cfg()) as pool:
        assert await wait_until(lambda: "prewarm request failed" in caplog.text, timeout=120), caplog.text
        [host] = pool.hosts.values()
        assert not host.dead.is_set() and pool.free_count() == 2
        leases = await pool.lease_many(["a", "b"])
        for lease in leases:  # each slot's first call starts its sandbox
            assert (await lease.bash("echo ok")).stdout == "ok\n"
            await lease.release()
