"""Driver of tests/test_egress.py: probes what a network slot reaches, inside network namespaces the test creates.

Local hosts: it runs as root inside a network namespace the test creates (``unshare --net``) and starts
the sandbox host there. Docker hosts (``probe_docker``): the host's container has a network namespace of
its own, made for this test; the driver works in it from outside (``nsenter --net``). Either way the
host's namespace gets the addresses to probe on its loopback interface (link-local, private,
documentation ranges: they exist only in that namespace), and a veth link to a second namespace the
driver creates, standing for the machine around the host (``MACHINE``: not an address of the host's
namespace, reachable through it, as a container's engine machine is). Listeners answer on each; a
network slot connects to each address, once plainly and once from a socket bound to the slot's tap
device. It returns (prints) one JSON object: {"plain"|"device": {"address": {"ok": ..., "errno":
..., "banner": ...}, ...}, "unroute": <netlink error>}. The test makes the assertions.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from conftest import LeasedSlot, start_host, stop_host

ADDRESSES = ["169.254.169.254/16", "10.99.0.1/24", "192.168.77.1/24", "198.51.100.7/24"]
BANNER = b"reached"

# Inside the slot: connect, read the listener's banner. With "device", the socket is first bound to
# the slot's tap device (the kernel then treats a prohibited destination as on-link). One thread per
# address: an on-link address nobody answers ends in EHOSTUNREACH only after the kernel's ARP retries
# (about 3 s), so the addresses are tried at once rather than one after the other.
PROBE = """
import errno, json, socket, threading
out = {}
def probe(addr, port):
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
threads = [threading.Thread(target=probe, args=target) for target in ADDRS]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({addr: out[addr] for addr, _ in ADDRS}))
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


# A listener process, started in the namespace it serves: binds each address of argv once told to
# (a line on stdin: the addresses exist by then), prints {address: port}, answers BANNER until stdin closes.
LISTENER = r"""
import json, socket, sys, threading
sys.stdin.readline()
ports = {}
for addr in sys.argv[1:]:
    sock = socket.create_server((addr, 0))
    ports[addr] = sock.getsockname()[1]
    def serve(sock=sock):
        while True:
            conn, _ = sock.accept()
            with conn:
                conn.sendall(BANNER)
    threading.Thread(target=serve, daemon=True).start()
print(json.dumps(ports), flush=True)
sys.stdin.read()
""".replace("BANNER", repr(BANNER))

MACHINE, MACHINE_LINK = "203.0.113.9", "203.0.113.10"  # the machine's side and the host's side of the veth


def _ip(netns: str | None, *args: str) -> None:
    """``ip`` in the namespace ``netns`` (a /proc/<pid>/ns/net path), or in ours."""
    prefix = ["nsenter", f"--net={netns}", "--"] if netns else []
    subprocess.run([*prefix, "ip", *args], check=True, capture_output=True, timeout=60)


def _listener(prefix: list[str], addrs: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([*prefix, sys.executable, "-I", "-c", LISTENER, *addrs], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _listening(proc: subprocess.Popen[str]) -> dict[str, int]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    assert line, "a listener failed to start"
    ports: dict[str, int] = json.loads(line)
    return ports


def setup_namespaces(netns: str | None) -> tuple[list[tuple[str, int]], list[subprocess.Popen[str]]]:
    """Give the host's namespace (``netns``, None: ours) the addresses and the link to a machine
    namespace of its own; start the listeners. Returns the targets (address, port) and the processes."""
    ns_prefix = ["nsenter", f"--net={netns}", "--"] if netns else []
    # On lo (dummy interfaces need a kernel module this machine may lack): local to this namespace alike.
    _ip(netns, "link", "set", "lo", "up")
    for cidr in ADDRESSES:
        _ip(netns, "addr", "add", cidr, "dev", "lo")
    local = _listener(ns_prefix, [a.split("/")[0] for a in ADDRESSES])
    machine = _listener(["unshare", "--net", "--"], [MACHINE])
    procs = [local, machine]
    try:
        peer = f"/proc/{machine.pid}/ns/net"
        # until unshare has made the namespace and exec'd the listener in it
        for _ in range(1200):
            if not os.readlink(f"/proc/{machine.pid}/exe").endswith("unshare"):
                break
            time.sleep(0.05)
        link = f"eg{secrets.token_hex(3)}"
        _ip(netns, "link", "add", link, "type", "veth", "peer", "name", "eg-machine")
        _ip(netns, "link", "set", "eg-machine", "netns", str(machine.pid))
        _ip(netns, "addr", "add", f"{MACHINE_LINK}/24", "dev", link)
        _ip(netns, "link", "set", link, "up")
        for args in (["link", "set", "lo", "up"], ["addr", "add", f"{MACHINE}/24", "dev", "eg-machine"],
                     ["link", "set", "eg-machine", "up"]):
            _ip(peer, *args)
        ports = {**_listening(local), **_listening(machine)}
    except BaseException:
        stop_listeners(procs)
        raise
    return list(ports.items()), procs


def stop_listeners(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()


async def probe_slot(client: Any, targets: list[tuple[str, int]]) -> dict[str, Any]:
    """Lease a network slot and probe every target from it; the slot tries to lift the policy too."""
    leased = LeasedSlot(client, await client.lease(f"egress-{secrets.token_hex(3)}", network=True))
    got: dict[str, Any] = {}
    for mode in ("plain", "device"):
        code = f"ADDRS = {targets!r}\nDEVICE = {mode == 'device'!r}\n{PROBE}"
        res = await leased.ok("python", code=code, timeout_s=120)
        got[mode] = json.loads(res["stdout"])
    res = await leased.ok("python", code=UNROUTE, timeout_s=60)
    got["unroute"] = int(res["stdout"])
    await client.release(leased.lease.slot, leased.lease.lease)
    return got


async def probe(host_flags: list[str]) -> dict[str, Any]:
    """A local host in this (the test's) namespace, started with ``host_flags``."""
    targets, procs = setup_namespaces(None)
    data = Path(f"/tmp/atropos-egress-{secrets.token_hex(4)}")
    host = start_host(data, slots=1, extra=["--network-isolation", "private", *host_flags])
    client = host.client()
    try:
        return await probe_slot(client, targets)
    finally:
        await client.aclose()
        stop_host(host)
        stop_listeners(procs)
        shutil.rmtree(data, ignore_errors=True)


async def probe_docker(image: str, **config: Any) -> dict[str, Any]:
    """A Docker host (DockerBackendConfig fields ``config``, e.g. ``egress``), probed in its container's namespace."""
    from tests.docker_host import start_docker_host, stop_docker_host

    host = await start_docker_host(image, slots=1, slot_workspace_bytes=64 << 20, **config)
    procs: list[subprocess.Popen[str]] = []
    try:
        targets, procs = await asyncio.to_thread(setup_namespaces, f"/proc/{host.proc.pid}/ns/net")
        async with host.client() as client:
            return await probe_slot(client, targets)
    finally:
        stop_listeners(procs)
        await stop_docker_host(host)


def main() -> None:
    print(json.dumps(asyncio.run(probe(json.loads(sys.argv[1])))), flush=True)


if __name__ == "__main__":
    main()
