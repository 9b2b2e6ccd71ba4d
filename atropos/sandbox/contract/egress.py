"""Egress policy of network slots: which destinations a slot's own network namespace can route to.

slirp4netns opens the slot's outbound connections from the host's network namespace, so without a
policy a network slot reaches everything the host reaches: cloud metadata services (link-local
169.254.0.0/16), the private networks the host sits on, and every service bound to one of the
host's own addresses. The policy is a set of routes installed in the slot's namespace after
slirp4netns configured it and before anything runs inside it:

- a denied range is a ``prohibit`` route: ``connect()``/``sendto()`` fail at once with EACCES;
- an allowed range is an explicit route through slirp's gateway;
- the most specific entry containing a destination decides (a routing table's longest-prefix
  match); an allow and a deny entry of the same range: allow wins (allow entries punch holes);
- the host's own addresses (read from its namespace at each sandbox start) are denied as /32s
  unless an allow entry contains them; so are ``machine_addresses``, those of the machine around
  the host, which a host in a container cannot see (the Docker backend passes its engine
  machine's, ``--egress-machine-address``).

The agent cannot change these routes: nothing inside the sandbox holds CAP_NET_ADMIN over the
namespace. A socket bound to the tap device (SO_BINDTODEVICE) makes the kernel treat a prohibited
destination as on-link, but slirp answers ARP only for its gateway and DNS addresses, so such a
packet never leaves (tests/test_egress.py proves it). Slots have no IPv6 (slirp4netns runs without
``--enable-ipv6``), so the policy is IPv4 only.

The routes are written over rtnetlink by a short-lived Python child run as the uid that owns the
slot's user namespace (as slirp4netns is): it joins that user namespace (gaining CAP_NET_ADMIN over
the slot's network namespace only) and then the network namespace. It execs nothing after joining
(an exec would drop those capabilities), so it needs no ``ip`` binary and works where the host
itself holds no capability (a container with ``cap_drop: ALL``).
"""

from __future__ import annotations

import ipaddress
from ipaddress import IPv4Address, IPv4Network

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_DENY: tuple[str, ...] = (
    "0.0.0.0/8",  # "this network"
    "10.0.0.0/8",  # private (RFC 1918); slirp's own 10.0.2.0/24 stays reachable (a more specific route)
    "100.64.0.0/10",  # carrier-grade NAT, used by overlay VPNs
    "169.254.0.0/16",  # link-local: cloud metadata services (169.254.169.254)
    "172.16.0.0/12",  # private (RFC 1918), Docker's bridges
    "192.168.0.0/16",  # private (RFC 1918)
    "224.0.0.0/4",  # multicast
    "240.0.0.0/4",  # reserved, and the limited broadcast address
)
SLIRP_GATEWAY = "10.0.2.2"


class EgressPolicy(BaseModel):
    """Where network slots may connect (IPv4 ranges in CIDR notation)."""

    deny: list[IPv4Network] = Field(
        default_factory=lambda: [IPv4Network(n) for n in DEFAULT_DENY],
        description="ranges network slots cannot reach (default: link-local, private, CGNAT, multicast, reserved)")
    allow: list[IPv4Network] = Field(
        default_factory=list, description="exceptions to deny (and to the host's own addresses); the most "
                                          "specific entry containing a destination decides")
    deny_host_addresses: bool = Field(True, description="the host's own (non-loopback) addresses are denied")
    machine_addresses: list[IPv4Address] = Field(
        default_factory=list, description="addresses of the machine around the host (a container's engine "
                                          "machine), treated as the host's own")

    def routes(self, host_addresses: list[IPv4Address]) -> dict[IPv4Network, bool]:
        """Each range with True (routed through slirp) or False (prohibited)."""
        table: dict[IPv4Network, bool] = {net: False for net in self.deny}
        table.update({net: True for net in self.allow})  # the same range in both: allow wins
        if self.deny_host_addresses:
            for addr in [*host_addresses, *self.machine_addresses]:
                # a loopback "machine" address (a dev agent's 127.0.0.1) is the slot's own loopback
                if not addr.is_loopback and not any(addr in net for net in self.allow):
                    table.setdefault(IPv4Network(addr), False)
        return table


class EgressSettings(BaseModel):
    """A backend's egress settings for its hosts: what it passes as ``--egress-*`` flags (HostLaunch).

    A host in a container sees only the container's own addresses; the machine the container runs
    on (its engine's) is another host on the container's network, reachable through slirp unless
    its addresses are denied too: ``machine_addresses`` (the Docker backend adds those of its own
    network namespace, the engine machine's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allow: tuple[IPv4Network, ...] = Field((), description="ranges network slots may reach despite the deny list")
    deny: tuple[IPv4Network, ...] = Field((), description="ranges network slots cannot reach, besides the defaults")
    default_deny: bool = Field(True, description="deny link-local, private, CGNAT, multicast and reserved ranges")
    deny_host_addresses: bool = Field(True, description="deny the host's own (and its machine's) addresses")
    machine_addresses: tuple[IPv4Address, ...] = Field(
        (), description="addresses of the machine the host runs on, denied like the host's own")

    def host_args(self) -> list[str]:
        """The flags of ``python -m atropos.sandbox`` for these settings (none for the defaults)."""
        args = [f"--egress-allow={n}" for n in self.allow] + [f"--egress-deny={n}" for n in self.deny]
        args += [f"--egress-machine-address={a}" for a in self.machine_addresses]
        if not self.default_deny:
            args.append("--egress-no-default-deny")
        if not self.deny_host_addresses:
            args.append("--egress-allow-host-addresses")
        return args

    def policy(self) -> EgressPolicy:
        """The policy a host started with ``host_args()`` enforces."""
        base = EgressPolicy()
        return EgressPolicy(deny=[*(base.deny if self.default_deny else []), *self.deny], allow=list(self.allow),
                            deny_host_addresses=self.deny_host_addresses,
                            machine_addresses=list(self.machine_addresses))


def host_addresses(fib_trie: str = "/proc/net/fib_trie") -> list[IPv4Address]:
    """The calling process's namespace's own IPv4 addresses, loopback excepted."""
    found: set[IPv4Address] = set()
    previous = ""
    with open(fib_trie) as fh:
        for line in fh:
            if "/32 host LOCAL" in line and previous:
                addr = ipaddress.ip_address(previous)
                if isinstance(addr, IPv4Address) and not addr.is_loopback:
                    found.add(addr)
            stripped = line.strip()
            previous = stripped[4:] if stripped.startswith("|-- ") else ""
    return sorted(found)


def parse_networks(values: list[str]) -> list[IPv4Network]:
    """CIDR strings (a bare address is a /32) as networks; ValueError names the bad one."""
    out = []
    for value in values:
        try:
            out.append(IPv4Network(value.strip(), strict=False))
        except ValueError as exc:
            raise ValueError(f"not an IPv4 range: {value!r} ({exc})") from None
    return out


def parse_addresses(values: list[str]) -> list[IPv4Address]:
    """IPv4 addresses; ValueError names the bad one."""
    out = []
    for value in values:
        try:
            out.append(IPv4Address(value.strip()))
        except ValueError as exc:
            raise ValueError(f"not an IPv4 address: {value!r} ({exc})") from None
    return out
