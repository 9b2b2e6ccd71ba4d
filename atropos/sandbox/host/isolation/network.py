"""Network for slots leased with network: a private network namespace behind slirp4netns.

The slot keeps bwrap's own network namespace; slirp4netns (user-mode NAT, running as the slot's
uid inside the slot's user namespace) gives it a tap device with outbound TCP/UDP and DNS. With
``--disable-host-loopback`` nothing on the host's loopback (the host API, a model server, other
local services) and no abstract unix socket of the host's namespace is reachable from the slot.

The start is a handshake over three pipes: bwrap reports its child's pid on ``--info-fd`` and
waits on ``--block-fd`` before running anything; slirp4netns configures the tap and reports on
``--ready-fd``; only then is the sandbox released. slirp4netns exits when its ``--exit-fd`` reaches
EOF, and the only writer of that pipe lives inside the sandbox, so the NAT dies with the sandbox
whoever kills it (the host, its death, the kernel).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from atropos.errors import NetworkSetupFailed as NetworkSetupFailed  # defined there since issue 18
from atropos.sandbox.contract.egress import EgressPolicy
from atropos.sandbox.host.isolation.egress_routes import install_routes

SLIRP4NETNS = shutil.which("slirp4netns") or "/usr/bin/slirp4netns"
TAP = "tap0"
DNS = "10.0.2.3"  # slirp4netns's built-in DNS forwarder (its default 10.0.2.0/24 network)
MTU = 65520
NS_GET_USERNS = 0xB701  # ioctl_ns(2): the user namespace that owns a namespace


def private_network_available() -> str | None:
    """None when network slots can get a private namespace here, else why not."""
    if not os.path.exists(SLIRP4NETNS):
        return "slirp4netns is not installed (Debian/Ubuntu: apt-get install slirp4netns)"
    if not os.access("/dev/net/tun", os.R_OK | os.W_OK):
        return "/dev/net/tun is missing or not accessible (Docker: --device /dev/net/tun)"
    if os.geteuid() == 0 and os.stat("/dev/net/tun").st_mode & 0o006 != 0o006:
        # slirp4netns runs as the slot's uid (never as root), which then cannot open the device
        return ("/dev/net/tun is not usable by the slots' uids: chmod 0666 /dev/net/tun (the mode udev "
                "gives it on Debian/Ubuntu; scripts/setup.sh does it)")
    return None


@dataclass
class SlirpHandshake:
    """The pipes of one network sandbox start; placeholders in bwrap's argv name their ends."""

    fds: dict[str, int] = field(default_factory=dict)
    egress: EgressPolicy | None = None  # routes installed before the sandbox is released
    python: str = "/usr/bin/python3"  # runs the route installer as the slot's uid: a system interpreter

    @classmethod
    def create(cls, policy: EgressPolicy | None = None, python: str = "/usr/bin/python3") -> SlirpHandshake:
        h = cls(egress=policy, python=python)
        h.fds["info_r"], h.fds["info_w"] = os.pipe()
        h.fds["block_r"], h.fds["block_w"] = os.pipe()
        h.fds["exit_r"], h.fds["exit_w"] = os.pipe()
        return h

    @property
    def sandbox_fds(self) -> dict[str, int]:
        """Ends the sandbox inherits: bwrap's info/block fds, and the exit pipe's writer."""
        return {"info_fd": self.fds["info_w"], "block_fd": self.fds["block_r"], "exit_fd": self.fds["exit_w"]}

    def spawned(self) -> None:
        """Drop the host's copies of the sandbox's ends (so their EOFs mean what they should)."""
        for name in ("info_w", "block_r", "exit_w"):
            self._close(name)

    async def attach(self, uid: int | None, label: str, timeout: float) -> asyncio.subprocess.Process:
        """Wait for bwrap's child, plug slirp4netns into its namespace, then release the sandbox."""
        try:
            return await asyncio.wait_for(self._attach(uid, label), timeout)
        except asyncio.TimeoutError:
            raise NetworkSetupFailed(f"{label}: network not ready within {timeout:.0f}s") from None

    async def _attach(self, uid: int | None, label: str) -> asyncio.subprocess.Process:
        info = await asyncio.to_thread(_read_json, self.fds["info_r"])
        pid = info.get("child-pid") if info else None
        if not isinstance(pid, int):
            raise NetworkSetupFailed(f"{label}: sandbox exited before its network was set up")
        # bwrap configures the namespace's loopback itself while it starts; slirp4netns touching
        # the namespace at the same time makes that fail ("Failed RTM_NEWADDR"): wait for it.
        await asyncio.to_thread(_wait_for_loopback, pid)
        try:
            # bwrap --disable-userns moves its child into a nested user namespace: join the one that
            # owns the network namespace (the only one whose capabilities can configure it).
            netns = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise NetworkSetupFailed(f"{label}: sandbox exited before its network was set up ({exc})") from None
        ready_r, ready_w = os.pipe()
        ids: dict[str, Any] = {"user": uid, "group": uid, "extra_groups": []} if uid is not None else {}
        userns = -1
        errors = tempfile.TemporaryFile()  # slirp4netns's messages, for the error if it fails
        try:
            userns = fcntl.ioctl(netns, NS_GET_USERNS)
            slirp = await asyncio.create_subprocess_exec(
                SLIRP4NETNS, "--configure", f"--mtu={MTU}", "--disable-host-loopback",
                f"--userns-path=/proc/self/fd/{userns}", "--netns-type=path",
                f"--ready-fd={ready_w}", f"--exit-fd={self.fds['exit_r']}", f"/proc/self/fd/{netns}", TAP,
                pass_fds=(ready_w, self.fds["exit_r"], netns, userns), stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=errors, env={}, **ids,
            )
        except OSError as exc:
            errors.close()
            for fd in (netns, userns):
                if fd >= 0:
                    os.close(fd)
            raise NetworkSetupFailed(f"{label}: cannot start slirp4netns: {exc}") from exc
        finally:
            os.close(ready_w)
            self._close("exit_r")
        try:
            ready = await asyncio.to_thread(os.read, ready_r, 1)
            refused = None
            if ready == b"1" and self.egress is not None:
                # After slirp configured tap0 and its routes (ours replace any of the same range),
                # before the sandbox runs anything.
                refused = await install_routes(self.egress, userns, netns, uid, TAP, self.python, timeout=30.0)
        finally:
            os.close(ready_r)
            for fd in (netns, userns):
                if fd >= 0:
                    os.close(fd)
        if refused is not None:
            with contextlib.suppress(ProcessLookupError):
                slirp.kill()
            await slirp.wait()
            errors.close()
            raise NetworkSetupFailed(f"{label}: cannot install the egress policy: {refused}")
        if ready != b"1":
            with contextlib.suppress(ProcessLookupError):
                slirp.kill()
            await slirp.wait()
            errors.seek(0)
            why = errors.read()[-400:].decode("utf-8", "replace").strip()
            errors.close()
            raise NetworkSetupFailed(f"{label}: slirp4netns failed (exit status {slirp.returncode}): {why}")
        errors.close()
        os.write(self.fds["block_w"], b"1")
        return slirp

    def _close(self, name: str) -> None:
        fd = self.fds.pop(name, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for name in list(self.fds):
            self._close(name)


def _wait_for_loopback(pid: int) -> None:
    """Until 127.0.0.1 is a local address in ``pid``'s network namespace (lo has it and is up);
    the caller's timeout bounds it (bwrap gets killed, the read fails)."""
    while True:
        try:
            with open(f"/proc/{pid}/net/fib_trie", "rb") as fh:
                if b"127.0.0.1" in fh.read():
                    return
        except OSError:
            raise NetworkSetupFailed(f"sandbox {pid} exited before its network was set up") from None
        time.sleep(0.001)


def _read_json(fd: int) -> dict[str, Any] | None:
    """bwrap's info JSON (one object; the pipe stays open while the sandbox runs)."""
    data = b""
    while True:
        chunk = os.read(fd, 4096)
        if not chunk:
            return None
        data += chunk
        try:
            value = json.loads(data)
        except ValueError:
            continue
        return value if isinstance(value, dict) else None
