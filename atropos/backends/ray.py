"""Sandbox hosts placed by Ray: one actor per host on a node that offers the custom resource
(``atropos_sandbox`` by default); the actor runs the same ``python -m atropos.sandbox`` as the
local backend (bubblewrap on that node, no Docker) and reports its address back.

Why it is built this way:

- The actor never gets the host token, only its verifier (``sha256:<hex>``,
  atropos/sandbox/contract/hosttoken.py): any job of the cluster can run code inside the actor
  (``__ray_call__``), so nothing it holds may be usable against the host. The verifier reaches
  the actor in a method call after the actor exists, never in its
  constructor arguments, options or runtime_env: those are stored in Ray's actor table and shown
  by its state API and dashboard; a method call's arguments are sent to the actor only. The
  actor writes it on the host's stdin (``atropos/sandbox/contract/launch.py: start_host_process``), never
  in an environment block: Ray runs every task of a node as one user, which can read the
  ``/proc/<pid>/environ`` of all of them. The actor's worker and the host are non-dumpable.
- Each host's log is ``flock``-ed by its actor and inherited by the host, so the lock lasts as
  long as the host: an actor starting a host removes the data dirs and logs of its pool's hosts
  whose lock is free (hosts of a killed pool, whose actors died without ``stop``), and the slot
  cgroups of dead hosts on its node, then does so again every ``SWEEP_INTERVAL_S``.
- Before placing anything, the cluster must have a live node offering the resource and CPUs one
  host asks for: if none does, that is said at once with what the nodes offer, not after the
  start timeout. An address where nothing listens is an error within seconds (Ray itself retries
  for minutes).
- The host is started with ``--parent-pid`` = the actor's worker: when Ray kills the actor (its
  node removed, ``ray.kill``, the pool's driver gone) the host gets SIGTERM and stops its slots.
- Actors are owned by the pool's driver (not detached): when the pool process dies, Ray kills
  them. They are also named ``<pool_id>/<hostname>/<pid>/<n>`` in the pool's namespace, so a
  restarted pool reaps any that outlived a dead owner on this machine (``reap_orphans``).
- A host is lost the moment its actor dies: a watcher awaits the actor's ``wait`` call, which
  fails at once when Ray reports the actor dead (a removed node), so ``alive`` answers False and
  the pool fails the host's in-flight calls and starts a replacement on a surviving node.

Ray is imported only when a RayBackend is made (``pip install 'atropos-sandbox[ray]'``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import json
import logging
import os
import shutil
import signal
import socket
import sys
from pathlib import Path
from typing import IO, Any, Literal

from pydantic import Field

from atropos.backends.base import PREWARM_DESCRIPTION, Backend, HostInfo, new_token, pid_alive, user_pool_id
from atropos.backends.slot_caps import SlotCaps
from atropos.errors import ConfigError, HostUnavailable, IsolationUnavailable
from atropos.sandbox.contract.hosttoken import token_verifier

SWEEP_INTERVAL_S = 15.0  # how often a host's actor removes what dead hosts of its pool left on its node
ADDRESS_PROBE_S = 5.0  # a Ray address must accept a TCP connection this fast (ray.init retries for minutes)

log = logging.getLogger(__name__)

# Ray rewrites a loopback address (its own or a cluster's) to this machine's outward IP unless this
# variable is 0 (ray/_private/services.py: resolve_ip_for_localhost); a cluster on 127.0.0.1 must
# stay there.
RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
NAME_SEP = "/"  # a pool id never holds one (its pattern), so names split back unambiguously


class RayBackendConfig(SlotCaps):
    """Slot caps (``SlotCaps``) as the local backend's, applied by the host on its node."""

    kind: Literal["ray"] = "ray"
    address: str | None = Field(None, description="Ray cluster (host:port, 'auto', ray://...); default $RAY_ADDRESS, "
                                                  "else a Ray started in this process on 127.0.0.1")
    namespace: str = Field("atropos-sandbox", min_length=1, description="Ray namespace of the host actors")
    pool_id: str = Field(default_factory=user_pool_id, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    prewarm: bool = Field(True, description=PREWARM_DESCRIPTION)
    start_timeout_s: float = Field(120.0, gt=0, description="placement + host start, per host")
    resource: str = Field("atropos_sandbox", min_length=1,
                          description="custom resource a node must offer to run hosts (ray start --resources)")
    resource_per_host: float = Field(1.0, gt=0, description="how much of it one host takes")
    num_cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves per host (a scheduling share, not a cap)")
    spread: bool = Field(True, description="place hosts on as many nodes as possible (Ray's SPREAD); "
                                           "off: Ray packs them")
    data_root: Path = Field(Path("/tmp/atropos-sandbox/ray"), description="on each node: where workspaces live")
    image_store: Path | None = Field(None, description="on each node: the task images' layer store, one per node "
                                     "shared by every host (of every pool) placed there; default: <data_root>/images "
                                     "(docs/task-images.md)")
    python: str | None = Field(None, description="interpreter running the hosts on the nodes; default: the actor's")
    loopback: bool | None = Field(None, description="keep Ray on 127.0.0.1 (a single-machine cluster); "
                                                    "default: when the address is loopback or Ray is started here")
    unsafe_no_isolation: bool = Field(False, description="DEVELOPMENT ONLY: no bubblewrap")
    unsafe_no_cgroups: bool = Field(False, description="DEVELOPMENT ONLY: no per-slot cgroup (no slot-wide caps)")
    host_log_level: str = "WARNING"

    def build(self) -> RayBackend:
        return RayBackend(self)


class HostActor:
    """Runs on a Ray node: starts one sandbox host process, reports where it listens, waits for it
    and stops it. Made a Ray actor by ``RayBackend`` (``ray.remote(HostActor)``)."""

    def __init__(self, launch: dict[str, Any]) -> None:
        from atropos.sandbox.contract.launch import make_undumpable

        # before the token arrives (start): the node's other tasks run as our user
        make_undumpable()
        self.launch = launch
        self.proc: asyncio.subprocess.Process | None = None
        self._sweeper: asyncio.Future[None] | None = None
        self.data_dir = Path(launch["data_dir"])
        self.log_path = self.data_dir.with_suffix(".log")

    async def start(self, verifier: str, timeout_s: float) -> dict[str, Any]:
        """``verifier`` is the host token's (``hosttoken.token_verifier``), never the token: every
        job of the cluster can run code in this process (``__ray_call__``, docs/ray.md)."""
        import ray

        from atropos.sandbox.contract.hostdirs import owned_dir
        from atropos.sandbox.contract.launch import HostLaunch, start_host_process

        ip = ray.util.get_node_ip_address()
        spec = dict(self.launch)
        python = spec.pop("python", None)
        launch = HostLaunch(**spec, host=ip, parent_pid=os.getpid())
        root = self.data_dir.parent
        root.parent.mkdir(parents=True, exist_ok=True)
        for d in (root.parent, root):
            owned_dir(d, 0o711)
        with await asyncio.to_thread(_locked_log, self.log_path) as log_file:
            self.proc = await start_host_process(launch, verifier, log_file, python or sys.executable)
        # now and then while this host lives: a killed pool's hosts release their locks only once
        # they have stopped, seconds after their actors died
        self._sweeper = asyncio.ensure_future(self._sweep(root))
        assert self.proc.stdout is not None
        try:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
            ready = json.loads(line) if line else {}
        except (asyncio.TimeoutError, ValueError):
            ready = {}
        if ready.get("event") != "ready":
            # the log's end first: stop() removes the log with the host's directory
            tail = self._tail()
            await self.stop()
            return {"error": f"{tail}\n(host log on node {ip}: {self.log_path}, removed with the host)"}
        return {"address": f"http://{_url_host(ip)}:{ready['port']}", "pid": self.proc.pid, "node_ip": ip,
                "node_id": ray.get_runtime_context().get_node_id(), "log": str(self.log_path)}

    async def _sweep(self, root: Path) -> None:
        from atropos.sandbox.contract.cgroupfs import remove_stale_slot_cgroups

        while True:
            for sweep in (functools.partial(remove_dead_hosts, root, self.data_dir), remove_stale_slot_cgroups):
                try:
                    await asyncio.to_thread(sweep)
                except Exception as exc:  # best effort: the next sweep, or the next host's start, retries
                    log.warning("sweep of dead hosts' leftovers failed: %s", exc)
            await asyncio.sleep(SWEEP_INTERVAL_S)

    async def wait(self) -> int | None:
        """Returns when the host process exits (fails at once if this actor dies)."""
        if self.proc is None:
            return None
        return await self.proc.wait()

    async def stop(self) -> None:
        from atropos.sandbox.contract.hostdirs import kill_processes_naming

        if self._sweeper is not None:
            self._sweeper.cancel()
        proc = self.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
        await asyncio.to_thread(kill_processes_naming, self.data_dir)
        await asyncio.to_thread(shutil.rmtree, self.data_dir, True)
        with contextlib.suppress(OSError):
            self.log_path.unlink()

    def _tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:].strip()
        except OSError:
            return "(no log)"


def _probe_address(address: str) -> None:
    """Fail within seconds when nothing listens at a ``host:port`` or ``ray://host:port`` address
    (``auto`` and addresses without a port are left to Ray)."""
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        conn = socket.create_connection((host.strip("[]"), int(port)), ADDRESS_PROBE_S)
    except OSError as exc:
        raise HostUnavailable(f"cannot reach the Ray cluster at {address}: {exc.strerror or exc} (is `ray start "
                              "--head` running there, and is this the GCS port, 6379 by default?)") from None
    with conn:
        answer = _http_answer(conn)
    if answer:
        # e.g. the dashboard (8265): ray.init would wait on it for minutes
        raise HostUnavailable(f"{address} is not Ray's control service (GCS): an HTTP/1 server answered there "
                              f"({answer}). Give the GCS address (`ray start --head --port`, 6379 by default; "
                              "the dashboard's is 8265), or ray://host:10001 for Ray Client") from None


def _http_answer(conn: socket.socket) -> str:
    """What an HTTP/1 server at the other end says to a plain request (its status line and Server
    header), or "" for anything else: Ray's GCS and Ray Client speak gRPC (HTTP/2 only) and close or
    answer in binary."""
    try:
        conn.settimeout(ADDRESS_PROBE_S)
        conn.sendall(b"GET / HTTP/1.0\r\nHost: ray-probe\r\n\r\n")
        head = conn.recv(1024)
    except OSError:
        return ""
    if not head.startswith(b"HTTP/"):
        return ""
    lines = head.decode("latin-1").split("\r\n")
    server = next((ln.split(":", 1)[1].strip() for ln in lines[1:] if ln.lower().startswith("server:")), "")
    return lines[0] + (f", Server: {server}" if server else "")


def _locked_log(path: Path) -> IO[bytes]:
    """The host's log, opened and ``flock``-ed: the host inherits it as its stderr, so the lock
    is held while the host (or this actor) lives, and freed by the kernel when both are gone."""
    while True:
        f = open(path, "ab")  # returned: the caller's with closes it
        fcntl.flock(f, fcntl.LOCK_EX)  # waits only for a remove_dead_hosts holding it to unlink it
        if os.fstat(f.fileno()).st_nlink:
            return f
        f.close()  # removed as a dead host's just before we locked it: a new file


def remove_dead_hosts(root: Path, keep: Path) -> list[str]:
    """Remove the data dirs and logs under ``root`` (one pool's, on this node) of hosts no longer
    alive: their log's lock is free. Returns the names removed."""
    from atropos.sandbox.contract.hostdirs import kill_processes_naming

    removed = []
    for log_path in sorted(root.glob("*.log")):
        data_dir = log_path.with_suffix("")
        if data_dir == keep:
            continue
        try:
            fd = os.open(log_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its host runs
            kill_processes_naming(data_dir)  # a sandbox that outlived its host
            shutil.rmtree(data_dir, ignore_errors=True)
            log_path.unlink(missing_ok=True)
            removed.append(data_dir.name)
        finally:
            os.close(fd)
    if removed:
        log.warning("removed the data of %d dead host(s) under %s: %s", len(removed), root, removed)
    return removed


def _url_host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def _is_loopback(address: str | None) -> bool:
    if not address:
        return False
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def _keep_ray_on_loopback() -> None:
    os.environ[RAY_LOOPBACK_ENV] = "0"  # for Ray imported after this, and the processes it starts
    if "ray" in sys.modules:  # imported already: the flag it read at import time
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False


class RayBackend(Backend):
    name = "ray"

    def __init__(self, cfg: RayBackendConfig | None = None) -> None:
        self.cfg = cfg or RayBackendConfig()
        self._address = self.cfg.address or os.environ.get("RAY_ADDRESS") or None
        loopback = self.cfg.loopback if self.cfg.loopback is not None else (
            self._address is None or _is_loopback(self._address))
        if loopback:
            _keep_ray_on_loopback()
        try:
            import ray
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ConfigError("the ray backend needs Ray: pip install 'atropos-sandbox[ray]'") from exc
        self._ray = ray
        self._loopback = loopback
        self._actor_cls: Any = None
        self._actors: dict[str, Any] = {}
        self._watchers: dict[str, asyncio.Task[Any]] = {}
        self._counter = 0
        self._owner = f"{socket.gethostname()}{NAME_SEP}{os.getpid()}"
        self._started_ray = False

    # -- Ray ------------------------------------------------------------------------------------
    def _connect(self) -> None:
        ray = self._ray
        if ray.is_initialized():
            if self._actor_cls is None:
                self._actor_cls = ray.remote(HostActor)
            return
        kw: dict[str, Any] = {"namespace": self.cfg.namespace, "include_dashboard": False, "log_to_driver": False,
                              "ignore_reinit_error": True}
        if self._loopback:
            kw["_node_ip_address"] = "127.0.0.1"
        if self._address is not None:
            _probe_address(self._address)
        try:
            if self._address is None:
                # no cluster named: a single-node Ray in this process (the node offers the resource)
                ray.init(resources={self.cfg.resource: 1024}, **kw)
                self._started_ray = True
            else:
                ray.init(address=self._address, **kw)
        except Exception as exc:
            raise HostUnavailable(f"cannot reach the Ray cluster at {self._address or '(local)'}: {exc}") from exc
        self._actor_cls = ray.remote(HostActor)

    def _name(self, n: int) -> str:
        return NAME_SEP.join((self.cfg.pool_id, self._owner, str(n)))

    def nodes(self) -> list[dict[str, Any]]:
        """The cluster's live nodes that can run hosts: id, address, resource total and hosts here."""
        self._connect()
        out = []
        for node in self._ray.nodes():
            total = node.get("Resources", {}).get(self.cfg.resource)
            if node.get("Alive") and total:
                out.append({"node_id": node["NodeID"], "address": node["NodeManagerAddress"],
                            self.cfg.resource: total})
        return out

    # -- Backend --------------------------------------------------------------------------------
    def offers(self) -> list[dict[str, float]]:
        """What each live node of the cluster offers (its resource totals)."""
        self._connect()
        return [dict(node.get("Resources", {})) for node in self._ray.nodes() if node.get("Alive")]

    def check_feasible(self) -> None:
        """Raise at once (``ConfigError``) when no live node could ever run a host: none offers
        ``resource_per_host`` of the resource and ``num_cpus`` CPUs. Ray would wait for such a node
        (an autoscaler may add one) and the start would fail only at its timeout."""
        c = self.cfg
        offers = self.offers()
        if any(o.get(c.resource, 0) >= c.resource_per_host and o.get("CPU", 0) >= c.num_cpus for o in offers):
            return
        shown = "; ".join(", ".join(f"{k}={v:g}" for k, v in sorted(o.items()) if not k.startswith("node:"))
                          for o in offers) or "none"
        raise ConfigError(f"no live node of the Ray cluster can run a sandbox host: one asks for {c.resource}="
                          f"{c.resource_per_host:g} and CPU={c.num_cpus:g}; the {len(offers)} live node(s) offer: "
                          f"{shown}. Give sandbox nodes the resource (ray start --resources='{{\"{c.resource}\": N}}')"
                          " or change RayBackendConfig.resource / resource_per_host / num_cpus")

    async def start_host(self) -> HostInfo:
        self._connect()
        await asyncio.to_thread(self.check_feasible)
        self._counter += 1
        name = self._name(self._counter)
        c = self.cfg
        host_dir = name.replace(NAME_SEP, "-")
        launch = {"slots": c.slots_per_host, "data_dir": str(c.data_root / c.pool_id / host_dir),
                  "image_store": str(c.image_store or c.data_root / "images"),
                  "limits": c.slot_limits().model_dump(),  # plain data: the actor validates it again
                  "prewarm": False, "unsafe_no_isolation": c.unsafe_no_isolation,  # the pool asks
                  "unsafe_no_cgroups": c.unsafe_no_cgroups, "log_level": c.host_log_level, "python": c.python}
        actor = self._actor_cls.options(
            name=name, namespace=c.namespace, num_cpus=c.num_cpus, resources={c.resource: c.resource_per_host},
            max_restarts=0, max_task_retries=0, max_concurrency=8,
            scheduling_strategy="SPREAD" if c.spread else "DEFAULT",
        ).remote(launch)
        self._actors[name] = actor
        token = new_token()
        try:
            # the actor gets the token's verifier only: any job of the cluster can run code in it
            ready = await asyncio.wait_for(_as_future(actor.start.remote(token_verifier(token), c.start_timeout_s)),
                                           c.start_timeout_s + 30)
        except BaseException as exc:
            await asyncio.shield(self._kill(name))
            if isinstance(exc, asyncio.TimeoutError):
                raise HostUnavailable(f"ray host {name} did not start within {c.start_timeout_s + 30:.0f} s: is there "
                                      f"a node with free {c.resource!r} ({c.resource_per_host:g}) and "
                                      f"{c.num_cpus:g} CPU? {self._placement_hint()}") from None
            if isinstance(exc, Exception):
                raise HostUnavailable(f"ray host {name} failed to start: {exc}") from exc
            raise
        if "error" in ready:
            await self._kill(name)
            raise _start_error(ready["error"])
        self._watchers[name] = asyncio.ensure_future(_as_future(actor.wait.remote()))
        log.info("ray host %s ready at %s on node %s", name, ready["address"], ready["node_id"][:12])
        return HostInfo(id=name, address=ready["address"], token=token, slots=c.slots_per_host,
                        labels={"backend": "ray", "node": ready["node_id"], "node_ip": ready["node_ip"],
                                "pid": str(ready["pid"])},
                        log=f"{ready['log']} on node {ready['node_ip']}" if ready.get("log") else None)

    def _placement_hint(self) -> str:
        try:
            total = self._ray.cluster_resources()
            free = self._ray.available_resources()
        except Exception as exc:  # the hint is best effort; the timeout is the error
            return f"(cannot read the cluster's resources: {exc})"
        r = self.cfg.resource
        return (f"the cluster has {r}={total.get(r, 0):g} (free {free.get(r, 0):g}) and CPU={total.get('CPU', 0):g} "
                f"(free {free.get('CPU', 0):g}): the others' hosts or tasks hold the rest")

    async def stop_host(self, host_id: str) -> None:
        actor = self._actors.get(host_id)
        if actor is not None:
            with contextlib.suppress(Exception, asyncio.TimeoutError):
                await asyncio.wait_for(_as_future(actor.stop.remote()), 20)
        await self._kill(host_id)

    async def _kill(self, host_id: str) -> None:
        actor = self._actors.pop(host_id, None)
        watcher = self._watchers.pop(host_id, None)
        if watcher is not None:
            watcher.cancel()
        if actor is not None:
            with contextlib.suppress(Exception):
                self._ray.kill(actor, no_restart=True)

    async def alive(self, host_id: str) -> bool:
        watcher = self._watchers.get(host_id)
        return watcher is not None and not watcher.done()

    def actor_names(self) -> list[str]:
        """Names of this pool's host actors alive in the namespace (any owner)."""
        self._connect()
        prefix = self.cfg.pool_id + NAME_SEP
        from ray.util import list_named_actors

        return sorted(a["name"] for a in list_named_actors(all_namespaces=True)
                      if a.get("namespace") == self.cfg.namespace and a["name"].startswith(prefix))

    async def reap_orphans(self) -> int:
        """Kill this pool's host actors whose owner (a pool process on this machine) is gone.
        Owned actors normally die with their owner; this catches the ones Ray has not yet killed."""
        self._connect()
        reaped = 0
        for name in await asyncio.to_thread(self.actor_names):
            try:
                _, owner_host, owner_pid, _ = name.split(NAME_SEP)
            except ValueError:
                continue
            if name in self._actors or owner_host != socket.gethostname() or not owner_pid.isdigit():
                continue
            if int(owner_pid) == os.getpid() or pid_alive(int(owner_pid)):
                continue
            try:
                actor = self._ray.get_actor(name, namespace=self.cfg.namespace)
            except ValueError:  # died meanwhile
                continue
            with contextlib.suppress(Exception, asyncio.TimeoutError):
                await asyncio.wait_for(_as_future(actor.stop.remote()), 20)
            with contextlib.suppress(Exception):
                self._ray.kill(actor, no_restart=True)
            reaped += 1
        return reaped

    async def close(self) -> None:
        await asyncio.gather(*(self.stop_host(h) for h in list(self._actors)), return_exceptions=True)
        if self._started_ray:
            self._ray.shutdown()


def _as_future(ref: Any) -> asyncio.Future[Any]:
    """An asyncio future for a Ray ObjectRef (awaiting it directly is Ray's own coroutine)."""
    return asyncio.wrap_future(ref.future())


def _start_error(tail: str) -> IsolationUnavailable | HostUnavailable:
    from atropos.sandbox.contract.hostdirs import ISOLATION_FAILED

    lines = tail.splitlines()
    marker = f"error: {ISOLATION_FAILED}"
    for i, line in enumerate(lines):
        if line.startswith(marker):
            return IsolationUnavailable("\n".join([line.removeprefix("error: "), *lines[i + 1:]]).strip())
    return HostUnavailable(f"ray sandbox host failed to start: {tail}")
