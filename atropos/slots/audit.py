"""The lease audit: every grant and return of a slot, so double leases can be proven absent."""

from __future__ import annotations

import json
import time
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
    def __init__(self, path: Path | None = None, keep: int = 100_000) -> None:
        self.path = path
        self.keep = keep
        self.events: list[AuditEvent] = []
        self._fh = open(path, "a", buffering=1) if path else None

    def record(self, event: Event, trajectory_id: str, host: str, slot: int, generation: int) -> None:
        entry = AuditEvent(ts=time.time(), event=event, trajectory_id=trajectory_id, host=host, slot=slot,
                           generation=generation)
        self.events.append(entry)
        if len(self.events) > self.keep:
            del self.events[: len(self.events) - self.keep]
        if self._fh is not None:
            self._fh.write(entry.model_dump_json() + "\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def double_leases(events: list[AuditEvent]) -> list[str]:
    """Slots held by two trajectories at once, from an audit trail (empty means none)."""
    holder: dict[tuple[str, int], str] = {}
    problems = []
    for e in sorted(events, key=lambda e: e.ts):
        key = (e.host, e.slot)
        if e.event == "lease":
            if key in holder:
                problems.append(f"{key} leased to {e.trajectory_id} while held by {holder[key]}")
            holder[key] = e.trajectory_id
        elif holder.get(key) == e.trajectory_id:
            del holder[key]
    return problems


def load(path: Path) -> list[AuditEvent]:
    return [AuditEvent.model_validate(json.loads(line)) for line in path.read_text().splitlines() if line]
