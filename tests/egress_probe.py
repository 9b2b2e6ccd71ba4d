"""Driver of tests/test_egress.py, run as root inside a network namespace the test creates.

It gives that namespace's loopback interface the addresses to probe (link-local, private,
documentation ranges: they exist only in this namespace), listens on each, starts a sandbox host
there with the host flags it is given, leases a network slot and has the slot connect to each
address, once plainly and once from a socket bound to the slot's tap device. It prints one JSON
object: {"plain"|"device": {"address": {"ok": ..., "errno": ..., "banner": ...}, ...}}.
The test makes the assertions.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from conftest import LeasedSlot, start_host, stop_host

ADDRESSES = ["169.254.169.254/16", "10.99.0.1/24", "192.168.77.1/24", "198.51.100.7/24"]
BANNER = b"reached"

# Inside the slot: connect, read the listener's banner. With "device", the socket is first bound to
# the slot's tap device (the kernel then treats a prohibited destination as on-link).
PROBE = """
import errno, json, socket
out = {}
for addr, port in ADDRS:
    s = socket.socket()
    s.settimeout(8)
    try:
        if DEVICE:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b"tap0")
        s.connect((addr, port))
        out[addr] = {"ok": True, "banner": s.recv(64).decode()}
    except OSError as e:
        out[addr] = {"ok": False, "errno": e.errno if e.errno is not None else errno.ETIMEDOUT, "text": str(e)}
    finally:
        s.close()
print(json.dumps(out))
"""


# Inside the slot: ask the kernel to delete the link-local prohibit route; prints the netlink error.
UNROUTE = """
import socket, struct
s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
body = struct.pack("BBBBBBBBI", socket.AF_INET, 16, 0, 0, 254, 4, 0, 8, 0) + struct.pack("HH", 8, 1)
body += socket.inet_aton("169.254.0.0")
s.send(struct.pack("IHHII", 16 + len(body), 25, 0x1 | 0x4, 1, 0) + body)  # RTM_DELROUTE, REQUEST|ACK
print(struct.unpack_from("i", s.recv(4096), 16)[0])
"""


def _serve(sock: socket.socket) -> None:
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        with conn:
            conn.sendall(BANNER)


def setup_namespace() -> None:
    # On lo (dummy interfaces need a kernel module this machine may lack): local to this namespace alike.
    for cmd in (["ip", "link", "set", "lo", "up"], *(["ip", "addr", "add", a, "dev", "lo"] for a in ADDRESSES)):
        subprocess.run(cmd, check=True)


async def probe(host_flags: list[str]) -> dict[str, Any]:
    listeners = []
    targets = []
    for cidr in ADDRESSES:
        addr = cidr.split("/")[0]
        sock = socket.create_server((addr, 0))
        listeners.append(sock)
        threading.Thread(target=_serve, args=(sock,), daemon=True).start()
        targets.append((addr, sock.getsockname()[1]))
    data = Path(f"/tmp/atropos-egress-{secrets.token_hex(4)}")
    host = start_host(data, slots=1, extra=["--network-isolation", "private", *host_flags])
    client = host.client()
    try:
        leased = LeasedSlot(client, await client.lease(f"egress-{secrets.token_hex(3)}", network=True))
        got: dict[str, Any] = {}
        for mode in ("plain", "device"):
            code = f"ADDRS = {targets!r}\nDEVICE = {mode == 'device'!r}\n{PROBE}"
            res = await leased.ok("python", code=code, timeout_s=120)
            got[mode] = json.loads(res["stdout"])
        res = await leased.ok("python", code=UNROUTE, timeout_s=60)
        got["unroute"] = int(res["stdout"])
        return got
    finally:
        await client.aclose()
        stop_host(host)
        for sock in listeners:
            sock.close()


def main() -> None:
    setup_namespace()
    print(json.dumps(asyncio.run(probe(json.loads(sys.argv[1])))), flush=True)


if __name__ == "__main__":
    main()
