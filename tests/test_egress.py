"""Egress policy of network slots (issue 17, row: a network slot connecting to link-local addresses).

Every probe stays inside a network namespace this test creates (``unshare --net``): the addresses
probed (link-local 169.254.169.254, private 10.99.0.1 and 192.168.77.1, and 198.51.100.7 standing
for the host's own address) are assigned to that namespace's loopback, where listeners answer; the
sandbox host runs in the same namespace, so slirp4netns connects to them locally. No packet is ever
sent to a real link-local, private or public address. tests/egress_probe.py is the driver.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path
from typing import Any

import pytest

from atropos.sandbox.egress import EgressPolicy, parse_networks
from atropos.sandbox.network import private_network_available

LINK_LOCAL, PRIVATE_A, PRIVATE_C, HOST_OWN = "169.254.169.254", "10.99.0.1", "192.168.77.1", "198.51.100.7"
TESTS = Path(__file__).parent

needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None
    or private_network_available() is not None,
    reason="needs root (to create a network namespace), unshare, ip, slirp4netns and /dev/net/tun: "
           f"{private_network_available()}")


def run_probe(*host_flags: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    out = subprocess.run(["unshare", "--net", "--", sys.executable, str(TESTS / "egress_probe.py"),
                          json.dumps(list(host_flags))], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, f"probe driver failed:\n{out.stderr[-3000:]}"
    got: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return got


def reached(entry: dict[str, Any]) -> bool:
    return bool(entry["ok"]) and entry.get("banner") == "reached"


@needs_netns
def test_default_policy_denies_link_local_private_and_host_addresses() -> None:
    got = run_probe()
    for addr in (LINK_LOCAL, PRIVATE_A, PRIVATE_C, HOST_OWN):
        # refused by the slot's own routing table at once: nothing was sent
        assert got["plain"][addr] == {"ok": False, "errno": errno.EACCES, "text": "[Errno 13] Permission denied"}
        # a socket bound to the tap device makes the kernel try the address as on-link: still unreachable
        assert not got["device"][addr]["ok"], (addr, got["device"][addr])
    # the agent cannot lift the policy: it holds no CAP_NET_ADMIN over its namespace
    assert got["unroute"] == -errno.EPERM, got["unroute"]


@needs_netns
def test_without_policy_the_same_addresses_are_reachable() -> None:
    """The premise: with the deny lists emptied, the probes of the other tests do reach the
    listeners, so their refusals come from the policy."""
    got = run_probe("--egress-no-default-deny", "--egress-allow-host-addresses")
    for mode in ("plain", "device"):
        for addr in (LINK_LOCAL, PRIVATE_A, PRIVATE_C, HOST_OWN):
            assert reached(got[mode][addr]), (mode, addr, got[mode][addr])


@needs_netns
def test_allow_list_opens_only_what_it_names() -> None:
    got = run_probe("--egress-allow", f"{PRIVATE_A}/32", "--egress-deny", "198.51.100.0/24",
                    "--egress-allow-host-addresses")
    assert reached(got["plain"][PRIVATE_A]), got["plain"][PRIVATE_A]  # allowed inside a denied /8
    assert got["plain"][HOST_OWN]["errno"] == errno.EACCES  # an added deny entry
    for addr in (LINK_LOCAL, PRIVATE_C):
        assert got["plain"][addr]["errno"] == errno.EACCES, (addr, got["plain"][addr])


def test_most_specific_entry_decides() -> None:
    policy = EgressPolicy(allow=parse_networks(["10.1.0.0/16", "192.168.0.0/16"]),
                          deny=parse_networks(["10.0.0.0/8", "10.1.2.0/24", "192.168.0.0/16"]))
    table = policy.routes([IPv4Address("10.1.5.5"), IPv4Address("192.0.2.9")])
    assert table[IPv4Network("10.0.0.0/8")] is False
    assert table[IPv4Network("10.1.0.0/16")] is True
    assert table[IPv4Network("10.1.2.0/24")] is False  # a deny inside an allow: the narrower wins
    assert table[IPv4Network("192.168.0.0/16")] is True  # the same range in both: allow wins
    assert IPv4Network("10.1.5.5/32") not in table  # a host address an allow entry contains
    assert table[IPv4Network("192.0.2.9/32")] is False
    with pytest.raises(ValueError, match="not an IPv4 range"):
        parse_networks(["10.0.0.0/33"])
