"""A pool starting many hosts at once keeps a bounded number of requests in flight to them
(``PoolConfig.control_requests``; atropos/slots/pool_hosts.py): it leases every slot of every host it
starts, and one request per slot opened together (10,000 on a fleet of 100 hosts x 100 slots) timed
out connecting on a busy machine, each request's deadline running while thousands of others were
served. Real local hosts, real HTTP; the requests are observed by wrapping the host client's
``health`` and ``lease`` (the real request still goes out) and by counting the TCP connections to
each host in the kernel's table."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import pytest

from atropos.backends.config import BackendSettings, build_backend
from atropos.sandbox.contract.client import HostClient
from atropos.slots.pool import SlotPool
from tests.pool_backends import DATA_ROOT, pool_cfg

SLOTS = 24
HOSTS = 2
START_REQUESTS = 3
ESTABLISHED = "01"


def connections_to(port: int) -> int:
    """Established TCP connections whose far end is ``port`` on this machine (this test's client
    sockets: the host's port is its own)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == ESTABLISHED and int(fields[2].rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


async def test_a_pool_starting_hosts_at_once_keeps_its_control_requests_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    in_flight = 0
    most = 0
    sent: dict[str, int] = {"health": 0, "lease": 0}

    def observed(name: str, real: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def wrapper(self: HostClient, *args: Any, **kw: Any) -> Any:
            nonlocal in_flight, most
            in_flight += 1
            most = max(most, in_flight)
            sent[name] += 1
            try:
                return await real(self, *args, **kw)
            finally:
                in_flight -= 1
        return wrapper

    monkeypatch.setattr(HostClient, "health", observed("health", HostClient.health))
    monkeypatch.setattr(HostClient, "lease", observed("lease", HostClient.lease))
    pool_id = f"t{secrets.token_hex(4)}"
    backend = build_backend(BackendSettings(kind="local", pool_id=pool_id, slots_per_host=SLOTS, max_timeout_s=120),
                            environ={}, data_root=DATA_ROOT, prewarm=False)
    pool = SlotPool(backend, pool_cfg(pool_id=pool_id, min_hosts=HOSTS, max_hosts=HOSTS,
                                      control_requests=START_REQUESTS))
    await pool.start()  # every host at once (no step)
    try:
        assert len(pool.hosts) == HOSTS
        assert sent == {"health": HOSTS, "lease": HOSTS * SLOTS}
        assert most == START_REQUESTS  # the bound is reached, never passed
        assert pool.status().free == HOSTS * SLOTS
        for host in pool.hosts.values():
            port = urlsplit(host.info.address).port
            assert port is not None
            # a connection for the health check and at most START_REQUESTS for its leases, kept alive:
            # not one per slot
            assert 1 <= connections_to(port) <= START_REQUESTS + 1
        # the fleet works as before: a lease, a call, a release
        lease = await pool.lease("after-start")
        assert (await lease.bash("echo up")).stdout.strip() == "up"
        await lease.release()
    finally:
        await pool.stop()


def test_control_requests_is_at_least_one() -> None:
    with pytest.raises(ValueError):
        pool_cfg(control_requests=0)
