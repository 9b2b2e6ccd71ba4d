"""The SlotPool's hosts: starting and stopping them, health probes, declaring one dead, and scaling
between ``min_hosts`` and ``max_hosts`` with demand."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from atropos.backends.base import Backend, HostInfo
from atropos.errors import AtroposSandboxError
from atropos.sandbox.contract.client import HostClient
from atropos.sandbox.contract.protocol import HealthInfo
from atropos.slots.audit import LeaseAudit
from atropos.slots.background import Background
from atropos.slots.config import PoolConfig
from atropos.slots.lease import PoolHost

log = logging.getLogger("atropos.slots.pool")
T = TypeVar("T")


class HostFleet:
    """Owns the hosts and the counts of their comings and goings; tells the pool (``on_capacity``)
    when slots may have become leasable, and asks it (``demand``) how many slots are waited for."""

    def __init__(self, backend: Backend, cfg: PoolConfig, audit: LeaseAudit, background: Background,
                 on_capacity: Callable[[], None], demand: Callable[[], int]) -> None:
        self.backend = backend
        self.cfg = cfg
        self.hosts: dict[str, PoolHost] = {}
        self._audit = audit
        self._background = background
        self._grant_waiters = on_capacity
        self._demand = demand
        self._scale = asyncio.Event()
        # every request to a host being started, and every health probe, passes here
        # (PoolConfig.control_requests): each request's connect and read deadlines then cover its own
        # exchange, not a queue of thousands opened with it on a busy event loop
        self._control_gate = asyncio.Semaphore(cfg.control_requests)
        self.starting = 0
        self.lost_hosts = 0
        self.scale_ups = 0
        self.scale_downs = 0

    @property
    def _running(self) -> bool:
        return self._background.running

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        return self._background.spawn(coro)

    def rescale(self) -> None:
        """Demand changed (a request waits, a host died): run a scaling step now, not at the next tick."""
        self._scale.set()

    def free_count(self, avoid: frozenset[str] = frozenset()) -> int:
        """Slots that could be leased right now, on hosts that take leases (and are not in ``avoid``)."""
        return sum(len(h.free) for h in self.hosts.values() if h.leasable and h.id not in avoid)

    def forget_all(self) -> list[PoolHost]:
        """The pool stops: forget every host and return them (the pool fails their leases before it
        closes their clients, so no call starts on a closed client)."""
        hosts = list(self.hosts.values())
        self.hosts.clear()
        return hosts

    async def _add_host(self, prewarm: bool = True) -> PoolHost:
        """Start a host and take its slots; ``prewarm``: then ask it to prewarm them (if the backend
        says so). ``start()`` passes False and asks the whole initial fleet once all of it is up."""
        self.starting += 1
        info: HostInfo | None = None
        client: HostClient | None = None
        try:
            t0 = time.perf_counter()
            info = await self.backend.start_host()
            client = HostClient(info.address, info.token, log=info.log, connect_timeout_s=self.cfg.connect_timeout_s)
            host = PoolHost(info, client)
            # the host's own limits (its health reply), before any call: the client's read deadline
            # follows what this host may take per call, whatever its backend configured
            await self._gated(functools.partial(client.health, timeout=self.cfg.health_timeout_s))
            leases = await asyncio.gather(*(
                self._gated(functools.partial(client.lease, f"pool:{self.cfg.pool_id}", slot=i))
                for i in range(info.slots)))
            for li in leases:
                host.give_back(li.slot, li.lease, li.generation)
        except BaseException:
            if client is not None:
                await client.aclose()  # its connections, opened to a host that is stopped now
            if info is not None:
                await self.backend.stop_host(info.id)
            raise
        finally:
            self.starting -= 1
        self.hosts[host.id] = host
        log.info("scale: host %s up with %d slots in %.0f ms (%d hosts)", host.id, info.slots,
                 (time.perf_counter() - t0) * 1000, len(self.hosts))
        self._grant_waiters()
        if prewarm:
            self._request_prewarm([host])
        return host

    async def _gated(self, request: Callable[[], Awaitable[T]]) -> T:
        """``request()`` (a host's start or health probe), sent once fewer than ``control_requests`` are in flight."""
        async with self._control_gate:
            return await request()

    def _request_prewarm(self, hosts: list[PoolHost]) -> None:
        """Ask ``hosts`` to start their slots' sandboxes in the background (when the backend's
        ``prewarm`` says so). Never awaited by a start: a failure is only logged, and a slot whose
        sandbox did not start starts it with its first call."""
        if self.backend.prewarm() and self._running:
            for host in hosts:
                self._spawn(self._prewarm_host(host))

    async def _prewarm_host(self, host: PoolHost) -> None:
        try:
            out = await host.client.prewarm()
        except (AtroposSandboxError, ValueError) as exc:  # ValueError: an answer that is not a PrewarmResult
            log.warning("host %s: prewarm request failed, its slots start their sandboxes on first use: %s",
                        host.id, exc)
            return
        log.info("host %s: prewarming %d slot(s) (%d running, %d left alone)", host.id, out.warming, out.running,
                 out.skipped)

    async def _remove_host(self, host: PoolHost, reason: str) -> None:
        self.hosts.pop(host.id, None)
        host.retire()
        log.info("scale: host %s removed (%s); %d hosts left", host.id, reason, len(self.hosts))
        await host.client.aclose()
        await self.backend.stop_host(host.id)

    def declare_dead(self, host: PoolHost, reason: str) -> None:
        """Take ``host`` out of service: its leases are lost (their calls raise HostUnavailable)."""
        if host.dead.is_set():
            return
        self.lost_hosts += 1
        lost = host.mark_dead(reason)
        log.error("host %s is dead (%s): failing %d lease(s)", host.id, reason, len(lost))
        for lease in lost:
            lease.lose(reason)
            self._audit.record("lost", lease.trajectory_id, host.id, lease.slot, lease.generation)
        self._spawn(self._remove_host(host, f"dead: {reason}"))
        self.rescale()

    def suspect(self, host: PoolHost) -> None:
        """A call saw a transport error: check the host now instead of at the next health tick,
        and lease nothing more from it until a probe passes (a killed host's other free slots
        would otherwise be handed out in the moment before its death is confirmed)."""
        # once stopped, nothing may start: a probe through a closed client would fail with an
        # exception no one retrieves ("Task exception was never retrieved" at a normal end)
        if not host.dead.is_set() and self._running:
            host.suspect()
            self._spawn(self._check_host(host, urgent=True))

    async def _check_host(self, host: PoolHost, urgent: bool = False) -> None:
        if host.dead.is_set():
            return
        if not await self.backend.alive(host.id):
            self.declare_dead(host, "the backend reports the host gone")
            return
        ms: float | None = None

        async def probe() -> tuple[HealthInfo, float] | None:
            if host.dead.is_set() or not self._running:
                return None  # declared dead, or the pool stops (its client closed), while this waited its turn
            t0 = time.perf_counter()  # the round trip itself, not the wait for a turn at the gate
            health = await host.client.health(timeout=self.cfg.health_timeout_s)
            return health, (time.perf_counter() - t0) * 1000

        try:
            probed = await self._gated(probe)
            if probed is None:
                return
            health, ms = probed
            healthy, why = health.ok, health.detail
        except AtroposSandboxError as exc:
            healthy, why = False, str(exc)
        if host.probed(healthy, ms):
            self._grant_waiters()
        if healthy:
            return
        log.warning("host %s failed a health probe (%d/%d): %s", host.id, host.failures,
                    self.cfg.health_failures, why)
        if host.failures >= self.cfg.health_failures or (urgent and host.failures > 1):
            self.declare_dead(host, f"health: {why}")

    async def _health_loop(self) -> None:
        while self._running:
            await asyncio.sleep(self.cfg.health_interval_s)
            await asyncio.gather(*(self._check_host(h) for h in list(self.hosts.values())),
                                 return_exceptions=True)

    async def _scale_loop(self) -> None:
        while self._running:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._scale.wait(), timeout=1.0)
            self._scale.clear()
            try:
                await self._scale_step()
            except Exception:
                log.exception("scale step failed")
                await asyncio.sleep(self.cfg.start_retry_s)

    async def _scale_step(self) -> None:
        demand = self._demand()
        if self._should_start_host(demand):
            log.info("scale: starting a host (hosts %d, starting %d, waiting %d, free %d)",
                     len(self.hosts), self.starting, demand, self.free_count())
            self._spawn(self._add_host_logged())
            return
        await self._stop_idle_hosts(demand)

    def _should_start_host(self, demand: int) -> bool:
        capacity = len(self.hosts) + self.starting
        return capacity < self.cfg.max_hosts and (
            capacity < self.cfg.min_hosts or demand > self.free_count() + self._starting_slots())

    async def _stop_idle_hosts(self, demand: int) -> None:
        """Stop hosts idle for ``scale_down_idle_s`` while above ``min_hosts`` and nobody waits."""
        now = time.monotonic()
        for host_id in self.backend.removal_order(list(self.hosts)):
            host = self.hosts.get(host_id)
            if host is None:
                continue
            idle = host.idle_for(now)
            if idle is None:
                continue
            if len(self.hosts) > self.cfg.min_hosts and not demand and idle >= self.cfg.scale_down_idle_s:
                self.scale_downs += 1
                await self._remove_host(host, f"idle for {idle:.0f}s")

    def _starting_slots(self) -> int:
        return self.starting * max((h.info.slots for h in self.hosts.values()), default=1)

    async def _add_host_logged(self) -> None:
        try:
            await self._add_host()
            self.scale_ups += 1
        except Exception as exc:
            log.error("scale: host start failed: %s", exc)
            await asyncio.sleep(self.cfg.start_retry_s)
            self.rescale()
