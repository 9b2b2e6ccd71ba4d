"""One ``start_host()``: claim a spare, or reserve the allocation a scale-up or a reschedule will bring.

A start first adopts a spare (a live allocation nobody uses: no scale call, often already warm). With
none, it waits up to ``REPLACEMENT_WAIT_S`` for a replacement Nomad is about to place for a failed
allocation, else it scales the group up by one. A start that scaled (or waits for a replacement)
holds a reservation in the ledger, which gives it the first claim on the next spare; other starts
take only spares beyond the reservations. An allocation that dies while starting is replaced by
Nomad (new ID, same name); that replacement is this start's. A task that cannot even start
(``Driver Failure`` ...) fails the start at once with Nomad's message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from atropos.backends.base import HostInfo
from atropos.backends.nomad.allocs import AllocDied, describe_alloc
from atropos.backends.nomad.job import GROUP
from atropos.backends.nomad.ledger import Reservation
from atropos.errors import HostUnavailable

if TYPE_CHECKING:
    from atropos.backends.nomad.backend import NomadBackend

log = logging.getLogger(__name__)

REPLACEMENT_WAIT_S = 15.0  # a start waits this long for a rescheduled replacement before scaling up
PLACEMENT_KEYS = ("NodesEvaluated", "NodesFiltered", "NodesAvailable", "NodesExhausted", "ConstraintFiltered",
                  "DimensionExhausted")


class HostStart:
    """The state of one start: what it claimed or reserved, whether it scaled, what killed its last
    allocation. ``run()`` returns the host or raises ``HostUnavailable``; on any failure it gives
    back what it took."""

    def __init__(self, backend: NomadBackend, deadline: float) -> None:
        self.backend = backend
        self.ledger = backend.ledger
        self.deadline = deadline
        self.scaled = False
        self.reserved: Reservation | None = None
        self.wait_until = deadline
        self.alloc_id: str | None = None
        self.last: str | None = None  # what killed an earlier allocation of this start

    async def run(self) -> HostInfo:
        try:
            while True:
                if self.alloc_id is None:
                    await self._claim()
                if self.alloc_id is None:
                    await self._wait_or_scale()
                    continue
                info = await self._bring_up(self.alloc_id)
                if info is not None:
                    return info
        except asyncio.TimeoutError:
            raise HostUnavailable(await self._failure()) from None
        except BaseException:
            with contextlib.suppress(Exception):
                await self.backend.give_back_start(self.alloc_id, self.scaled)
            raise
        finally:
            self._reserve(None)

    def _reserve(self, kind: Reservation | None, until: float | None = None) -> None:
        self.ledger.unreserve(self.reserved)
        self.reserved = kind
        if kind is not None:
            self.ledger.reserve(kind)
            self.wait_until = self.deadline if until is None else until

    async def _claim(self) -> None:
        async with self.backend.lock:
            alloc = self.ledger.claim_spare(self.reserved)
        if alloc is None:
            return
        self.alloc_id = alloc["ID"]
        log.debug("start claims %s (%s, %s)", self.alloc_id[:8], alloc.get("Name"), alloc.get("ClientStatus"))
        if self.reserved is None and not self.scaled:
            self.backend.stats["adopted"] += 1
        self.reserved = None  # claim_spare dropped it

    async def _wait_or_scale(self) -> None:
        """Wait for what this start reserved, or reserve: a coming replacement, else a scale-up."""
        if self.reserved == "replacement" and (time.monotonic() >= self.wait_until
                                               or self.ledger.replacements_due() == 0):
            self._reserve(None)  # no replacement (any more): scale up instead
        if self.reserved is not None:
            try:
                await self.ledger.wait_change(self.wait_until)
            except asyncio.TimeoutError:
                if self.reserved == "scale":
                    raise
            return
        if not self.scaled and self.ledger.replacement_wanted():
            self._reserve("replacement", min(self.deadline, time.monotonic() + REPLACEMENT_WAIT_S))
            return
        await self.backend.scale_up(self.deadline)
        self.scaled = True
        self._reserve("scale")

    async def _bring_up(self, alloc_id: str) -> HostInfo | None:
        """The claimed allocation as a host, or None when it died (Nomad's replacement is reserved)."""
        try:
            return await self.backend.await_host(alloc_id, self.deadline)
        except AllocDied as died:
            self.last = str(died)
            log.warning("nomad host %s died while starting: %s", alloc_id[:8], died)
            self.ledger.unclaim(alloc_id)
            self.alloc_id = None
            if died.start_error:
                # Not a crash but a container that cannot start: waiting out start_timeout_s
                # would only hide it. Nomad's replacement stays a spare for the next start.
                raise HostUnavailable(
                    f"Nomad could not start a sandbox host of job {self.backend.cfg.job_id!r}: {died.start_error} "
                    f"({died}); check the client's docker plugin configuration (nomad/client.hcl) "
                    "and the image") from None
            self._reserve("scale")
            return None

    async def _failure(self) -> str:
        cfg = self.backend.cfg
        msg = f"no Nomad sandbox host of job {cfg.job_id!r} became ready within {cfg.start_timeout_s:g}s"
        last = self.last
        alloc = self.ledger.alloc(self.alloc_id) if self.alloc_id is not None else None
        if alloc is not None:
            current = describe_alloc(alloc)
            # Keep what killed an earlier allocation of this start: the current one may only be pending.
            last = current if last in (None, current) else f"{current}; before it: {last}"
        msg += f" (last: {last or 'no allocation was placed'})"
        with contextlib.suppress(Exception):
            msg += await self._placement_problem()
        with contextlib.suppress(Exception):
            await self.backend.give_back_start(self.alloc_id, self.scaled)
        return msg

    async def _placement_problem(self) -> str:
        evals = await self.backend.api.evaluations()
        for ev in sorted(evals, key=lambda e: e.get("CreateIndex", 0), reverse=True):
            failed = ev.get("FailedTGAllocs") or {}
            if failed:
                m = failed.get(GROUP) or next(iter(failed.values()))
                detail = ", ".join(f"{k}={m.get(k)}" for k in PLACEMENT_KEYS if m.get(k))
                return f"; Nomad could not place it: {detail or m}"
        return ""
