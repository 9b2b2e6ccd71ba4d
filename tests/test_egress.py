"""Egress policy of network slots (issue 17, row: a network slot connecting to link-local addresses),
on local and Docker hosts.

Every probe stays inside network namespaces this test creates: the addresses probed (link-local
169.254.169.254, private 10.99.0.1 and 192.168.77.1, and 198.51.100.7 standing for the host's own
address) are assigned to the loopback of the host's namespace (a local host runs in one made with
``unshare --net``; a Docker host's is its container's, made for this test), where listeners answer,
so slirp4netns connects to them locally; 203.0.113.9 (``MACHINE``) stands for the machine around the
host and lives in a second namespace the test links to the host's with a veth pair. No packet is
ever sent to a real link-local, private or public address. tests/egress_probe.py is the driver.
"""

from __future__ import annotations

import asyncio
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

from atropos.sandbox.contract.egress import EgressPolicy, EgressSettings, host_addresses, parse_networks
from atropos.sandbox.contract.launch import HostLaunch
from atropos.sandbox.host.isolation.network import private_network_available
from tests.egress_probe import MACHINE, probe_docker
from tests.pool_backends import BACKENDS, DOCKER_IMAGE, require_docker

LINK_LOCAL, PRIVATE_A, PRIVATE_C, HOST_OWN = "169.254.169.254", "10.99.0.1", "192.168.77.1", "198.51.100.7"
TESTS = Path(__file__).parent
# the machine around the host: denied when the backend names it (the Docker backend names its own)
MACHINE_SETTINGS = {"machine_addresses": (IPv4Address(MACHINE),)}

needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or any(shutil.which(c) is None for c in ("unshare", "nsenter", "ip"))
    or private_network_available() is not None,
    reason="needs root (to create network namespaces), unshare, nsenter, ip, slirp4netns and /dev/net/tun: "
           f"{private_network_available()}")


def run_probe(kind: str, settings: EgressSettings) -> dict[str, Any]:
    """What a network slot of a ``kind`` host with these egress settings reaches."""
    if kind == "docker":
        require_docker()
        return asyncio.run(probe_docker(DOCKER_IMAGE, egress=settings))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    out = subprocess.run(["unshare", "--net", "--", sys.executable, str(TESTS / "egress_probe.py"),
                          json.dumps(settings.host_args())], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, f"probe driver failed:\n{out.stderr[-3000:]}"
    got: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return got


def reached(entry: dict[str, Any]) -> bool:
    return bool(entry["ok"]) and entry.get("banner") == "reached"


@needs_netns
@pytest.mark.parametrize("kind", BACKENDS)
def test_default_policy_denies_link_local_private_and_host_addresses(kind: str) -> None:
    got = run_probe(kind, EgressSettings(**MACHINE_SETTINGS))
    for addr in (LINK_LOCAL, PRIVATE_A, PRIVATE_C, HOST_OWN, MACHINE):
        # refused by the slot's own routing table at once: nothing was sent
        assert got["plain"][addr] == {"ok": False, "errno": errno.EACCES, "text": "[Errno 13] Permission denied"}
        # a socket bound to the tap device makes the kernel try the address as on-link: still unreachable
        assert not got["device"][addr]["ok"], (addr, got["device"][addr])
    # the agent cannot lift the policy: it holds no CAP_NET_ADMIN over its namespace
    assert got["unroute"] == -errno.EPERM, got["unroute"]


@needs_netns
@pytest.mark.parametrize("kind", BACKENDS)
def test_without_policy_the_same_addresses_are_reachable(kind: str) -> None:
    """The premise: with the deny lists emptied, the probes of the other tests do reach the
    listeners, so their refusals come from the policy."""
    got = run_probe(kind, EgressSettings(default_deny=False, deny_host_addresses=False, **MACHINE_SETTINGS))
    for mode in ("plain", "device"):
        for addr in (LINK_LOCAL, PRIVATE_A, PRIVATE_C, HOST_OWN, MACHINE):
            assert reached(got[mode][addr]), (mode, addr, got[mode][addr])


@needs_netns
@pytest.mark.parametrize("kind", BACKENDS)
def test_allow_list_opens_only_what_it_names(kind: str) -> None:
    got = run_probe(kind, EgressSettings(allow=(IPv4Network(f"{PRIVATE_A}/32"),),
                                         deny=(IPv4Network("198.51.100.0/24"),), deny_host_addresses=False))
    assert reached(got["plain"][PRIVATE_A]), got["plain"][PRIVATE_A]  # allowed inside a denied /8
    assert got["plain"][HOST_OWN]["errno"] == errno.EACCES  # an added deny entry
    for addr in (LINK_LOCAL, PRIVATE_C):
        assert got["plain"][addr]["errno"] == errno.EACCES, (addr, got["plain"][addr])
    # not named by the backend, in no denied range: the machine is reachable (the premise of MACHINE_SETTINGS)
    assert reached(got["plain"][MACHINE]), got["plain"][MACHINE]


def test_docker_hosts_deny_the_engine_machines_addresses() -> None:
    """A Docker host sees only its container's addresses; the backend passes this machine's (where
    the engine runs) as ``--egress-machine-address``, besides the configured settings."""
    from atropos.backends.docker import DockerBackend, DockerBackendConfig

    mine = host_addresses()
    assert mine, "premise: this machine has a non-loopback address"
    backend = DockerBackend(DockerBackendConfig(egress=EgressSettings(deny=(IPv4Network("203.0.113.0/24"),))))
    if not backend.engine_is_local():
        pytest.skip("DOCKER_HOST names an engine on another machine")
    settings = backend.egress_settings()
    assert set(settings.machine_addresses) == set(mine) and settings.deny == (IPv4Network("203.0.113.0/24"),)
    args = HostLaunch(slots=1, data_dir="/d", egress=settings).args()
    assert {f"--egress-machine-address={a}" for a in mine} <= set(args) and "--egress-deny=203.0.113.0/24" in args
    # told that slots may reach the host's addresses, it names none
    opened = DockerBackend(DockerBackendConfig(egress=EgressSettings(deny_host_addresses=False))).egress_settings()
    assert opened.machine_addresses == () and "--egress-allow-host-addresses" in opened.host_args()


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
    machine = policy.model_copy(update={"machine_addresses": [IPv4Address("10.1.7.7"), IPv4Address("203.0.113.9")]})
    table = machine.routes([])
    assert IPv4Network("10.1.7.7/32") not in table and table[IPv4Network("203.0.113.9/32")] is False
    # the settings a backend passes are the policy the host builds from their flags
    settings = EgressSettings(allow=(IPv4Network("10.1.0.0/16"),), default_deny=False,
                              machine_addresses=(IPv4Address("203.0.113.9"),))
    assert settings.policy().routes([]) == {IPv4Network("10.1.0.0/16"): True, IPv4Network("203.0.113.9/32"): False}
    with pytest.raises(ValueError, match="not an IPv4 range"):
        parse_networks(["10.0.0.0/33"])
