"""Sandbox hosts as Docker containers (Docker Engine API through the docker SDK).

Container options follow docs/isolation.md: nothing in the container runs as
uid 0 or holds a capability, so ``systempaths=unconfined`` (needed for bwrap to mount a fresh
/proc) opens nothing; the custom seccomp profile allows only the namespace and mount syscalls
bwrap needs on top of Docker's usual set. The API port is published on 127.0.0.1 only and every
request needs the host token. The host holds only its verifier (``sha256:<hex>``,
atropos/sandbox/contract/hosttoken.py), which reaches the host as one line on the container's
stdin (``--token-stdin``, as a local or Ray host gets it: atropos/sandbox/contract/launch.py),
written through an attach of the Engine API and closed at once; the token itself stays in the
pool. The verifier is in no environment block (not in ``docker inspect``'s Config.Env, nor in
``/proc/<pid>/environ`` of docker-init, tini or the host), on no command line and in no file; it
never enters a slot (bwrap runs with an empty environment in
its own PID namespace).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable
from importlib import resources
from typing import Any, Literal, TypeVar

import httpx
from pydantic import Field, model_validator

from atropos.backends import docker_cgroups
from atropos.backends.base import PREWARM_DESCRIPTION, Backend, HostInfo, new_token, pid_alive, user_pool_id
from atropos.backends.docker_cgroups import HostCgroup
from atropos.backends.image_shipping import RegistryShipper, ship
from atropos.backends.slot_caps import ContainerSlotCaps
from atropos.errors import ConfigError, HostUnavailable, IsolationUnavailable
from atropos.sandbox.contract import egress
from atropos.sandbox.contract.client import HostClient
from atropos.sandbox.contract.egress import EgressSettings
from atropos.sandbox.contract.hosttoken import token_verifier
from atropos.sandbox.contract.imageref import ImageRef
from atropos.sandbox.contract.launch import HostLaunch

log = logging.getLogger(__name__)
T = TypeVar("T")

LABEL_POOL = "io.atropos-sandbox.pool"
LABEL_OWNER = "io.atropos-sandbox.owner-pid"
LABEL_BOOT = "io.atropos-sandbox.boot-id"
LABEL_HOST = "io.atropos-sandbox.host-id"
CONTAINER_PORT = 8080
SLOT_UID = 1000
IMAGE_STORE_IN_CONTAINER = "/images"  # where DockerBackendConfig.image_volume is mounted
# image references a host resolves itself (atropos/sandbox/host/images/host_images.py), never shipped


class DockerBackendConfig(ContainerSlotCaps):
    """Slot caps (``ContainerSlotCaps``): 1 GiB, 512 pids, 1 CPU per slot, inside the container's budget."""

    kind: Literal["docker"] = "docker"
    image: str = "atropos-sandbox:dev"
    pool_id: str = Field(default_factory=user_pool_id, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    cpus: float = Field(2.0, gt=0)
    memory_bytes: int = Field(4 << 30, ge=256 << 20)
    pids_limit: int = Field(4096, ge=64)
    workspace_bytes: int = Field(4 << 30, ge=64 << 20, description="size of the tmpfs holding all workspaces")
    start_timeout_s: float = 60.0
    prewarm: bool = Field(True, description=PREWARM_DESCRIPTION)
    slot_cgroups: bool = Field(True, description="give each container a delegated cgroup subtree for its slots' "
                               "caps; False = DEVELOPMENT ONLY, hosts run --unsafe-no-cgroups (no per-slot caps)")
    docker_url: str | None = Field(None, description="Docker Engine URL; default from the environment "
                                   "(DOCKER_HOST, DOCKER_TLS_VERIFY, DOCKER_CERT_PATH, as the docker CLI)")
    seccomp_profile: str | None = Field(None, description="path of the outer seccomp profile; default: shipped")
    egress: EgressSettings = Field(default_factory=EgressSettings, description="network slots' egress policy; "
                                   "the engine machine's own addresses are added to machine_addresses")
    image_volume: str | None = Field(None, description="task images' layer store: a directory of the engine's "
                                     "machine (absolute path) or a named volume, writable by uid 1000, mounted at "
                                     "/images in every container: shared by the containers and kept across them "
                                     "(default: none, the store is in the container's /slots tmpfs)")
    image_store_bytes: int | None = Field(None, ge=0, description="the image store's disk budget (default: the "
                                          "host's, 64 GiB)")

    @model_validator(mode="after")
    def _slot_fits(self) -> DockerBackendConfig:
        if self.slot_workspace_bytes > self.workspace_bytes:
            raise ValueError(f"slot_workspace_bytes ({self.slot_workspace_bytes}) exceeds workspace_bytes "
                             f"({self.workspace_bytes}), the tmpfs holding every slot's workspace")
        return self

    def build(self) -> DockerBackend:
        return DockerBackend(self)


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return "unknown"


def remove_cgroup(host_id: str) -> None:
    """Remove a host's slot cgroup subtree once its container is gone (nothing of it runs any more)."""
    cgroup = docker_cgroups.existing(host_id)
    if cgroup is not None:
        cgroup.remove()


def send_line(attached: Any, line: str) -> None:
    """Write ``line`` on a container's stdin through an attach socket of the docker SDK, then end
    that input and close the socket.

    The SDK hands back the socket's file object (over a unix socket or plain HTTP), the socket
    itself (TLS) or a channel (ssh): each wraps something with ``sendall`` and ``shutdown``. The
    half close ends the attach's input, on which the engine closes the container's stdin
    (``stdin_once``); docker-init and tini pass their stdin on to the host, which reads one line
    (atropos/sandbox/host/main.py, ``_read_token_from_stdin``) and then holds /dev/null."""
    raw = getattr(attached, "_sock", attached)
    try:
        raw.sendall(line.encode() + b"\n")
        with contextlib.suppress(OSError):  # the engine already ended the attach: nothing left to end
            raw.shutdown(socket.SHUT_WR)
    finally:
        # the SDK's HTTP response first (it reads through the file object, and would trip over
        # a file closed under it), then the file object and the socket, so the descriptor goes now
        response = getattr(attached, "_response", None)
        if response is not None:
            response.close()
        attached.close()
        raw.close()


def shipped_seccomp_profile() -> str:
    return resources.files("atropos.backends").joinpath("docker_seccomp.json").read_text()


class DockerBackend(Backend):
    name = "docker"

    def __init__(self, cfg: DockerBackendConfig | None = None) -> None:
        self.cfg = cfg or DockerBackendConfig()
        try:
            import docker
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ConfigError("the docker backend needs the docker SDK: pip install 'atropos-sandbox[docker]'") from exc
        self._docker = docker
        self._client: Any = None
        self._mine: set[str] = set()
        self._counter = 0
        self._registries = RegistryShipper()  # registry images shipped to the hosts (ship_image)
        e = self.cfg.egress
        if e.deny_host_addresses and not e.machine_addresses and not self.engine_is_local():
            log.warning("the Docker engine is not on this machine: its machine's own addresses are unknown here, so "
                        "network slots may reach services bound to them; list them in egress.machine_addresses")
        if self.cfg.seccomp_profile:
            with open(self.cfg.seccomp_profile) as fh:
                self._seccomp = fh.read()
        else:
            self._seccomp = shipped_seccomp_profile()

    @property
    def client(self) -> Any:
        if self._client is None:
            try:
                self._client = (self._docker.DockerClient(base_url=self.cfg.docker_url) if self.cfg.docker_url
                                else self._docker.from_env())
                self._client.ping()
            except Exception as exc:
                self._client = None
                where = self.cfg.docker_url or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
                raise HostUnavailable(f"cannot reach the Docker engine at {where} (DockerBackendConfig.docker_url, "
                                      f"else DOCKER_HOST): {exc}") from exc
        return self._client

    def host_config(self, cgroup: HostCgroup | None = None) -> dict[str, Any]:
        """HostConfig of the Engine API (kept separate so tests can inspect it)."""
        c = self.cfg
        placement: dict[str, Any] = {}
        binds: dict[str, dict[str, str]] = {}
        if cgroup is not None:
            # the container inside its budget cgroup, beside the slots' subtree mounted for it
            placement = {"cgroup_parent": cgroup.cgroup_parent, "cgroupns": "host"}
            binds.update(cgroup.binds())
        if c.image_volume is not None:
            binds[c.image_volume] = {"bind": IMAGE_STORE_IN_CONTAINER, "mode": "rw"}
        if binds:
            placement["binds"] = binds
        hc: dict[str, Any] = self.client.api.create_host_config(
            **placement,
            init=True,  # a reaping PID 1: sandbox teardown leaves no zombies behind
            cap_drop=["ALL"],
            security_opt=["no-new-privileges", f"seccomp={self._seccomp}"],
            read_only=True,
            tmpfs={
                "/tmp": "rw,size=64m",
                # exec: slotd, the compiled supervisor, runs from the host's lib dir in there
                # (docs/native-supervisor.md); Docker mounts a tmpfs noexec unless told
                "/slots": f"rw,exec,size={c.workspace_bytes},uid={SLOT_UID},gid={SLOT_UID},mode=0711",
            },
            pids_limit=c.pids_limit,
            mem_limit=c.memory_bytes,
            memswap_limit=c.memory_bytes,
            nano_cpus=int(c.cpus * 1e9),
            port_bindings={CONTAINER_PORT: ("127.0.0.1", None)},
            # slirp4netns gives slots leased with network their own namespace (atropos.sandbox.host.isolation.network)
            devices=["/dev/net/tun:/dev/net/tun:rwm"] if os.path.exists("/dev/net/tun") else None,
        )
        # `--security-opt systempaths=unconfined` of the CLI: lets bwrap mount a fresh /proc. The
        # Engine API spells it as empty masked/read-only path lists (the SDK has no keyword for it).
        hc["MaskedPaths"] = []
        hc["ReadonlyPaths"] = []
        return hc

    def engine_is_local(self) -> bool:
        """The engine is reached through a unix socket: it runs on this machine."""
        url = self.cfg.docker_url or os.environ.get("DOCKER_HOST") or "unix://"
        return url.startswith("unix://")

    def egress_settings(self) -> EgressSettings:
        """The hosts' egress settings: the config's, plus this machine's addresses when the engine runs here.

        A slot's connections leave through its container's network, on which the engine's machine is
        just another host: without these, a service bound to one of its addresses (not loopback) would
        be reachable from a network slot. They are read from this process's network namespace (the
        machine's, as the slot cgroups' delegation needs the engine here too), at each container start."""
        e = self.cfg.egress
        if not e.deny_host_addresses or not self.engine_is_local():
            return e
        known = set(e.machine_addresses)
        extra = tuple(a for a in egress.host_addresses() if a not in known)
        return e.model_copy(update={"machine_addresses": (*e.machine_addresses, *extra)})

    def _slot_cgroup_args(self, host_id: str) -> tuple[HostCgroup | None, dict[str, Any]]:
        """The container's slot cgroup subtree (prepared now) and the host's flags for it."""
        c = self.cfg
        if not c.slot_cgroups:
            return None, {"unsafe_no_cgroups": True}
        cgroup = docker_cgroups.prepare(host_id, memory_bytes=c.memory_bytes, pids=c.pids_limit, cpus=c.cpus,
                                        uid=SLOT_UID)
        return cgroup, {"cgroup_dir": docker_cgroups.CONTAINER_CGROUP_DIR}

    def _create(self, host_id: str, token: str) -> Any:
        c = self.cfg
        api = self.client.api
        cgroup, cgroup_args = self._slot_cgroup_args(host_id)
        config = api.create_container_config(
            c.image,
            # the image's entrypoint is `python3 -m atropos.sandbox`
            command=HostLaunch(host="0.0.0.0", port=CONTAINER_PORT, slots=c.slots_per_host, data_dir="/slots/data",
                               limits=c.slot_limits(), prewarm=False, egress=self.egress_settings(),
                               token_stdin=True, image_store_bytes=c.image_store_bytes,
                               image_store=IMAGE_STORE_IN_CONTAINER if c.image_volume else None,
                               **cgroup_args).args(),
            user=f"{SLOT_UID}:{SLOT_UID}",
            # the token's way in: stdin (no terminal, which would echo it back)
            stdin_open=True,
            tty=False,
            labels={LABEL_POOL: c.pool_id, LABEL_OWNER: str(os.getpid()), LABEL_BOOT: boot_id(), LABEL_HOST: host_id},
            ports=[CONTAINER_PORT],
            host_config=self.host_config(cgroup),
            detach=True,
        )
        # ...closed by the engine when the one attach below ends (`docker run -i`; the SDK sets it
        # only for a container it also attaches stdout and stderr to)
        config["StdinOnce"] = True
        created = api.create_container_from_config(config, host_id)
        # attached before the start, as `docker run -i` does: nothing the host reads can be missed
        stdin = api.attach_socket(created["Id"], params={"stdin": 1, "stream": 1})
        try:
            api.start(created["Id"])
        except BaseException:
            stdin.close()
            raise
        # the token's verifier, never the token (atropos/sandbox/contract/hosttoken.py), as a local
        # or Ray host gets it: nothing in the container (its memory, its files) could be presented
        send_line(stdin, token_verifier(token))
        return self.client.containers.get(created["Id"])

    async def start_host(self) -> HostInfo:
        self._counter += 1
        host_id = f"atropos-{self.cfg.pool_id}-{os.getpid()}-{self._counter}-{new_token()[:6].lower()}"
        host_id = "".join(ch if ch.isalnum() or ch in "_.-" else "x" for ch in host_id)
        token = new_token()
        # Recorded before the container exists: close() must remove it even if we are cancelled
        # between the engine creating it and this coroutine hearing back.
        self._mine.add(host_id)
        try:
            container = await self._run_to_completion(asyncio.to_thread(self._create, host_id, token))
            port = await self._published_port(container)
            address = f"http://127.0.0.1:{port}"
            await self._wait_ready(container, address, token)
        except BaseException as exc:
            # Also on cancellation (not an Exception): otherwise the container runs on, unowned.
            # Shielded so a second cancel cannot interrupt the removal half way.
            await asyncio.shield(self._stop_quietly(host_id))
            # IsolationUnavailable (no slot cgroups here) is a setup problem, said as such
            if isinstance(exc, Exception) and not isinstance(exc, (HostUnavailable, IsolationUnavailable)):
                raise HostUnavailable(f"docker host {host_id} failed to start: {exc}") from exc
            raise
        log.info("docker host %s ready at %s", host_id, address)
        return HostInfo(id=host_id, address=address, token=token, slots=self.cfg.slots_per_host,
                        labels={"backend": "docker", "container": container.id[:12]},
                        log=f"docker logs {container.id[:12]}")

    @staticmethod
    async def _run_to_completion(work: Awaitable[T]) -> T:
        """Await ``work`` (a ``to_thread``); if cancelled, still let the thread finish first.

        A cancelled ``to_thread`` does not stop its thread: the engine call goes on and may
        create the container *after* we tried to remove it. Waiting for the thread makes the
        removal that follows see (and remove) whatever it made."""
        task = asyncio.ensure_future(work)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            with contextlib.suppress(BaseException):
                await asyncio.shield(task)
            raise

    async def _stop_quietly(self, host_id: str) -> None:
        try:
            await self.stop_host(host_id)
        except Exception as exc:  # the start's own error is the one to report
            log.error("could not remove container %s after a failed start: %s", host_id, exc)

    async def _published_port(self, container: Any) -> int:
        deadline = time.monotonic() + 10
        # ``_create`` read the container after starting it: the port is normally there already
        # (one engine round trip fewer per start).
        while True:
            bindings = (container.attrs.get("NetworkSettings", {}).get("Ports") or {}).get(f"{CONTAINER_PORT}/tcp")
            if bindings:
                return int(bindings[0]["HostPort"])
            if container.status in ("exited", "dead"):
                break
            await asyncio.sleep(0.05)
            if time.monotonic() >= deadline:
                break
            await asyncio.to_thread(container.reload)
        logs = await asyncio.to_thread(container.logs, tail=30)
        raise HostUnavailable(f"container {container.name} published no port: {logs.decode(errors='replace')}")

    async def _wait_ready(self, container: Any, address: str, token: str) -> None:
        deadline = time.monotonic() + self.cfg.start_timeout_s
        next_look = time.monotonic() + 1.0
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=5) as http:
            while time.monotonic() < deadline:
                try:
                    resp = await http.get(f"{address}/v1/health")
                    if resp.status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                # A container that exited never answers: look (an engine round trip) about once a
                # second rather than on every 50 ms probe, which only needs the host's socket.
                if time.monotonic() >= next_look:
                    next_look = time.monotonic() + 1.0
                    await asyncio.to_thread(container.reload)
                    if container.status in ("exited", "dead"):
                        break
                await asyncio.sleep(0.05)
        logs = await asyncio.to_thread(container.logs, tail=40)
        raise HostUnavailable(f"container {container.name} did not become ready: {logs.decode(errors='replace')}")

    async def ship_image(self, client: HostClient, reference: ImageRef) -> None:
        """A container's host has no engine socket and no way to a registry: the pool ships it, from
        its engine or (a ``docker://`` reference) fetched from the registry on the pool's machine
        (``image_shipping.ship``)."""

        async def engine() -> tuple[Any, type[Exception]]:
            return self.client.api, self._docker.errors.ImageNotFound

        await ship(client, reference, engine, self._registries)

    async def stop_host(self, host_id: str) -> None:
        self._mine.discard(host_id)

        def remove() -> None:
            try:
                self.client.containers.get(host_id).remove(force=True)
            except self._docker.errors.NotFound:
                pass
            except self._docker.errors.APIError as exc:
                if "already in progress" not in str(exc):
                    raise
            remove_cgroup(host_id)

        await asyncio.to_thread(remove)

    async def alive(self, host_id: str) -> bool:
        def check() -> bool:
            try:
                return bool(self.client.containers.get(host_id).status == "running")
            except self._docker.errors.NotFound:
                return False

        try:
            return await asyncio.to_thread(check)
        except HostUnavailable:
            return False

    def _labelled(self) -> list[Any]:
        return list(self.client.containers.list(all=True, filters={"label": f"{LABEL_POOL}={self.cfg.pool_id}"}))

    async def reap_orphans(self) -> int:
        """Remove this pool's containers whose owning process is gone (any state, Created included)."""
        me, boot = str(os.getpid()), boot_id()

        def reap() -> int:
            n = 0
            for container in self._labelled():
                labels = container.labels or {}
                owner, their_boot = labels.get(LABEL_OWNER, ""), labels.get(LABEL_BOOT, "")
                if owner == me and their_boot == boot:
                    continue
                if their_boot == boot and owner.isdigit() and pid_alive(int(owner)):
                    continue
                container.remove(force=True)
                remove_cgroup(container.name)
                n += 1
            # subtrees of containers that are gone (removed by hand, or a start that died half way)
            live = {c.name for c in self._labelled()}
            for name in docker_cgroups.leftover_hosts(f"atropos-{self.cfg.pool_id}-") - live:
                remove_cgroup(name)
            return n

        return await asyncio.to_thread(reap)

    async def list_hosts(self) -> list[str]:
        return [c.name for c in await asyncio.to_thread(self._labelled)]

    async def close(self) -> None:
        await asyncio.gather(*(self.stop_host(h) for h in list(self._mine)), return_exceptions=True)


