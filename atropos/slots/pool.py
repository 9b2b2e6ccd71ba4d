"""SlotPool: one slot per trajectory across many warm hosts; fair waiting, health, scaling.

The pool holds the host-issued lease token of every free slot, so leasing is a local pop
(microseconds) and releasing is one reset request that hands back a fresh token. A slot is in
exactly one place at a time: a host's free list, one ``Lease``, or nowhere (being reset, lost
with its host, or quarantined); nothing ever puts a leased slot back in a free list except the
reset that ends its lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

from atropos.backends.base import Backend, HostInfo
from atropos.errors import (
    AtroposSandboxError,
    HostUnavailable,
    LeaseError,
    SlotUnavailable,
    TemplateInUse,
    UnknownTemplate,
    WorkspaceError,
)
from atropos.errors import GroupTooLarge as GroupTooLarge  # defined there since issue 18
from atropos.sandbox.client import HostClient
from atropos.slots.audit import LeaseAudit
from atropos.slots.config import PoolConfig
from atropos.slots.lease import Lease, PoolHost, PoolTemplate

log = logging.getLogger(__name__)


@dataclass
class _Waiter:
    ids: list[str]
    network: bool
    future: asyncio.Future[list[Lease]] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    colocate: bool = False
    prefer: frozenset[str] = frozenset()


class HostStatus(BaseModel):
    id: str
    address: str
    slots: int
    free: int
    leased: int
    quarantined: int
    healthy: bool = Field(description="not declared dead or suspected, and its last health probe passed")
    health_ms: float | None
    oldest_lease_s: float | None
    node: str | None = Field(None, description="the cluster node the host runs on, for backends that place "
                                               "hosts on nodes (ray: the Ray node id)")


class PoolStatus(BaseModel):
    pool_id: str
    backend: str
    hosts: list[HostStatus]
    starting_hosts: int
    free: int
    leased: int
    quarantined: int
    waiting: int
    leases_total: int
    calls_total: int
    calls_per_s: float
    lost_hosts: int
    # Monotonic event counters for operators (atropos/metrics.py exports them as Prometheus counters).
    scale_ups: int = Field(0, description="hosts started by scaling (demand, replacing a dead host, below min)")
    scale_downs: int = Field(0, description="idle hosts stopped by scaling")
    quarantines: int = Field(0, description="slots quarantined after a failed or refused reset")


class SlotPool:
    def __init__(self, backend: Backend, cfg: PoolConfig | None = None) -> None:
        self.backend = backend
        self.cfg = cfg or PoolConfig()
        self.hosts: dict[str, PoolHost] = {}
        self.audit = LeaseAudit(self.cfg.audit_path)
        self._waiters: deque[_Waiter] = deque()
        self._starting = 0
        self._scale = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._running = False
        self._leases_total = 0
        self._calls_total = 0
        self._call_times: deque[float] = deque(maxlen=10_000)
        self._lost_hosts = 0
        self._scale_ups = 0
        self._scale_downs = 0
        self._quarantines = 0

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Reap what crashed earlier pools left, start ``min_hosts`` hosts and the health and scaling
        loops. Raises the first error only when no host could start."""
        reaped = await self.backend.reap_orphans()
        if reaped:
            log.info("reaped %d orphaned host(s) of earlier pools", reaped)
        self._running = True
        results = await asyncio.gather(*(self._add_host() for _ in range(self.cfg.min_hosts)),
                                        return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and len(errors) == len(results):
            await self.stop()
            raise errors[0]
        self._spawn(self._health_loop())
        self._spawn(self._scale_loop())

    async def stop(self) -> None:
        """Stop every host and loop; leases still held become invalid. Safe to call twice."""
        self._running = False
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for waiter in self._waiters:
            if not waiter.future.done():
                waiter.future.set_exception(SlotUnavailable("the pool is stopping"))
        self._waiters.clear()
        hosts = list(self.hosts.values())
        self.hosts.clear()
        for host in hosts:
            for lease in host.leases.values():
                lease.lost = "the pool stopped"
            await host.client.aclose()
        await self.backend.close()
        self.audit.close()

    async def __aenter__(self) -> SlotPool:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- hosts -----------------------------------------------------------------------------
    async def _add_host(self) -> PoolHost:
        self._starting += 1
        info: HostInfo | None = None
        try:
            t0 = time.perf_counter()
            info = await self.backend.start_host()
            client = HostClient(info.address, info.token)
            host = PoolHost(info, client)
            leases = await asyncio.gather(*(
                client.lease(f"pool:{self.cfg.pool_id}", slot=i) for i in range(info.slots)))
            host.free = [(li.slot, li.lease, li.generation) for li in leases]
        except BaseException:
            if info is not None:
                await self.backend.stop_host(info.id)
            raise
        finally:
            self._starting -= 1
        self.hosts[host.id] = host
        log.info("scale: host %s up with %d slots in %.0f ms (%d hosts)", host.id, info.slots,
                 (time.perf_counter() - t0) * 1000, len(self.hosts))
        self._grant_waiters()
        return host

    async def _remove_host(self, host: PoolHost, reason: str) -> None:
        self.hosts.pop(host.id, None)
        host.free.clear()
        log.info("scale: host %s removed (%s); %d hosts left", host.id, reason, len(self.hosts))
        await host.client.aclose()
        await self.backend.stop_host(host.id)

    def declare_dead(self, host: PoolHost, reason: str) -> None:
        """Take ``host`` out of service: its leases are lost (their calls raise HostUnavailable)."""
        if host.dead.is_set():
            return
        host.dead_reason = reason
        host.dead.set()
        self._lost_hosts += 1
        log.error("host %s is dead (%s): failing %d lease(s)", host.id, reason, len(host.leases))
        for lease in list(host.leases.values()):
            lease.lost = reason
            self.audit.record("lost", lease.trajectory_id, host.id, lease.slot, lease.generation)
        host.leases.clear()
        self._spawn(self._remove_host(host, f"dead: {reason}"))
        self._scale.set()

    def suspect(self, host: PoolHost) -> None:
        """A call saw a transport error: check the host now instead of at the next health tick,
        and lease nothing more from it until a probe passes (a killed host's other free slots
        would otherwise be handed out in the moment before its death is confirmed)."""
        # once stopped, nothing may start: a probe through a closed client would fail with an
        # exception no one retrieves ("Task exception was never retrieved" at a normal end)
        if not host.dead.is_set() and self._running:
            host.suspected = True
            self._spawn(self._check_host(host, urgent=True))

    async def _check_host(self, host: PoolHost, urgent: bool = False) -> None:
        if host.dead.is_set():
            return
        if not await self.backend.alive(host.id):
            self.declare_dead(host, "the backend reports the host gone")
            return
        try:
            t0 = time.perf_counter()
            health = await host.client.health(timeout=self.cfg.health_timeout_s)
            host.last_health_ms = (time.perf_counter() - t0) * 1000
            healthy, why = health.ok, health.detail
        except AtroposSandboxError as exc:
            healthy, why = False, str(exc)
        if healthy:
            host.failures = 0
            if host.suspected:
                host.suspected = False
                self._grant_waiters()
            return
        host.failures += 1
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
        capacity = len(self.hosts) + self._starting
        demand = sum(len(w.ids) for w in self._waiters if not w.future.done())
        free = self.free_count()
        if capacity < self.cfg.max_hosts and (capacity < self.cfg.min_hosts or demand > free + self._starting_slots()):
            log.info("scale: starting a host (hosts %d, starting %d, waiting %d, free %d)",
                     len(self.hosts), self._starting, demand, free)
            self._spawn(self._add_host_logged())
            return
        now = time.monotonic()
        for host_id in self.backend.removal_order(list(self.hosts)):
            host = self.hosts.get(host_id)
            if host is None:
                continue
            idle = not host.leases and len(host.free) == host.info.slots
            if not idle:
                host.idle_since = None
                continue
            host.idle_since = host.idle_since or now
            if (len(self.hosts) > self.cfg.min_hosts and not demand
                    and now - host.idle_since >= self.cfg.scale_down_idle_s):
                self._scale_downs += 1
                await self._remove_host(host, f"idle for {now - host.idle_since:.0f}s")

    def _starting_slots(self) -> int:
        return self._starting * max((h.info.slots for h in self.hosts.values()), default=1)

    async def _add_host_logged(self) -> None:
        try:
            await self._add_host()
            self._scale_ups += 1
        except Exception as exc:
            log.error("scale: host start failed: %s", exc)
            await asyncio.sleep(self.cfg.start_retry_s)
            self._scale.set()

    # -- leasing ---------------------------------------------------------------------------
    def max_slots(self) -> int | None:
        """The most slots this pool can ever hold (None while the host size is unknown)."""
        per_host = max((h.info.slots for h in self.hosts.values()), default=None) or self.backend.host_slots()
        return None if per_host is None else per_host * self.cfg.max_hosts

    def free_count(self) -> int:
        """Slots that could be leased right now, on hosts that take leases."""
        return sum(len(h.free) for h in self.hosts.values() if h.leasable)

    def _take(self, trajectory_id: str, network: bool, host: PoolHost | None = None) -> Lease:
        # Spread over hosts (most free first): calls of different trajectories then rarely
        # share a host's CPU budget.
        if host is None:
            host = max((h for h in self.hosts.values() if h.free and h.leasable), key=lambda h: len(h.free))
        slot, token, generation = host.free.pop()
        lease = Lease(self, host, slot, token, generation, trajectory_id, network)
        host.leases[slot] = lease
        host.idle_since = None
        self._leases_total += 1
        self.audit.record("lease", trajectory_id, host.id, slot, generation)
        return lease

    def _grant_waiters(self) -> None:
        while self._waiters:
            waiter = self._waiters[0]
            if waiter.future.done():
                self._waiters.popleft()
                continue
            if self.free_count() < len(waiter.ids):
                return  # FIFO: a group at the head waits for its whole size
            self._waiters.popleft()
            waiter.future.set_result(self._take_group(waiter.ids, waiter.network, waiter.colocate, waiter.prefer))

    def _take_group(self, ids: list[str], network: bool, colocate: bool, prefer: frozenset[str]) -> list[Lease]:
        """Take one slot per id; with ``colocate`` on as few hosts as possible, preferring hosts
        in ``prefer`` (those that already hold the group's template: no shipping needed)."""
        if not colocate:
            return [self._take(t, network) for t in ids]
        hosts = sorted((h for h in self.hosts.values() if h.free and h.leasable),
                       key=lambda h: (h.id in prefer, len(h.free)), reverse=True)
        whole = [h for h in hosts if len(h.free) >= len(ids)]
        order = whole[:1] or hosts
        leases: list[Lease] = []
        for host in order:
            while host.free and len(leases) < len(ids):
                leases.append(self._take(ids[len(leases)], network, host))
        return leases

    async def lease(self, trajectory_id: str, timeout: float | None = None, *, network: bool = False,
                    template: PoolTemplate | None = None) -> Lease:
        """Lease one slot for a trajectory, waiting FIFO up to ``timeout`` seconds; with
        ``template`` the slot starts as a copy-on-write fork of it."""
        return (await self.lease_many([trajectory_id], timeout, network=network, template=template))[0]

    async def lease_many(self, trajectory_ids: Sequence[str], timeout: float | None = None, *,
                         network: bool = False, template: PoolTemplate | None = None,
                         colocate: bool | None = None) -> list[Lease]:
        """Lease one slot per id, all or nothing (a GRPO group starts together).

        ``template``: every slot starts as a fresh copy-on-write fork of it. ``colocate``
        (default: when a template is given) puts the group on as few hosts as possible,
        preferring hosts that already hold the template."""
        if not self._running:
            raise SlotUnavailable("the pool is not running")
        ids = list(trajectory_ids)
        # A single slot always fits (max_hosts >= 1, hosts have >= 1 slot): skip the walk over hosts.
        most = self.max_slots() if len(ids) > 1 else None
        if most is not None and len(ids) > most:
            raise GroupTooLarge(
                f"a group of {len(ids)} can never be leased: the pool holds at most {most} slots "
                f"(max_hosts {self.cfg.max_hosts} x {most // self.cfg.max_hosts} slots per host)")
        colocate = template is not None if colocate is None else colocate
        prefer = frozenset(template.copies) if template is not None else frozenset()
        if not self._waiters and self.free_count() >= len(ids):
            leases = self._take_group(ids, network, colocate, prefer)
        else:
            leases = await self._wait(ids, network, self.cfg.lease_timeout_s if timeout is None else timeout,
                                      colocate, prefer)
        if template is not None:
            await self._prepare_or_release(leases, lambda lease: lease.reset(template, network=network or None))
        elif network:
            await self._prepare_or_release(leases, self._enable_network)
        return leases

    async def _wait(self, ids: list[str], network: bool, timeout: float, colocate: bool = False,
                    prefer: frozenset[str] = frozenset()) -> list[Lease]:
        waiter = _Waiter(ids, network, colocate=colocate, prefer=prefer)
        self._waiters.append(waiter)
        self._scale.set()
        try:
            done, _ = await asyncio.wait({waiter.future}, timeout=timeout)
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise
        if not done:
            self._abandon(waiter)
            total = sum(h.info.slots for h in self.hosts.values())
            raise SlotUnavailable(
                f"no slot within {timeout:g}s for {len(ids)} trajectory(ies): pool has {total} slots on "
                f"{len(self.hosts)} host(s) (max {self.cfg.max_hosts}), {self.free_count()} free, "
                f"{len(self._waiters)} request(s) queued"
            )
        return waiter.future.result()

    def _abandon(self, waiter: _Waiter) -> None:
        if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
            # Granted in the same instant the caller gave up: give the slots straight back.
            for lease in waiter.future.result():
                self._begin_release(lease)
        else:
            waiter.future.cancel()
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)
        # The abandoned waiter may have been the head of the queue, holding back smaller
        # requests behind it that the free slots can serve now (FIFO waits for the head).
        self._grant_waiters()

    async def _enable_network(self, lease: Lease) -> None:
        result = await lease.host.guard(lease.host.client.reset(
            lease.slot, lease.token, trajectory_id=lease.trajectory_id, network=True))
        if not result.ok or result.lease is None:
            raise HostUnavailable(f"could not enable network on {lease!r}: {result.detail}")
        lease.token, lease.generation = result.lease.lease, result.lease.generation

    async def release(self, lease: Lease) -> None:
        """End a lease: the slot is reset and returns to the pool, or is quarantined. Idempotent."""
        reset = self._begin_release(lease)
        if reset is not None:
            # Shielded: a caller cancelled mid-release must not strand the slot half-reset.
            await asyncio.shield(reset)

    def _begin_release(self, lease: Lease) -> asyncio.Task[None] | None:
        """The synchronous part of ``release``: the lease ends now and its reset is already
        running when this returns, so no cancellation can come between the two."""
        if lease.released:
            return None
        lease.released = True
        host = lease.host
        if host.leases.get(lease.slot) is lease:
            del host.leases[lease.slot]
        self.audit.record("release", lease.trajectory_id, host.id, lease.slot, lease.generation)
        if lease.lost is not None or host.dead.is_set():
            return None
        return self._spawn(self._reset_back(host, lease))

    async def _prepare_or_release(self, leases: list[Lease], prepare: Callable[[Lease], Awaitable[object]]) -> None:
        """Run ``prepare`` on every lease of a fresh group; if any fails or the caller is
        cancelled, release the whole group before re-raising (all or nothing: the caller never
        saw these leases, so nobody else would ever give the slots back)."""
        steps = [asyncio.ensure_future(prepare(lease)) for lease in leases]
        try:
            await asyncio.gather(*steps)
        except BaseException:
            # Stop the siblings first: a prepare still rotating a slot's token would race the
            # release's reset (one of the two is then refused and the slot lost).
            for step in steps:
                step.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait(steps)
            # Started synchronously (not as gather'd coroutines, which a cancellation could
            # kill before their first step) and then awaited shielded.
            resets = [t for t in (self._begin_release(lease) for lease in leases) if t is not None]
            with contextlib.suppress(BaseException):
                await asyncio.shield(asyncio.gather(*resets, return_exceptions=True))
            raise

    async def _reset_back(self, host: PoolHost, lease: Lease) -> None:
        try:
            # network=False: a free slot never keeps the network a previous lease had.
            result = await host.guard(host.client.reset(lease.slot, lease.token, network=False,
                                                        trajectory_id=f"pool:{self.cfg.pool_id}"))
        except HostUnavailable:
            self.suspect(host)
            return
        except LeaseError as exc:
            self.quarantine(host, lease.slot, f"reset refused: {exc}")
            return
        if result.ok and result.lease is not None:
            host.free.append((lease.slot, result.lease.lease, result.lease.generation))
            self._grant_waiters()
        else:
            self.quarantine(host, lease.slot, result.detail)

    def quarantine(self, host: PoolHost, slot: int, why: str) -> None:
        """Count a slot that failed its reset: it never returns to the free list."""
        host.quarantined += 1
        self._quarantines += 1
        log.error("slot %s/%d quarantined: %s", host.id, slot, why)

    @contextlib.asynccontextmanager
    async def leased(self, trajectory_id: str, timeout: float | None = None, *,
                     network: bool = False, template: PoolTemplate | None = None) -> AsyncIterator[Lease]:
        """``async with pool.leased(tid) as lease:``: ``lease`` for the block, released after it
        (also on error or cancellation)."""
        lease = await self.lease(trajectory_id, timeout, network=network, template=template)
        try:
            yield lease
        finally:
            await self.release(lease)

    # -- templates -------------------------------------------------------------------------
    async def template_from_lease(self, lease: Lease, name: str = "") -> PoolTemplate:
        """Snapshot a leased slot's workspace (e.g. after a group's setup ran in it) as a
        template. The lease stays valid; its workspace becomes a fresh fork of the template."""
        lease.check()
        try:
            info = await lease.host.guard(lease.host.client.template_from_slot(lease.slot, lease.token, name=name))
        except HostUnavailable:
            self.suspect(lease.host)
            raise
        template = PoolTemplate(name=name, info=info, copies={lease.host.id: info.id})
        lease.template = template
        log.info("template %s (%s) made from %r: %d files, %.1f MB", info.id, name, lease, info.files,
                 info.bytes / 1e6)
        return template

    async def create_template(self, source: str, *, name: str = "", **fields: Any) -> PoolTemplate:
        """A template from a host-side source ("dir": path=, "git": url=, ref=, depth=) on one host."""
        host = self._template_host()
        info = await host.guard(host.client.create_template(source, name=name, **fields))
        return PoolTemplate(name=name, info=info, copies={host.id: info.id})

    async def upload_template(self, data: bytes | AsyncIterable[bytes], *, name: str = "",
                              gzip: bool = False) -> PoolTemplate:
        """A template from a tar archive, unpacked on one host (shipped to others on use)."""
        host = self._template_host()
        info = await host.guard(host.client.upload_template(data, name=name, gzip=gzip))
        return PoolTemplate(name=name, info=info, copies={host.id: info.id})

    def _template_host(self) -> PoolHost:
        live = [h for h in self.hosts.values() if not h.dead.is_set()]
        if not live:
            raise HostUnavailable("the pool has no live host")
        return max(live, key=lambda h: len(h.free))

    async def template_on(self, template: PoolTemplate, host: PoolHost) -> str:
        """The template's id on ``host``, shipping it there first (once) if needed."""
        if template.deleted:
            raise UnknownTemplate(f"template {template.id} was deleted")
        if host.id in template.copies:
            return template.copies[host.id]
        pending = template.shipping.get(host.id)
        if pending is None:
            pending = asyncio.ensure_future(self._ship(template, host))
            template.shipping[host.id] = pending
            pending.add_done_callback(lambda _f: template.shipping.pop(host.id, None))
        return await asyncio.shield(pending)

    async def _ship(self, template: PoolTemplate, host: PoolHost) -> str:
        sources = [self.hosts[h] for h in template.copies if h in self.hosts and not self.hosts[h].dead.is_set()]
        if not sources:
            raise WorkspaceError(f"template {template.id}: no live host holds it any more")
        source = sources[0]
        t0 = time.perf_counter()
        async with contextlib.aclosing(source.client.template_archive(template.copies[source.id])) as stream:
            info = await host.guard(host.client.upload_template(stream, name=template.name))
        if info.tree_hash != template.tree_hash:
            await host.client.delete_template(info.id)
            raise WorkspaceError(f"template {template.id} shipped to {host.id} arrived different "
                                 f"({info.tree_hash[:12]} != {template.tree_hash[:12]})")
        template.copies[host.id] = info.id
        log.info("template %s shipped %s -> %s (%.1f MB) in %.0f ms", template.id, source.id, host.id,
                 info.bytes / 1e6, (time.perf_counter() - t0) * 1000)
        return info.id

    async def fork(self, lease: Lease, template: PoolTemplate) -> None:
        """Reset a lease to a fresh copy-on-write fork of ``template`` (the lease is kept)."""
        await lease.reset(template)

    async def delete_template(self, template: PoolTemplate) -> None:
        """Delete every host's copy. Copies still in use (a slot built on them) stay and are
        logged; release or reset those slots first."""
        template.deleted = True
        for pending in list(template.shipping.values()):
            with contextlib.suppress(BaseException):
                await pending
        for host_id, template_id in list(template.copies.items()):
            host = self.hosts.get(host_id)
            if host is None or host.dead.is_set():
                template.copies.pop(host_id, None)
                continue
            try:
                await host.guard(host.client.delete_template(template_id))
                template.copies.pop(host_id, None)
            except UnknownTemplate:
                template.copies.pop(host_id, None)
            except (TemplateInUse, HostUnavailable) as exc:
                log.warning("template %s on %s not deleted: %s", template_id, host_id, exc)

    # -- status ----------------------------------------------------------------------------
    def count_call(self, n: int = 1) -> None:
        """Count ``n`` tool calls for ``status()`` (the calls/s rate and the total)."""
        self._calls_total += n
        now = time.monotonic()
        for _ in range(min(n, 100)):
            self._call_times.append(now)

    def status(self) -> PoolStatus:
        """A snapshot: hosts, free/leased slots, lease ages, calls, scaling and quarantine counts."""
        now = time.monotonic()
        hosts = []
        for h in self.hosts.values():
            ages = [now - lease.leased_at for lease in h.leases.values()]
            hosts.append(HostStatus(
                id=h.id, address=h.info.address, slots=h.info.slots, free=len(h.free), leased=len(h.leases),
                quarantined=h.quarantined, healthy=h.leasable and h.failures == 0,
                health_ms=None if h.last_health_ms is None else round(h.last_health_ms, 2),
                oldest_lease_s=round(max(ages), 1) if ages else None, node=h.info.labels.get("node"),
            ))
        recent = [t for t in self._call_times if now - t <= 10.0]
        return PoolStatus(
            pool_id=self.cfg.pool_id, backend=self.backend.name, hosts=hosts, starting_hosts=self._starting,
            free=sum(h.free for h in hosts), leased=sum(h.leased for h in hosts),
            quarantined=sum(h.quarantined for h in hosts),
            waiting=sum(len(w.ids) for w in self._waiters if not w.future.done()),
            leases_total=self._leases_total, calls_total=self._calls_total,
            calls_per_s=round(len(recent) / 10.0, 2), lost_hosts=self._lost_hosts,
            scale_ups=self._scale_ups, scale_downs=self._scale_downs, quarantines=self._quarantines,
        )
