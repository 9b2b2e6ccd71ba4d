"""The egress policy installed: a short-lived Python child joins a network slot's user and network
namespaces and writes the policy's routes over rtnetlink (see ``contract/egress.py`` for the
policy and why it is enforced this way).

It runs as the uid that owns the slot's user namespace (as slirp4netns is), gaining CAP_NET_ADMIN
over the slot's network namespace only, and execs nothing after joining (an exec would drop those
capabilities), so it needs no ``ip`` binary and works where the host itself holds no capability."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from atropos.sandbox.contract.egress import SLIRP_GATEWAY, EgressPolicy, host_addresses
from atropos.sandbox.host.child_process import killed_if_left

# Runs in a fresh interpreter (-I: no site, no environment): joins the slot's user and network
# namespaces (the fds in argv) and adds the routes, one rtnetlink request each, checking every ack.
_CHILD = r"""
import ctypes, json, os, socket, struct, sys
userns, netns, routes = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
libc = ctypes.CDLL(None, use_errno=True)
for fd, kind in ((userns, 0x10000000), (netns, 0x40000000)):  # CLONE_NEWUSER, CLONE_NEWNET
    if libc.setns(fd, kind) != 0:
        err = ctypes.get_errno()
        sys.exit("setns: " + os.strerror(err))
s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
s.bind((0, 0))
oif = struct.pack("I", socket.if_nametoindex(sys.argv[4]))
gateway = socket.inet_aton(sys.argv[5])
for seq, (dst, plen, allowed) in enumerate(routes, 1):
    attrs = struct.pack("HH", 8, 1) + socket.inet_aton(dst)  # RTA_DST
    if allowed:
        attrs += struct.pack("HH", 8, 5) + gateway + struct.pack("HH", 8, 4) + oif  # RTA_GATEWAY, RTA_OIF
    # rtmsg: AF_INET, dst_len, src_len, tos, RT_TABLE_MAIN, RTPROT_STATIC, scope universe, RTN_UNICAST/PROHIBIT
    body = struct.pack("BBBBBBBBI", socket.AF_INET, plen, 0, 0, 254, 4, 0, 1 if allowed else 8, 0) + attrs
    # RTM_NEWROUTE, NLM_F_REQUEST|ACK|CREATE|REPLACE: replaces slirp's own route of the same range
    s.send(struct.pack("IHHII", 16 + len(body), 24, 0x1 | 0x4 | 0x400 | 0x100, seq, 0) + body)
    reply = s.recv(65536)
    mtype, rseq = struct.unpack_from("H", reply, 4)[0], struct.unpack_from("I", reply, 8)[0]
    code = struct.unpack_from("i", reply, 16)[0] if mtype == 2 else -1
    if rseq != seq or code != 0:
        sys.exit("route %s/%d: %s" % (dst, plen, os.strerror(-code) if code < 0 else "unexpected reply"))
"""


async def install_routes(policy: EgressPolicy, userns: int, netns: int, uid: int | None, device: str, python: str,
                  timeout: float) -> str | None:
    """Add ``policy``'s routes to the namespace ``netns`` (owned by ``userns``); None, or why not."""
    table = policy.routes(host_addresses())
    if not table:
        return None
    routes = [[str(net.network_address), net.prefixlen, allowed] for net, allowed in table.items()]
    ids: dict[str, Any] = {"user": uid, "group": uid, "extra_groups": []} if uid is not None else {}
    try:
        # ``python`` (a system interpreter, as the slot's uid may not read the host's own environment)
        proc = await asyncio.create_subprocess_exec(
            python, "-I", "-c", _CHILD, str(userns), str(netns), json.dumps(routes), device, SLIRP_GATEWAY,
            pass_fds=(userns, netns), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, env={}, **ids,
        )
    except OSError as exc:
        return f"cannot start {python}: {exc}"
    async with killed_if_left(proc):
        _, err = await asyncio.wait_for(proc.communicate(), timeout)
    if proc.returncode != 0:
        return err.decode("utf-8", "replace").strip()[-400:] or f"exit status {proc.returncode}"
    return None
