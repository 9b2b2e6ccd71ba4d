"""The SlotPool's slot queue: taking free slots off hosts for leases, and the FIFO queue of
requests waiting for slots (a group at the head waits for its whole size).

A request for a task image never takes a slot on a host that refused that image lately (its
``avoid``: a Ray node without the image, a store with no room): it waits for a host that accepts
it, in its turn, rather than failing because the only free slot is on a host that will refuse it.
A request behind it may take the slots it cannot use (those of the hosts it avoids) meanwhile,
never one it could."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from atropos.errors import SlotUnavailable
from atropos.slots.audit import LeaseAudit
from atropos.slots.grant_wait import await_grant, drop_grant
from atropos.slots.lease import Lease, PoolHost
from atropos.slots.pool_hosts import HostFleet

if TYPE_CHECKING:
    from atropos.slots.pool import SlotPool


@dataclass
class _Waiter:
    ids: list[str]
    network: bool
    future: asyncio.Future[list[Lease]] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    colocate: bool = False
    prefer: frozenset[str] = frozenset()
    image: str | None = None
    avoid: frozenset[str] = frozenset()  # hosts that refused ``image``: never taken for it


class SlotQueue:
    """Owns the waiters and the lease count; reads the fleet's hosts, takes slots through them."""

    def __init__(self, pool: SlotPool, fleet: HostFleet, audit: LeaseAudit,
                 release: Callable[[Lease], object]) -> None:
        self._pool = pool  # only handed to the leases it makes (their calls go through the pool)
        self._fleet = fleet
        self._audit = audit
        self._release = release  # the pool's synchronous release, for grants nobody took
        self._waiters: deque[_Waiter] = deque()
        self.leases_total = 0

    def waiting(self) -> int:
        """Slots asked for by requests still waiting."""
        return sum(len(w.ids) for w in self._waiters if not w.future.done())

    def demand(self) -> int:
        """What the fleet scales for: the slots waited for, plus the free slots of hosts a waiter
        avoids (free, but not for it: without them the fleet would see enough free slots and never
        start the host it waits for)."""
        live = [w for w in self._waiters if not w.future.done()]
        avoided = frozenset().union(*(w.avoid for w in live)) if live else frozenset()
        return sum(len(w.ids) for w in live) + (
            self._fleet.free_count() - self._fleet.free_count(avoided) if avoided else 0)

    def can_take_now(self, n: int, avoid: frozenset[str] = frozenset()) -> bool:
        """Whether ``n`` slots may be taken without waiting (nobody queued ahead, enough free on
        hosts not in ``avoid``)."""
        return not self._waiters and self._fleet.free_count(avoid) >= n

    def fail_all(self, why: str) -> None:
        """The pool stops: every waiting request fails with SlotUnavailable."""
        for waiter in self._waiters:
            if not waiter.future.done():
                waiter.future.set_exception(SlotUnavailable(why))
        self._waiters.clear()

    def _take(self, trajectory_id: str, network: bool, host: PoolHost | None = None,
              image: str | None = None, avoid: frozenset[str] = frozenset()) -> Lease:
        # Spread over hosts (most free first): calls of different trajectories then rarely
        # share a host's CPU budget. A host that refused the image is not taken.
        if host is None:
            host = max((h for h in self._fleet.hosts.values() if h.free and h.leasable and h.id not in avoid),
                       key=lambda h: len(h.free))
        slot, token, generation, root = host.take_free(image)
        lease = Lease(self._pool, host, slot, token, generation, trajectory_id, network, image=root)
        host.hold(lease)
        self.leases_total += 1
        self._audit.record("lease", trajectory_id, host.id, slot, generation)
        return lease

    def _grant_waiters(self) -> None:
        """FIFO: a group at the head waits for its whole size. A waiter that avoids hosts (they
        refused its image) claims only the others: a waiter behind it may be granted slots of the
        hosts every waiter ahead of it avoids, never a slot one of them could take."""
        claimed: set[str] = set()  # hosts some waiter ahead still waits for
        everyone = set(self._fleet.hosts)
        for waiter in list(self._waiters):
            if waiter.future.done():
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
                continue
            avoid = waiter.avoid | frozenset(claimed)
            if self._fleet.free_count(avoid) < len(waiter.ids):
                claimed |= everyone - waiter.avoid
                if claimed >= everyone:
                    return
                continue
            self._waiters.remove(waiter)
            waiter.future.set_result(self._take_group(waiter.ids, waiter.network, waiter.colocate, waiter.prefer,
                                                      waiter.image, avoid))

    def _take_group(self, ids: list[str], network: bool, colocate: bool, prefer: frozenset[str],
                    image: str | None = None, avoid: frozenset[str] = frozenset()) -> list[Lease]:
        """Take one slot per id; with ``colocate`` on as few hosts as possible, preferring hosts
        in ``prefer`` (those that already hold the group's template: no shipping needed); slots
        whose root is already ``image`` first (see ``PoolHost.take_free``); never on hosts in
        ``avoid`` (they refused the image)."""
        if not colocate:
            return [self._take(t, network, image=image, avoid=avoid) for t in ids]
        hosts = sorted((h for h in self._fleet.hosts.values() if h.free and h.leasable and h.id not in avoid),
                       key=lambda h: (h.id in prefer, len(h.free)), reverse=True)
        whole = [h for h in hosts if len(h.free) >= len(ids)]
        order = whole[:1] or hosts
        leases: list[Lease] = []
        for host in order:
            while host.free and len(leases) < len(ids):
                leases.append(self._take(ids[len(leases)], network, host, image))
        return leases

    async def _wait(self, ids: list[str], network: bool, timeout: float, colocate: bool = False,
                    prefer: frozenset[str] = frozenset(), image: str | None = None,
                    avoid: frozenset[str] = frozenset()) -> list[Lease]:
        waiter = _Waiter(ids, network, colocate=colocate, prefer=prefer, image=image, avoid=avoid)
        self._waiters.append(waiter)
        self._grant_waiters()  # slots the waiters ahead avoid may be this one's at once
        self._fleet.rescale()
        leases = await await_grant(waiter.future, timeout, lambda: self._abandon(waiter))
        if leases is None:
            hosts = self._fleet.hosts
            total = sum(h.info.slots for h in hosts.values())
            refused = (f" ({self._fleet.free_count() - self._fleet.free_count(avoid)} of them on hosts that "
                       f"refused {image!r}: {', '.join(sorted(avoid))})" if avoid else "")
            raise SlotUnavailable(
                f"no slot within {timeout:g}s for {len(ids)} trajectory(ies): pool has {total} slots on "
                f"{len(hosts)} host(s) (max {self._fleet.cfg.max_hosts}), {self._fleet.free_count()} free"
                f"{refused}, {len(self._waiters)} request(s) queued"
            )
        return leases

    def _abandon(self, waiter: _Waiter) -> None:
        drop_grant(waiter.future, lambda leases: [self._release(lease) for lease in leases])
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)
        # The abandoned waiter may have been the head of the queue, holding back smaller
        # requests behind it that the free slots can serve now (FIFO waits for the head).
        self._grant_waiters()
