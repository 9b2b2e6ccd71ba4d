"""A simulated fleet: fake sandbox hosts that answer the host API at once, all in one process.

Each fake host listens on its own 127.0.0.1 port and speaks just what the pool uses (health,
lease, reset, call), with a minimal HTTP/1.1 server on asyncio streams: no sandbox, no work.
What a benchmark then measures against them is the pool's own cost (its CPU per call, lease
latency, memory per slot) as the fleet grows, with hosts that are never the bottleneck.

Run as ``python -m benchmarks.fake_fleet HOSTS SLOTS TOKEN``: prints one JSON line
``{"ports": [...]}`` and serves until stdin closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

from atropos.backends.base import Backend, HostInfo

_SLOT_PATH = re.compile(rb"^/v1/slots/(\d+)/(reset|release)$")


class FakeHost:
    def __init__(self, slots: int, token: str) -> None:
        self.slots = slots
        self.auth = f"Bearer {token}".encode()
        self.generation = [0] * slots

    def _lease(self, slot: int, trajectory_id: str) -> dict[str, Any]:
        self.generation[slot] += 1
        return {"slot": slot, "lease": secrets.token_hex(8), "generation": self.generation[slot],
                "trajectory_id": trajectory_id, "network": False}

    def answer(self, method: bytes, path: bytes, body: bytes) -> tuple[int, bytes]:
        if path == b"/v1/health":
            return 200, json.dumps({"ok": True, "version": "fake", "slots": self.slots, "free": self.slots,
                                    "leased": 0, "quarantined": 0, "exec_ms": 0.0,
                                    "isolation": "none"}).encode()
        req = json.loads(body or b"{}")
        if path == b"/v1/call":
            return 200, json.dumps({"id": req["id"], "slot": req["slot"], "ok": True,
                                    "result": {"stdout": "", "stderr": "", "exit_code": 0}}).encode()
        if path == b"/v1/leases":
            slot = req.get("slot") or 0
            return 200, json.dumps(self._lease(slot, req.get("trajectory_id", ""))).encode()
        m = _SLOT_PATH.match(path)
        if m:
            slot = int(m.group(1))
            lease = self._lease(slot, req.get("trajectory_id") or "") if m.group(2) == b"reset" else None
            return 200, json.dumps({"slot": slot, "ok": True, "quarantined": False, "duration_ms": 0.0,
                                    "lease": lease}).encode()
        return 404, b'{"error": {"code": "not_found", "message": "fake host"}}'

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                method, path, _ = lines[0].split(b" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines[1:] if ln)}
                n = int(headers.get(b"content-length", b"0"))
                body = await reader.readexactly(n) if n else b""
                if headers.get(b"authorization") != self.auth:
                    status, out = 401, b'{"error": {"code": "unauthorized", "message": "token"}}'
                else:
                    status, out = self.answer(method, path.split(b"?", 1)[0], body)
                writer.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (status, len(out), out))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


class FakeFleetBackend(Backend):
    """Hands out the fake hosts of a running fleet, one per start_host."""

    name = "fake"

    def __init__(self, ports: list[int], token: str, slots: int) -> None:
        self._free = list(ports)
        self._token = token
        self._slots = slots
        self._used: set[str] = set()

    async def start_host(self) -> HostInfo:
        port = self._free.pop(0)
        self._used.add(str(port))
        return HostInfo(id=str(port), address=f"http://127.0.0.1:{port}", token=self._token, slots=self._slots)

    async def stop_host(self, host_id: str) -> None:
        if host_id in self._used:
            self._used.discard(host_id)
            self._free.append(int(host_id))

    async def alive(self, host_id: str) -> bool:
        return host_id in self._used

    def prewarm(self) -> bool:
        return False  # a fake host has no sandbox to start

    def host_slots(self) -> int:
        return self._slots

    async def close(self) -> None:
        self._used.clear()


def shard_backend(ports: list[list[int]], token: str, slots: int, index: int, pool_id: str) -> FakeFleetBackend:
    """Shard ``index`` of a sharded pool (atropos/slots/shards.py) gets the fake hosts ``ports[index]``
    (a BackendFactory once the first three arguments are bound with functools.partial)."""
    return FakeFleetBackend(ports[index], token, slots)


# At most this many fake hosts per process: a pool's start leases every slot of every host at once,
# and 6,400 slot leases must not wait on one accept loop.
HOSTS_PER_PROCESS = 25


@contextlib.asynccontextmanager
async def running_fleet(hosts: int, slots: int, token: str) -> AsyncIterator[tuple[list[int], list[int]]]:
    """``hosts`` fake hosts of ``slots`` slots in child processes of this module: yields their ports
    and the processes' pids (for CPU accounting); they stop when the block ends."""
    shares = [min(HOSTS_PER_PROCESS, hosts - i) for i in range(0, hosts, HOSTS_PER_PROCESS)]
    fleets = [subprocess.Popen([sys.executable, "-m", "benchmarks.fake_fleet", str(n), str(slots), token],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE) for n in shares]
    try:
        ports: list[int] = []
        for fleet in fleets:
            assert fleet.stdout is not None
            ports += json.loads(await asyncio.to_thread(fleet.stdout.readline))["ports"]
        yield ports, [f.pid for f in fleets]
    finally:
        for fleet in fleets:
            assert fleet.stdin is not None
            fleet.stdin.close()
            fleet.wait(60)


async def _main(hosts: int, slots: int, token: str) -> None:
    servers, ports = [], []
    for _ in range(hosts):
        fake = FakeHost(slots, token)
        server = await asyncio.start_server(fake.serve, "127.0.0.1", 0, backlog=1024)
        servers.append(server)
        ports.append(server.sockets[0].getsockname()[1])
    print(json.dumps({"ports": ports}), flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the benchmark closes our stdin


if __name__ == "__main__":
    asyncio.run(_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
