#!/usr/bin/env python3
"""Rewrite tests/durations.json (seconds per test file, the order tests/file_order.py hands files to
the workers) from the JUnit XML report of a full run:

    .venv/bin/python -m pytest -n 2 --dist loadfile --junitxml=/tmp/suite.xml
    python3 scripts/test_durations.py /tmp/suite.xml

Files in the report replace their entries; files the report lacks (a partial run) keep theirs;
files that no longer exist are dropped. Also prints the per-file table, longest first, and the
finish time of each of N workers if files go out longest first (``--workers``).
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TABLE = REPO / "tests" / "durations.json"


def per_file(report: Path) -> dict[str, float]:
    """Sum of the test times per file (``classname`` is the module's dotted path)."""
    sums: dict[str, float] = defaultdict(float)
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "")
        parts = module.split(".")
        # a test class adds its name to the classname: keep the dotted path up to the test_ module
        while parts and not parts[-1].startswith("test_"):
            parts.pop()
        if parts:
            sums["/".join(parts) + ".py"] += float(case.get("time", "0") or 0)
    return dict(sums)


def longest_first_finish(seconds: dict[str, float], workers: int) -> list[float]:
    """Each worker's busy time when every file goes to the worker that is free first, longest first."""
    heap = [0.0] * workers
    for s in sorted(seconds.values(), reverse=True):
        heapq.heapreplace(heap, heap[0] + s)
    return sorted(heap)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+", type=Path, help="JUnit XML report(s) of a run")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--dry-run", action="store_true", help="print the table, write nothing")
    args = p.parse_args()
    measured: dict[str, float] = {}
    for report in args.reports:
        measured.update(per_file(report))
    try:
        table = {k: float(v) for k, v in json.loads(TABLE.read_text())["files"].items()}
    except (OSError, ValueError, KeyError):
        table = {}
    table.update(measured)
    table = {f: round(s, 1) for f, s in table.items() if (REPO / f).is_file()}
    ordered = dict(sorted(table.items(), key=lambda kv: -kv[1]))
    total = sum(ordered.values())
    for f, s in ordered.items():
        print(f"{s:8.1f}  {f}{'' if f in measured else '  (kept)'}")
    finish = longest_first_finish(ordered, args.workers)
    print(f"{total:8.1f}  total; {args.workers} workers, longest first: " + ", ".join(f"{s:.0f}" for s in finish),
          file=sys.stderr)
    if not args.dry_run:
        # a file added since weighs what a typical file does
        default = round(statistics.median(ordered.values()), 1) if ordered else 0.0
        TABLE.write_text(json.dumps({"default": default, "files": ordered}, indent=1) + "\n")


if __name__ == "__main__":
    main()
