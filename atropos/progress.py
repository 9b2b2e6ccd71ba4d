"""Progress lines for long runs (``process`` of an env, the demo): one line per completed group.

A line, not a redrawn bar: runs mostly end up in log files and CI output, where carriage returns
make a mess, and one line per group is rare enough (seconds apart) to stay readable::

    [atropos-sandbox] group 3/10  rollouts 24  tool calls 311  12.4 calls/s  elapsed 25s  eta 58s
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from pydantic import BaseModel, Field

PREFIX = "[atropos-sandbox]"


class ProgressSnapshot(BaseModel):
    groups_done: int = Field(ge=0)
    total_groups: int | None = Field(None, ge=0, description="None when the run has no fixed length (serve)")
    rollouts: int = Field(ge=0)
    tool_calls: int = Field(ge=0)
    elapsed_s: float = Field(ge=0)

    @property
    def calls_per_s(self) -> float:
        return self.tool_calls / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        if not self.total_groups or not self.groups_done or self.groups_done >= self.total_groups:
            return None
        return self.elapsed_s / self.groups_done * (self.total_groups - self.groups_done)

    def line(self) -> str:
        total = f"/{self.total_groups}" if self.total_groups else ""
        eta = "" if self.eta_s is None else f"  eta {_duration(self.eta_s)}"
        return (f"{PREFIX} group {self.groups_done}{total}  rollouts {self.rollouts}  tool calls {self.tool_calls}  "
                f"{_rate(self.calls_per_s)}  elapsed {_duration(self.elapsed_s)}{eta}")


def _rate(per_s: float) -> str:
    # a slow model makes a few calls a minute: "0.0 calls/s" would read as "nothing runs"
    if 0 < per_s < 0.95:
        return f"{per_s * 60:.1f} calls/min"
    return f"{per_s:.1f} calls/s"


class GroupProgress:
    """Counts completed groups and prints one line per group.

    ``rollouts`` and ``tool_calls`` are the run's cumulative totals (what an env keeps in its stats
    anyway), so a caller never has to compute per-group deltas. The clock starts at construction.
    """

    def __init__(self, total_groups: int | None = None, *, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total_groups = total_groups
        self.groups_done = 0
        self._stream = stream
        self._clock = clock
        self._t0 = clock()

    def group_done(self, *, rollouts: int, tool_calls: int, total_groups: int | None = None) -> ProgressSnapshot:
        """Record one completed group and print its line; ``total_groups`` may be learned late
        (atroposlib knows ``n_groups_to_process`` only once the run started)."""
        if total_groups is not None:
            self.total_groups = total_groups
        self.groups_done += 1
        snap = ProgressSnapshot(groups_done=self.groups_done, total_groups=self.total_groups, rollouts=int(rollouts),
                                tool_calls=int(tool_calls), elapsed_s=max(0.0, self._clock() - self._t0))
        # stderr by default, resolved late: pytest's capsys and redirections swap sys.stderr
        print(snap.line(), file=self._stream or sys.stderr, flush=True)
        return snap


def _duration(seconds: float) -> str:
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
