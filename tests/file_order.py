"""The order test files are handed to pytest-xdist's workers: the longest first.

``--dist loadfile`` gives each worker a whole file at a time, in the order of the work queue.
pytest-xdist's default queue puts the files with the most tests first, so the few-test files
that take minutes (the chaos test, the real-model runs) came last and one worker ran them alone
at the end while the other sat idle: the suite's wall time was one worker's tail. Longest first
(LPT scheduling) starts them while the many short files fill the other worker, and the short
files close the run on both workers at about the same time.

The seconds per file come from ``tests/durations.json`` (the sum of a file's test times in a full
run: ``scripts/test_durations.py`` rewrites it from a ``--junitxml`` report). Only the ORDER
depends on them: a stale or missing entry costs time, never a test (a file the table does not
know weighs the table's ``default``, else the median). ``scripts/test.sh`` passes ``--no-loadscope-reorder`` so that
pytest-xdist keeps this order.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

TABLE = Path(__file__).resolve().parent / "durations.json"


class _Item(Protocol):
    @property
    def nodeid(self) -> str: ...


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def load(path: Path = TABLE) -> dict[str, float]:
    """File (as in a node id: ``tests/test_x.py``) -> seconds; empty when the table is missing."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in raw.get("files", {}).items()}


def default_seconds(path: Path = TABLE) -> float | None:
    """The table's weight for a file it does not list (its ``default``), if it gives one."""
    try:
        value = json.loads(path.read_text()).get("default")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, int | float) else None


def longest_first(items: Sequence[_Item], seconds: dict[str, float], default: float | None = None) -> list[_Item]:
    """``items`` with whole files ordered by their seconds, longest first; a file keeps its own
    order of tests, and files of equal weight keep the order they were collected in. A file the
    table does not list weighs ``default``, else the median of the table."""
    if default is None:
        default = statistics.median(seconds.values()) if seconds else 0.0
    rank = {f: n for n, f in enumerate(dict.fromkeys(file_of(i.nodeid) for i in items))}
    return sorted(items, key=lambda i: (-seconds.get(file_of(i.nodeid), default), rank[file_of(i.nodeid)]))
