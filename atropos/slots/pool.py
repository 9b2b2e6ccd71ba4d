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
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from atropos.errors import GroupTooLarge, HostUnavailable, LeaseError, SlotUnavailable
from atropos.slots.lease import Lease, PoolHost, PoolTemplate
from atropos.slots.pool_base import _Waiter
from atropos.slots.pool_status import HostStatus, PoolStatus
from atropos.slots.pool_templates import PoolTemplates

__all__ = ["GroupTooLarge", "HostStatus", "PoolStatus", "SlotPool"]

log = logging.getLogger(__name__)


class SlotPool(PoolTemplates):
    """The pool. Its parts: state and queue (pool_base.py), hosts, health and scaling (pool_hosts.py),
    templates (pool_templates.py), status models (pool_status.py); leasing and release are here."""

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Reap what crashed earlier pools left, start ``min_hosts`` hosts and the health and scaling
        loops. Raises the first error only when no host could start."""
        reaped = await self.backend.reap_orphans()
        if reaped:
            log.info("reaped %d orphaned host(s) of earlier pools", reaped)
        self._running = True
        # No host prewarms while others still start (on a shared machine the first hosts' sandboxes
        # would take the CPU the last ones need to come up): the fleet is asked once all of it is up.
        results = await asyncio.gather(*(self._add_host(prewarm=False) for _ in range(self.cfg.min_hosts)),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and len(errors) == len(results):
            await self.stop()
            raise errors[0]
        self._request_prewarm([r for r in results if not isinstance(r, BaseException)])
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

    # -- leasing ---------------------------------------------------------------------------
    def max_slots(self) -> int | None:
        """The most slots this pool can ever hold (None while the host size is unknown)."""
        per_host = max((h.info.slots for h in self.hosts.values()), default=None) or self.backend.host_slots()
        return None if per_host is None else per_host * self.cfg.max_hosts

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
            leases = await self._wait(ids, network, self.cfg.acquire_timeout_s if timeout is None else timeout,
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
