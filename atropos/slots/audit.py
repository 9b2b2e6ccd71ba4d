"""The lease audit: every grant and return of a slot, so double leases can be proven absent."""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

Event = Literal["lease", "release", "lost"]


class AuditEvent(BaseModel):
    ts: float
    event: Event
    trajectory_id: str
    host: str
    slot: int
    generation: int


class LeaseAudit:
    """Records every lease event, and checks for double leases as they happen.

    An RL run leases millions of slots, so nothing here grows with the number of leases: the
    check keeps only the current holder of each slot (``double_leased`` counts every violation
    over the whole run, ``problems`` keeps the first few), ``events`` keeps the latest ``keep``
    events, and the full trail is streamed to ``path`` (one JSON line each) when one is given."""

    MAX_PROBLEMS = 100

    def __init__(self, path: Path | None = None, keep: int = 2048) -> None:
        self.path = path
        self.keep = keep
        self.events: deque[AuditEvent] = deque(maxlen=keep)
        self.holders: dict[tuple[str, int], str] = {}  # (host, slot) -> trajectory holding it now
        self.double_leased = 0
        self.problems: list[str] = []
        self._fh = open(path, "a", buffering=1) if path else None

    def record(self, event: Event, trajectory_id: str, host: str, slot: int, generation: int) -> None:
        entry = AuditEvent(ts=time.time(), event=event, trajectory_id=trajectory_id, host=host, slot=slot,
                           generation=generation)
        self.events.append(entry)
        problem = _advance(self.holders, entry)
        if problem is not None:
            self.double_leased += 1
            if len(self.problems) < self.MAX_PROBLEMS:
                self.problems.append(problem)
        if self._fh is not None:
            self._fh.write(entry.model_dump_json() + "\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _advance(holder: dict[tuple[str, int], str], e: AuditEvent) -> str | None:
    """Apply one event to the slots' current holders; the double lease it reveals, if any."""
    key = (e.host, e.slot)
    if e.event == "lease":
        problem = f"{key} leased to {e.trajectory_id} while held by {holder[key]}" if key in holder else None
        holder[key] = e.trajectory_id
        return problem
    if holder.get(key) == e.trajectory_id:
        del holder[key]
    return None


def double_leases(events: Iterable[AuditEvent]) -> list[str]:
    """Slots held by two trajectories at once, from an audit trail (empty means none)."""
    holder: dict[tuple[str, int], str] = {}
    return [p for e in sorted(events, key=lambda e: e.ts) if (p := _advance(holder, e)) is not None]


def load(path: Path) -> list[AuditEvent]:
    return [AuditEvent.model_validate(json.loads(line)) for line in path.read_text().splitlines() if line]
