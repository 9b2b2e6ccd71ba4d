"""Which allocation of the job is what to the pool: the Nomad backend's whole state, and its moves.

Nomad knows allocations; the pool knows hosts. Between them every live allocation is exactly one of:

* **claimed**: handed to the pool as a host (``hand_out``), or being started for it (``claim_spare``);
* **retired**: given back by the pool while still running, waiting to be stopped (``retire``);
* **removing**: stopped by us (a count change or an allocation stop), until Nomad reports it gone;
* **suspect**: given back dead while Nomad still says running; Nomad gets a grace to notice (then it
  reschedules it, and the replacement is a spare) before it is treated as hung and retired;
* **spare**: usable and none of the above: adoptable by the next start, trimmed after
  ``spare_grace_s`` (``unclaimed_since`` remembers since when).

The cache of Nomad's allocations (``apply``, from the watch's blocking query) drives the moves Nomad
makes on its own: an allocation that failed, stopped or vanished leaves retired, removing and
suspect by itself. Starts reserve the spare a scale-up (``"scale"``) or a pending reschedule
(``"replacement"``) will bring, so that two starts never count on the same one.

No I/O here: the backend (``atropos/backends/nomad/backend.py``) asks Nomad and tells the ledger; the
ledger's unit tests (tests/test_nomad_ledger.py) drive it with allocation dicts and a clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from atropos.backends.base import HostInfo
from atropos.backends.nomad.allocs import (
    LIVE_CLIENT,
    Alloc,
    awaits_reschedule,
    index_of,
    is_live,
    is_running,
    is_usable,
    restarts,
)
from atropos.backends.nomad.job import GROUP

Role = Literal["used", "idle", "removable"]
Reservation = Literal["scale", "replacement"]


@dataclass
class LedgerHost:
    """An allocation handed to the pool as a host, with its restart count at that moment."""

    alloc_id: str
    name: str
    restarts: int
    info: HostInfo


@dataclass
class NameRoles:
    """The job's live allocations by name index (``job.hosts[i]``), and the roles they play: Nomad's
    scale-down removes the highest names, so what may go depends on what sits above it."""

    by_name: dict[int, list[Alloc]] = field(default_factory=dict)
    roles: dict[int, set[Role]] = field(default_factory=dict)

    @property
    def placed(self) -> int:
        return len(self.by_name)

    def removable_top(self) -> list[int]:
        """The highest names whose every allocation may go, down to the first that may not."""
        top: list[int] = []
        for idx in sorted(self.by_name, reverse=True):
            if self.roles[idx] != {"removable"}:
                break
            top.append(idx)
        return top

    def highest_used(self) -> int:
        return max((idx for idx, r in self.roles.items() if "used" in r), default=-1)

    def allocs_at(self, names: list[int]) -> list[Alloc]:
        return [a for idx in names for a in self.by_name[idx]]


class AllocationLedger:
    """The allocations of one job as the pool sees them. Not thread-safe: one event loop."""

    def __init__(self, spare_grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.spare_grace_s = spare_grace_s
        self._clock = clock
        self._allocs: dict[str, Alloc] = {}  # the watch cache: our group's allocations by ID
        self._index = 0  # X-Nomad-Index of the listing in the cache
        self._changed = asyncio.Event()
        self._hosts: dict[str, LedgerHost] = {}
        self._claimed: set[str] = set()
        self._retired: set[str] = set()
        self._removing: set[str] = set()
        self._suspects: dict[str, float] = {}  # -> when it counts as hung (inf: being probed)
        self._unclaimed_since: dict[str, float] = {}
        self._pending_starts = 0
        self._reserved: dict[Reservation, int] = {"scale": 0, "replacement": 0}

    # -- the cache ------------------------------------------------------------------------------
    def apply(self, stubs: list[Alloc], index: int) -> bool:
        """Replace the cache with a listing unless it is older than the cache (then False), and let
        what Nomad did meanwhile end the states it ends."""
        if index < self._index:
            return False
        self._index = index
        self._allocs = {a["ID"]: a for a in stubs if a.get("TaskGroup", GROUP) == GROUP}
        self._retired = {a for a in self._retired if self.usable(a)}  # Nomad stopped or replaces the rest
        self._removing &= {a for a, x in self._allocs.items() if is_live(x)}
        # a suspect Nomad noticed: it reschedules it (or it is gone)
        self._suspects = {a: t for a, t in self._suspects.items() if self.usable(a)}
        self._track_spares()
        self._changed.set()
        self._changed = asyncio.Event()
        return True

    def forget_index(self) -> None:
        """The next listing is the truth whatever its index (a fresh read, e.g. after an agent restart)."""
        self._index = 0

    def _track_spares(self) -> None:
        now = self._clock()
        spares = set(self.spare_ids())
        self._unclaimed_since = {a: self._unclaimed_since.get(a, now) for a in spares}

    async def wait_change(self, deadline: float) -> None:
        """Until the cache changes (at most ~1 s, so callers re-check); TimeoutError past ``deadline``
        (on the ledger's clock)."""
        event = self._changed
        remaining = deadline - self._clock()
        if remaining <= 0:
            raise asyncio.TimeoutError
        try:
            await asyncio.wait_for(event.wait(), min(remaining, 1.0))
        except asyncio.TimeoutError:
            if self._clock() >= deadline:
                raise

    # -- queries ----------------------------------------------------------------------------------
    def alloc(self, alloc_id: str) -> Alloc | None:
        return self._allocs.get(alloc_id)

    def allocations(self) -> list[Alloc]:
        return list(self._allocs.values())

    def usable(self, alloc_id: str) -> bool:
        alloc = self._allocs.get(alloc_id)
        return alloc is not None and is_usable(alloc)

    def spares(self) -> list[Alloc]:
        """Usable allocations nobody uses, running ones and lowest names first."""
        taken = self._claimed | self._retired | self._removing | set(self._suspects)
        spares = [a for a in self._allocs.values() if is_usable(a) and a["ID"] not in taken]
        return sorted(spares, key=lambda a: (a.get("ClientStatus") != "running", index_of(a)))

    def spare_ids(self) -> list[str]:
        return [a["ID"] for a in self.spares()]

    def replacements_due(self) -> int:
        """Names whose allocation failed (or is suspect) and that Nomad has yet to reschedule: a
        spare is coming for each."""
        return len({index_of(a) for a in self._allocs.values() if awaits_reschedule(a) or a["ID"] in self._suspects})

    def alive(self, host_id: str) -> bool:
        """Handed out, running, and not restarted since (a restarted host lost every lease)."""
        host, alloc = self._hosts.get(host_id), self._allocs.get(host_id)
        return host is not None and alloc is not None and is_running(alloc) and restarts(alloc) == host.restarts

    def removal_order(self, host_ids: list[str]) -> list[str]:
        """Highest name index first: a scale-down stops exactly those."""
        def key(host_id: str) -> int:
            host = self._hosts.get(host_id)
            return index_of({"Name": host.name} if host else self._allocs.get(host_id) or {})

        return sorted(host_ids, key=key, reverse=True)

    def is_claimed(self, alloc_id: str) -> bool:
        return alloc_id in self._claimed

    def is_retired(self, alloc_id: str) -> bool:
        return alloc_id in self._retired

    def is_removing(self, alloc_id: str) -> bool:
        return alloc_id in self._removing

    def is_suspect(self, alloc_id: str) -> bool:
        return alloc_id in self._suspects

    def has_retired(self) -> bool:
        return bool(self._retired)

    @property
    def pending_starts(self) -> int:
        return self._pending_starts

    def reserved(self, kind: Reservation | None = None) -> int:
        return sum(self._reserved.values()) if kind is None else self._reserved[kind]

    # -- starting a host ------------------------------------------------------------------------
    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """A start is under way: spares are not trimmed meanwhile."""
        self._pending_starts += 1
        try:
            yield
        finally:
            self._pending_starts -= 1

    def claim_spare(self, reserved: Reservation | None) -> Alloc | None:
        """The best spare, claimed, if this start may take one: a start holding a reservation has the
        first claim; others only take spares beyond every reservation. Drops the reservation."""
        spares = self.spares()
        if len(spares) <= (0 if reserved else self.reserved()):
            return None
        alloc = spares[0]
        self._claimed.add(alloc["ID"])
        self.unreserve(reserved)
        return alloc

    def reserve(self, kind: Reservation) -> None:
        self._reserved[kind] += 1

    def unreserve(self, kind: Reservation | None) -> None:
        if kind is not None:
            self._reserved[kind] -= 1

    def replacement_wanted(self) -> bool:
        """A failed name Nomad will reschedule that no start has reserved yet."""
        return self.replacements_due() > self._reserved["replacement"]

    def unclaim(self, alloc_id: str) -> None:
        """A claimed allocation died while starting (Nomad replaces it; the replacement is a spare)."""
        self._claimed.discard(alloc_id)

    def hand_out(self, alloc: Alloc, info: HostInfo) -> None:
        """A claimed allocation answers: it is now a host of the pool."""
        self._claimed.add(alloc["ID"])
        self._hosts[alloc["ID"]] = LedgerHost(alloc["ID"], alloc.get("Name", ""), restarts(alloc), info)

    def abandon_start(self, alloc_id: str) -> None:
        """A start failed holding this allocation: give it back like a host."""
        self._claimed.discard(alloc_id)
        self._hosts.pop(alloc_id, None)
        self.retire(alloc_id)

    # -- giving a host back ---------------------------------------------------------------------
    def release(self, host_id: str) -> LedgerHost | None:
        """The pool gives a host back: it is no longer claimed (the caller decides what next)."""
        self._claimed.discard(host_id)
        return self._hosts.pop(host_id, None)

    def retire(self, alloc_id: str) -> bool:
        """To be stopped, if still usable (else Nomad already stops or replaces it): False."""
        if not self.usable(alloc_id):
            return False
        self._retired.add(alloc_id)
        return True

    def suspect(self, alloc_id: str) -> None:
        """Being probed: not a spare a concurrent start could claim, and not retired yet."""
        self._suspects[alloc_id] = math.inf

    def suspect_for(self, alloc_id: str, grace_s: float) -> None:
        """Did not answer: Nomad has ``grace_s`` to report it (unless it already has)."""
        if alloc_id in self._suspects:
            self._suspects[alloc_id] = self._clock() + grace_s

    def clear_suspect(self, alloc_id: str) -> None:
        self._suspects.pop(alloc_id, None)

    def next_suspect_in(self) -> float | None:
        """Seconds until the first suspect's grace runs out (None: no suspect)."""
        return min(self._suspects.values()) - self._clock() if self._suspects else None

    # -- tidying ----------------------------------------------------------------------------------
    def tidy_due(self) -> bool:
        """Anything to give back: retired ones, hung suspects, spares past their grace."""
        now = self._clock()
        if self._retired or self._expired_suspects(now):
            return True
        return any(now - self._unclaimed_since.get(a["ID"], now) >= self.spare_grace_s for a in self.spares())

    def _expired_suspects(self, now: float) -> list[str]:
        return [alloc_id for alloc_id, deadline in self._suspects.items() if deadline <= now]

    def retire_expired_suspects(self) -> None:
        """Suspects Nomad never reported within their grace are hung hosts: stop them."""
        for alloc_id in self._expired_suspects(self._clock()):
            del self._suspects[alloc_id]
            self._retired.add(alloc_id)

    def role(self, alloc: Alloc, now: float) -> Role:
        """used: a host in use (or in a state we cannot judge); removable: retired, or a spare past its
        grace; idle: neither (a spare in its grace, a failed one Nomad replaces, one being stopped, a
        suspect Nomad has yet to report)."""
        alloc_id = alloc["ID"]
        if alloc_id in self._claimed:
            return "used"
        status = alloc.get("ClientStatus")
        if status == "failed" or alloc_id in self._removing or alloc_id in self._suspects:
            return "idle"
        if status not in LIVE_CLIENT:
            return "used"  # e.g. "unknown" (client disconnected): leave it alone
        if alloc_id in self._retired:
            return "removable"
        since = self._unclaimed_since.get(alloc_id, now)
        if self._pending_starts == 0 and now - since >= self.spare_grace_s:
            return "removable"
        return "idle"

    def name_roles(self, allocs: list[Alloc]) -> NameRoles:
        """The live ones of ``allocs`` (a fresh listing) by name, with their roles now."""
        now = self._clock()
        view = NameRoles()
        for a in allocs:
            if is_live(a):
                view.by_name.setdefault(index_of(a), []).append(a)
        view.roles = {idx: {self.role(a, now) for a in group} for idx, group in view.by_name.items()}
        return view

    def scaled_away(self, allocs: list[Alloc]) -> None:
        """A lowered count stops these: removing until Nomad reports them gone."""
        for a in allocs:
            self._retired.discard(a["ID"])
            self._removing.add(a["ID"])
            self._unclaimed_since.pop(a["ID"], None)

    def retired_to_stop(self, allocs: list[Alloc], highest_used: int) -> list[Alloc]:
        """Retired allocations a host in use sits above (lowering the count would hit that host), so
        they must be stopped one by one; retired ones no longer usable in ``allocs`` are dropped."""
        by_id = {a["ID"]: a for a in allocs}
        stop = []
        for alloc_id in sorted(self._retired):
            alloc = by_id.get(alloc_id)
            if alloc is None or not is_usable(alloc):
                self._retired.discard(alloc_id)
            elif index_of(alloc) <= highest_used:
                stop.append(alloc)
        return stop

    def stopping(self, alloc_id: str) -> None:
        """Stopped by us: until the watch shows it, the cache still says running, and it must not
        pass for a spare that the next start would adopt."""
        self._retired.discard(alloc_id)
        self._removing.add(alloc_id)

    def forget_hosts(self) -> None:
        """Closing: no host is the pool's any more."""
        self._hosts.clear()
        self._claimed.clear()
        self._suspects.clear()
