"""Sandbox hosts as allocations of one Nomad service job (Nomad HTTP API through ``httpx.AsyncClient``).

Contract: ``docs/nomad-api.md``. The job this backend registers is the same as
``nomad/sandbox.hcl`` (``render_job()`` is the JSON form; a test parses the HCL and compares). One
task group ``hosts``; every allocation is one sandbox host (a docker container with N slots).

How the pool's calls map onto Nomad:

* ``start_host()`` adopts a *spare* (a live allocation no pool host uses, e.g. the replacement Nomad
  placed for a crashed or stopped one) or scales the group up by one (``POST /v1/job/:id/scale``,
  retried with backoff while Nomad answers ``job scaling blocked due to active deployment``), waits
  for the allocation to run, reads its address from the single-allocation read (``HostIP`` + dynamic
  port; list stubs carry no ports) and waits for the host's ``/v1/health``.
* ``stop_host()`` must make *that* allocation go away, but Nomad's scale-down always stops the
  allocations with the highest name index (``job.hosts[N]``), and stopping one allocation
  (``/v1/allocation/:id/stop``) makes Nomad *replace* it. So: when the retired host holds the highest
  index (after skipping spares above it), the count is lowered, which stops exactly it; otherwise the
  allocation is stopped and its replacement becomes a spare, which the next ``start_host()`` adopts
  (no scale call, already warm) and which is trimmed as soon as it is the highest index. The count
  is never lowered while anything above the retired hosts is in use or still being placed, so a
  scale-down can never hit a host the pool uses. ``removal_order()`` tells a caller which hosts to
  give back first (highest index) so that spares do not arise at all.
* ``alive()`` answers from a cache kept fresh by a blocking query on the job's allocations
  (``?index=``): a host is alive while its allocation is desired ``run``, ``running`` and has not
  restarted since it was handed out (a restarted host lost every lease). A crashed allocation is
  rescheduled by Nomad under a new ID with the same name: the old host is dead for the pool, the new
  allocation is a spare the pool adopts through ``start_host()``. Lost nodes look the same.
* Nomad unreachable: the first contact fails fast with ``HostUnavailable``; later, hosts already
  handed out keep working (the pool talks to them directly) and scaling retries until its deadline.
  ACL refusals (403) raise ``ConfigError`` naming the token and the capabilities it needs.
* A host the pool gives back dead while Nomad still reports its allocation running (a crash Nomad has
  not processed yet) is left alone for ``SUSPECT_GRACE_S``: Nomad fails and reschedules it, and the
  replacement (same name, ``PreviousAllocation`` = the old one) is what the next ``start_host()``
  adopts. Only a host still "running" after that (hung) is stopped like any other. A task that cannot
  even start (``Driver Failure``, ``Failed Validation``, ``Setup Failure``) fails ``start_host()`` at
  once with Nomad's message instead of waiting out ``start_timeout_s``.
* ``reap_orphans()`` purges a job with the same ID left by a crashed pool, only when the owner
  recorded in the job's ``Meta`` (host name, boot id, pid) is gone; ``close()`` purges the job.

The host token is generated per pool and never reaches a slot: by default it is written to the Nomad
variable ``nomad/jobs/<job_id>`` (readable only by the job's own tasks through workload identity and
by ACL tokens with variable read) right after the job registers with ``EnforceIndex`` (so the ID is
ours; the job starts at count 0, so nothing renders before), and rendered by a template into the task
environment (``ATROPOS_SANDBOX_TOKEN``); the sandbox server pops it from its environment at start and
runs every slot with an empty environment in its own PID namespace. ``token_delivery="env"`` puts it
in the job's ``Env`` instead (visible to every ACL token that can read the job; for clusters without
variables).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import ssl
import time
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator

from atropos import __version__
from atropos.backends.base import Backend, HostInfo, new_token, pid_alive
from atropos.backends.docker import boot_id
from atropos.errors import ConfigError, HostUnavailable
from atropos.sandbox.launch import HOST_TOKEN_ENV, HostLaunch

log = logging.getLogger(__name__)

NS = 1_000_000_000  # Nomad durations are int64 nanoseconds
GROUP = "hosts"
TASK = "host"
PORT_LABEL = "http"
CONTAINER_PORT = 8080
SLOT_UID = 1000
SLOT_CGROUP_DIR = "/run/atropos/cgroup"  # nomad/atropos-runc mounts the delegated subtree here
TOKEN_ENV = HOST_TOKEN_ENV
TMP_BYTES = 64 << 20
TMPFS_MODE = 0o1777  # HCL has no octal literals: nomad/sandbox.hcl writes 1023


def token_template(job_id: str) -> str:
    """The template that renders the token variable into the task environment."""
    return f'{{{{ with nomadVar "nomad/jobs/{job_id}" }}}}{TOKEN_ENV}={{{{ .token }}}}{{{{ end }}}}\n'

VARIABLE_PATH = re.compile(r"[a-zA-Z0-9\-_~/]{1,128}")  # nomad/structs/variables.go validVariablePath
SCALE_BLOCKED = "job scaling blocked due to active deployment"
NO_REGION = "No path to region"
START_FAILURES = ("Driver Failure", "Failed Validation", "Setup Failure")  # task events: the start itself failed
SUSPECT_GRACE_S = 5.0  # a host that stopped answering: how long Nomad gets to report (and reschedule) it
MIN_NOMAD_VERSION = "2.0.4"
REPLACEMENT_WAIT_S = 15.0  # a start waits this long for a rescheduled replacement before scaling up

META_MANAGED = "atropos_managed"
META_OWNER_PID = "atropos_owner_pid"
META_OWNER_HOST = "atropos_owner_host"
META_OWNER_START = "atropos_owner_start"
META_BOOT = "atropos_boot_id"
META_INSTANCE = "atropos_instance"
META_VERSION = "atropos_version"

_LIVE_CLIENT = ("pending", "running")
_GONE_CLIENT = ("complete", "lost")


class NomadBackendConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["nomad"] = "nomad"
    # -- the cluster --------------------------------------------------------------------------
    address: str = Field("http://127.0.0.1:4646", description="Nomad HTTP API address (https:// for TLS)")
    token: str | None = Field(None, repr=False, description="ACL token SecretID, sent as X-Nomad-Token")
    namespace: str = "default"
    region: str | None = Field(None, description="default: the agent's region")
    ca_cert: str | None = Field(None, description="PEM file of the CA that signed the agent's certificate")
    client_cert: str | None = Field(None, description="PEM client certificate (mTLS)")
    client_key: str | None = Field(None, description="PEM key of client_cert")
    verify: bool = Field(True, description="verify the agent's TLS certificate")
    # -- the job ------------------------------------------------------------------------------
    job_id: str = Field("atropos-sandbox", pattern=r"^[A-Za-z0-9_.-]{1,128}$")
    image: str = "atropos-sandbox:dev"
    slots_per_host: int = Field(16, ge=1, le=1023)
    cpu: int = Field(2000, ge=100, description="CPU MHz reserved per host")
    memory: int = Field(4096, ge=256, description="MB per host: the container's hard limit (tmpfs counts)")
    workspace_bytes: int = Field(2 << 30, ge=64 << 20, description="size of the tmpfs holding all workspaces")
    slot_workspace_bytes: int = Field(128 << 20, ge=1 << 20, description="what one slot can write (its own tmpfs)")
    pids_limit: int = Field(4096, ge=64)
    slot_memory_bytes: int = Field(1 << 30, ge=64 << 20, description="memory one slot may hold as a whole, tmpfs "
                                   "and memfd pages included (its cgroup, in the subtree atropos-runc delegates)")
    slot_pids: int = Field(512, ge=16, description="processes and threads per slot")
    slot_cpus: float = Field(1.0, ge=0, description="hard CPU quota per slot (CPUs); 0 = equal shares only")
    max_timeout_s: float = Field(600.0, gt=0)
    datacenters: list[str] = Field(default_factory=lambda: ["*"])
    seccomp_profile: str = Field("/etc/atropos-sandbox/seccomp.json",
                                 description="outer seccomp profile, a path on every Nomad client")
    runtime: str = Field("atropos-runc", description="OCI runtime: runc with /proc unmasked (nomad/README.md)")
    token_delivery: Literal["variable", "env"] = Field(
        "variable", description="variable: Nomad variable + template (default); env: the job's Env")
    # -- behaviour ----------------------------------------------------------------------------
    start_timeout_s: float = Field(120.0, gt=0, description="placement + image pull + health, per host")
    connect_timeout_s: float = Field(5.0, gt=0)
    request_timeout_s: float = Field(15.0, gt=0)
    watch_wait_s: float = Field(30.0, gt=0, description="wait of the blocking query on the job's allocations")
    spare_grace_s: float = Field(30.0, ge=0, description="an unused allocation is kept this long for adoption")
    purge_on_close: bool = True

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> NomadBackendConfig:
        """Settings from the Nomad CLI's variables (NOMAD_ADDR, NOMAD_TOKEN, NOMAD_NAMESPACE,
        NOMAD_REGION, NOMAD_CACERT, NOMAD_CLIENT_CERT, NOMAD_CLIENT_KEY, NOMAD_SKIP_VERIFY) and
        ``ATROPOS_NOMAD_<FIELD>``; keyword arguments win."""
        env = dict(os.environ if environ is None else environ)
        data: dict[str, Any] = {}
        for var, name in (("NOMAD_ADDR", "address"), ("NOMAD_TOKEN", "token"), ("NOMAD_NAMESPACE", "namespace"),
                          ("NOMAD_REGION", "region"), ("NOMAD_CACERT", "ca_cert"),
                          ("NOMAD_CLIENT_CERT", "client_cert"), ("NOMAD_CLIENT_KEY", "client_key")):
            if env.get(var):
                data[name] = env[var]
        if env.get("NOMAD_SKIP_VERIFY", "").lower() in ("1", "true", "yes"):
            data["verify"] = False
        for name in cls.model_fields:
            value = None if name == "kind" else env.get(f"ATROPOS_NOMAD_{name.upper()}")
            if value is not None:
                data[name] = [v.strip() for v in value.split(",") if v.strip()] if name == "datacenters" else value
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(data)

    def build(self) -> NomadBackend:
        return NomadBackend(self)

    @model_validator(mode="after")
    def _slot_fits(self) -> NomadBackendConfig:
        if self.slot_workspace_bytes > self.workspace_bytes:
            raise ValueError(f"slot_workspace_bytes ({self.slot_workspace_bytes}) exceeds workspace_bytes "
                             f"({self.workspace_bytes}), the tmpfs holding every slot's workspace")
        return self

    @model_validator(mode="after")
    def _variable_path_valid(self) -> NomadBackendConfig:
        # Nomad refuses variable paths outside ^[a-zA-Z0-9-_~/]{1,128}$ (no "." : it is the template
        # syntax's separator), and the token lives at nomad/jobs/<job_id>.
        path = f"nomad/jobs/{self.job_id}"
        if self.token_delivery == "variable" and not VARIABLE_PATH.fullmatch(path):
            raise ValueError(f"job_id {self.job_id!r} cannot name the Nomad variable {path!r} the token is "
                             "delivered through (letters, digits, '-', '_', '~' only; at most 117 characters); "
                             "rename the job or set token_delivery='env'")
        return self


class NomadAPIError(HostUnavailable):
    """Nomad answered with an unexpected status (the body is Nomad's plain-text error)."""

    def __init__(self, method: str, path: str, status: int, body: str) -> None:
        super().__init__(f"Nomad {method} {path} answered {status}: {body.strip()}")
        self.status = status
        self.body = body


class NomadUnreachable(HostUnavailable):
    """No answer from the Nomad agent (connection refused, timeout, TLS failure)."""


class _JobGone(Exception):
    pass


class _AllocDied(Exception):
    def __init__(self, description: str, start_error: str | None = None) -> None:
        super().__init__(description)
        self.start_error = start_error  # the driver could not start the task at all (see _start_error)

    @classmethod
    def of(cls, alloc: dict[str, Any]) -> _AllocDied:
        return cls(describe_alloc(alloc), _start_error(alloc))


@dataclass
class _Host:
    alloc_id: str
    name: str
    restarts: int
    info: HostInfo


def process_start(pid: int) -> str:
    """The process's start time in clock ticks since boot ("" if unknown): with the pid, it tells a
    live owner from a reused pid (a restarted container gets the same small pids again)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def name_index(name: str) -> int:
    """``job.group[3]`` -> 3 (-1 when the name has no index)."""
    try:
        return int(name.rsplit("[", 1)[1].rstrip("]"))
    except (IndexError, ValueError):
        return -1


def _restarts(alloc: dict[str, Any]) -> int:
    state = (alloc.get("TaskStates") or {}).get(TASK) or {}
    return int(state.get("Restarts") or 0)


def _is_live(alloc: dict[str, Any]) -> bool:
    """Holds a name in Nomad's reconciler: desired run and not finished (failed ones too)."""
    return alloc.get("DesiredStatus") == "run" and alloc.get("ClientStatus") not in _GONE_CLIENT


def _is_usable(alloc: dict[str, Any]) -> bool:
    return alloc.get("DesiredStatus") == "run" and alloc.get("ClientStatus") in _LIVE_CLIENT


def _task_events(alloc: dict[str, Any]) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = ((alloc.get("TaskStates") or {}).get(TASK) or {}).get("Events") or []
    return events


def _event_detail(ev: dict[str, Any]) -> str:
    """What a task event says went wrong ("" if nothing)."""
    return str(ev.get("DriverError") or ev.get("SetupError") or ev.get("ValidationError")
               or ev.get("DisplayMessage") or "")


def _start_error(alloc: dict[str, Any]) -> str | None:
    """The task event saying the container could not even be started (driver failure, bad driver
    config, setup failure), or None. Nomad reschedules such an allocation like any crash, but the
    next one almost always fails the same way (privileged mode off, a missing runtime or image)."""
    for ev in reversed(_task_events(alloc)):
        if ev.get("Type") in START_FAILURES:
            detail = _event_detail(ev)
            return f"{ev['Type']}: {detail}" if detail else str(ev["Type"])
    return None


def describe_alloc(alloc: dict[str, Any]) -> str:
    """One line on why an allocation is where it is, with its last task events."""
    parts = [f"{alloc.get('Name', '?')} ({str(alloc.get('ID', ''))[:8]}) is "
             f"{alloc.get('ClientStatus', '?')}/{alloc.get('DesiredStatus', '?')}"]
    why = alloc.get("DesiredDescription") or alloc.get("ClientDescription")
    if why:
        parts.append(f": {why}")
    msgs = []
    for ev in _task_events(alloc)[-4:]:
        detail = _event_detail(ev) or ev.get("RestartReason") or ""
        msgs.append(f"{ev.get('Type', '?')}" + (f" ({detail})" if detail else ""))
    if msgs:
        parts.append("; events: " + ", ".join(msgs))
    return "".join(parts)


def alloc_address(alloc: dict[str, Any], label: str = PORT_LABEL) -> str:
    """``http://HostIP:port`` of a dynamic port, from a *single* allocation read."""
    res = alloc.get("AllocatedResources") or {}
    shared = res.get("Shared") or {}
    ip, port = None, None
    for p in shared.get("Ports") or []:
        if p.get("Label") == label:
            ip, port = p.get("HostIP"), p.get("Value")
    if not (ip and port):
        networks = list(shared.get("Networks") or [])
        for task_res in (res.get("Tasks") or {}).values():
            networks += (task_res or {}).get("Networks") or []
        for net in networks:
            for p in (net.get("DynamicPorts") or []) + (net.get("ReservedPorts") or []):
                if p.get("Label") == label:
                    ip, port = net.get("IP"), p.get("Value")
    if not (ip and port):
        raise HostUnavailable(f"allocation {alloc.get('ID')} has no address for port {label!r}")
    host = f"[{ip}]" if ":" in str(ip) else str(ip)
    return f"http://{host}:{int(port)}"


def render_job(cfg: NomadBackendConfig, count: int = 0, *, token: str | None = None,
               meta: dict[str, str] | None = None) -> dict[str, Any]:
    """The sandbox job as the HTTP API takes it (``{"Job": render_job(cfg)}``): ``nomad/sandbox.hcl``
    in JSON. ``token`` matters only with ``token_delivery="env"``; ``meta`` is the owner record."""
    c = cfg
    tmpfs = [
        {"type": "tmpfs", "target": "/tmp", "readonly": False,
         "tmpfs_options": [{"size": TMP_BYTES, "mode": TMPFS_MODE}]},
        {"type": "tmpfs", "target": "/slots", "readonly": False,
         "tmpfs_options": [{"size": c.workspace_bytes, "mode": TMPFS_MODE}]},
    ]
    task: dict[str, Any] = {
        "Name": TASK,
        "Driver": "docker",
        "User": f"{SLOT_UID}:{SLOT_UID}",  # nothing in the container is uid 0 (isolation.md (a))
        "Config": {
            "image": c.image,
            "ports": [PORT_LABEL],
            # the image's entrypoint is `python3 -m atropos.sandbox`; per-slot cgroups in the subtree the
            # atropos-runc runtime delegates (nomad/README.md)
            "args": HostLaunch(host="0.0.0.0", port=CONTAINER_PORT, slots=c.slots_per_host, data_dir="/slots/data",
                               max_timeout_s=c.max_timeout_s, workspace_bytes=c.slot_workspace_bytes,
                               cgroup_dir=SLOT_CGROUP_DIR, slot_memory_bytes=c.slot_memory_bytes,
                               slot_pids=c.slot_pids, slot_cpus=c.slot_cpus).args(),
            "init": True,
            # resources.cpu is only a share (CPU weight) by default; the hard limit turns it into a CFS
            # quota, so a busy host cannot take more than it reserved (isolation.md: a hard CPU cap).
            "cpu_hard_limit": True,
            "cap_drop": ["ALL"],
            # Nomad inlines the profile file of the client; `systempaths=unconfined` is a docker
            # CLI option the Engine API rejects, so the runtime wrapper unmasks /proc instead.
            "security_opt": ["no-new-privileges", f"seccomp={c.seccomp_profile}"],
            "runtime": c.runtime,
            "readonly_rootfs": True,
            "pids_limit": c.pids_limit,
            "mount": tmpfs,
            # slirp4netns: slots leased with network get their own namespace (atropos.sandbox.network)
            "devices": [{"host_path": "/dev/net/tun", "container_path": "/dev/net/tun"}],
        },
        "Resources": {"CPU": c.cpu, "MemoryMB": c.memory},
        "KillTimeout": 10 * NS,
    }
    if c.token_delivery == "variable":
        task["Templates"] = [{"EmbeddedTmpl": token_template(c.job_id), "DestPath": "secrets/host.env",
                              "Envvars": True, "ChangeMode": "noop"}]
    else:
        task["Env"] = {TOKEN_ENV: token or "<generated per pool>"}
    group: dict[str, Any] = {
        "Name": GROUP,
        "Count": count,
        "Update": {"MaxParallel": 0},  # no deployments: a scale is never blocked by our own scaling
        "Networks": [{"Mode": "host", "DynamicPorts": [{"Label": PORT_LABEL, "To": CONTAINER_PORT}]}],
        # A restarted host has lost its leases: fail and let Nomad reschedule (new ID, same name).
        "RestartPolicy": {"Attempts": 0, "Interval": 300 * NS, "Delay": 5 * NS, "Mode": "fail"},
        "ReschedulePolicy": {"Delay": 5 * NS, "DelayFunction": "exponential", "MaxDelay": 60 * NS,
                             "Unlimited": True},
        "Tasks": [task],
    }
    job: dict[str, Any] = {
        "ID": c.job_id,
        "Name": c.job_id,
        "Type": "service",
        "Namespace": c.namespace,
        "Datacenters": list(c.datacenters),
        "Constraints": [
            {"LTarget": "${attr.kernel.name}", "RTarget": "linux", "Operand": "="},
            {"LTarget": "${attr.nomad.version}", "RTarget": f">= {MIN_NOMAD_VERSION}", "Operand": "semver"},
        ],
        "TaskGroups": [group],
    }
    if meta is not None:
        job["Meta"] = dict(meta)
    if c.region:
        job["Region"] = c.region
    return job


class NomadBackend(Backend):
    name = "nomad"

    def __init__(self, cfg: NomadBackendConfig | None = None) -> None:
        self.cfg = cfg or NomadBackendConfig()
        self._token = new_token()  # one per pool; see the module docstring for how it travels
        self._instance = new_token()[:12]
        self._http: httpx.AsyncClient | None = None
        self._probe_http: httpx.AsyncClient | None = None  # stop_host's liveness probes, see _answers
        self._setup_lock = asyncio.Lock()
        self._lock = asyncio.Lock()  # count changes, claims and stops
        self._registered = False
        self._closed = False
        self._allocs: dict[str, dict[str, Any]] = {}
        self._alloc_index = 0
        self._changed = asyncio.Event()
        self._tidy_wanted = asyncio.Event()
        self._back_online = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None
        self._janitor: asyncio.Task[None] | None = None
        self._hosts: dict[str, _Host] = {}  # handed to the pool
        self._claimed: set[str] = set()  # handed out or being started
        self._retired: set[str] = set()  # given back by the pool, still running
        self._removing: set[str] = set()  # trimmed by a count change, stopping
        self._suspects: dict[str, float] = {}  # given back dead while Nomad says running -> retire deadline
        self._unclaimed_since: dict[str, float] = {}
        self._pending_starts = 0
        self._scale_reservations = 0
        self._replacement_reservations = 0
        self.nomad_reachable: bool | None = None
        self.stats: dict[str, int] = {k: 0 for k in (
            "scale_up", "scale_down", "scale_blocked", "alloc_stop", "adopted", "reaped", "unreachable")}

    # -- HTTP ---------------------------------------------------------------------------------
    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            c = self.cfg
            headers = {"User-Agent": f"atropos-sandbox/{__version__}"}
            if c.token:
                headers["X-Nomad-Token"] = c.token
            self._http = httpx.AsyncClient(
                base_url=c.address.rstrip("/"), headers=headers, verify=self._tls(),
                timeout=httpx.Timeout(c.request_timeout_s, connect=c.connect_timeout_s),
            )
        return self._http

    def _tls(self) -> ssl.SSLContext | bool:
        c = self.cfg
        if not c.address.startswith("https://"):
            return True
        try:
            ctx = ssl.create_default_context(cafile=c.ca_cert)
            if not c.verify:
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            if c.client_cert:
                ctx.load_cert_chain(c.client_cert, c.client_key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"Nomad TLS settings unusable (ca_cert/client_cert/client_key): {exc}") from exc
        return ctx

    async def _request(self, method: str, path: str, *, json: Any = None, params: dict[str, str] | None = None,
                       timeout: float | None = None) -> httpx.Response:
        query = {"namespace": self.cfg.namespace}
        if self.cfg.region:
            query["region"] = self.cfg.region
        query.update(params or {})
        kw: dict[str, Any] = {}
        if timeout is not None:
            kw["timeout"] = httpx.Timeout(timeout, connect=self.cfg.connect_timeout_s)
        try:
            resp = await self._client().request(method, path, json=json, params=query, **kw)
        except httpx.TransportError as exc:
            self.nomad_reachable = False
            detail = f"{type(exc).__name__}: {exc or 'no detail'}"
            if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
                # Connected, but no answer: a wedged agent, or something else listening on that port.
                spent = timeout if timeout is not None else self.cfg.request_timeout_s
                raise NomadUnreachable(
                    f"Nomad at {self.cfg.address} accepted the connection but did not answer {method} {path} "
                    f"within {spent:g}s ({detail}); is NomadBackendConfig.address (NOMAD_ADDR) a Nomad agent, "
                    "and is it healthy?") from exc
            raise NomadUnreachable(
                f"cannot reach Nomad at {self.cfg.address} ({detail}); "
                "is the agent running and NomadBackendConfig.address (NOMAD_ADDR) right?") from exc
        if self.nomad_reachable is False:
            self._back_online.set()  # wake the watcher out of its backoff
        self.nomad_reachable = True
        if resp.status_code == 403:
            raise ConfigError(self._acl_message(method, path, resp.text))
        if resp.status_code == 500 and NO_REGION in resp.text:
            raise ConfigError(f"Nomad at {self.cfg.address} has no path to region {self.cfg.region!r} "
                              "(NomadBackendConfig.region / NOMAD_REGION): a typo, or the regions are not federated")
        return resp

    def _acl_message(self, method: str, path: str, body: str) -> str:
        c = self.cfg
        who = ("no ACL token is configured (NomadBackendConfig.token / NOMAD_TOKEN)" if not c.token
               else "the ACL token in NomadBackendConfig.token (NOMAD_TOKEN) was refused: unknown, expired or "
                    "without the permission")
        need = "submit-job, read-job, scale-job, alloc-lifecycle"
        if c.token_delivery == "variable":
            need += f", and variables write on nomad/jobs/{c.job_id}"
        return (f"Nomad at {c.address} denied {method} {path} (403 {body.strip()!r}): {who}. The pool's token "
                f"needs, in namespace {c.namespace!r}: {need}.")

    async def _json(self, method: str, path: str, **kw: Any) -> Any:
        resp = await self._request(method, path, **kw)
        if resp.status_code != 200:
            raise NomadAPIError(method, path, resp.status_code, resp.text)
        return resp.json()

    @property
    def _job_path(self) -> str:
        return f"/v1/job/{quote(self.cfg.job_id, safe='')}"

    async def _purge_job(self) -> httpx.Response:
        return await self._request("DELETE", self._job_path, params={"purge": "true"})

    async def _read_job(self) -> dict[str, Any] | None:
        resp = await self._request("GET", self._job_path)
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise NomadAPIError("GET", self._job_path, resp.status_code, resp.text)
        job: dict[str, Any] = resp.json()
        return job

    # -- the job ------------------------------------------------------------------------------
    def owner_meta(self) -> dict[str, str]:
        pid = os.getpid()
        return {META_MANAGED: "true", META_OWNER_PID: str(pid), META_OWNER_START: process_start(pid),
                META_OWNER_HOST: socket.gethostname(), META_BOOT: boot_id(), META_INSTANCE: self._instance,
                META_VERSION: __version__}

    def render_job(self, count: int = 0) -> dict[str, Any]:
        """What this backend registers: ``render_job(cfg)`` with its token and owner ``Meta``."""
        return render_job(self.cfg, count, token=self._token, meta=self.owner_meta())

    def _owner_state(self, meta: dict[str, Any]) -> Literal["me", "alive", "gone", "foreign-host"]:
        if meta.get(META_INSTANCE) == self._instance:
            return "me"
        host, boot, pid = meta.get(META_OWNER_HOST), meta.get(META_BOOT), str(meta.get(META_OWNER_PID, ""))
        if host != socket.gethostname():
            return "foreign-host"
        if boot != boot_id():
            return "gone"  # this machine rebooted since
        if not (pid.isdigit() and pid_alive(int(pid))):
            return "gone"
        started = str(meta.get(META_OWNER_START, ""))
        return "alive" if not started or started == process_start(int(pid)) else "gone"

    async def _claim_job_id(self) -> int:
        """Make the job ID free or ours: purge a leftover of a dead pool; refuse anything else."""
        c = self.cfg
        job = await self._read_job()
        if job is None:
            return 0
        meta = job.get("Meta") or {}
        where = f"Nomad job {c.job_id!r} (namespace {c.namespace!r})"
        if meta.get(META_MANAGED) != "true":
            raise ConfigError(f"{where} exists and was not registered by atropos-sandbox; refusing to replace it. "
                              "Choose another NomadBackendConfig.job_id or stop that job.")
        state = self._owner_state(meta)
        if state == "me":
            return 0
        owner = f"pid {meta.get(META_OWNER_PID)} on {meta.get(META_OWNER_HOST)}"
        if state == "alive":
            raise ConfigError(f"{where} belongs to a running pool ({owner}); use another job_id per pool.")
        if state == "foreign-host":
            raise ConfigError(f"{where} belongs to a pool on another machine ({owner}) whose liveness cannot be "
                              f"checked from here; if it is gone: nomad job stop -purge -namespace "
                              f"{c.namespace} {c.job_id}")
        log.warning("purging %s left by a crashed pool (%s)", where, owner)
        resp = await self._purge_job()
        if resp.status_code != 200:
            raise NomadAPIError("DELETE", self._job_path, resp.status_code, resp.text)
        self.stats["reaped"] += 1
        return 1

    async def _register(self) -> None:
        c = self.cfg
        # The job first: EnforceIndex with index 0 registers only if the ID is free, so once it is in,
        # the ID (and the variable named after it) is ours. Its count is 0, so no template waits yet.
        body = {"Job": self.render_job(0), "EnforceIndex": True, "JobModifyIndex": 0}
        resp = await self._request("POST", "/v1/jobs", json=body)
        if resp.status_code == 500 and "job already exists" in resp.text:
            raise ConfigError(f"Nomad job {c.job_id!r} was registered by someone else meanwhile; use another job_id")
        if resp.status_code == 500 and "nonexistent namespace" in resp.text:
            raise ConfigError(f"Nomad has no namespace {c.namespace!r} (NomadBackendConfig.namespace / "
                              f"NOMAD_NAMESPACE): {resp.text.strip()}")
        if resp.status_code == 400 or (resp.status_code == 500 and "occurred" in resp.text):
            # 400: a malformed request; 500 with go-multierror text ("1 error occurred:"): validation
            raise ConfigError(f"Nomad rejected the sandbox job {c.job_id!r}: {resp.text.strip()}")
        if resp.status_code != 200:
            raise NomadAPIError("POST", "/v1/jobs", resp.status_code, resp.text)
        if c.token_delivery == "variable":
            try:
                await self._put_token_variable()
            except BaseException:
                # No token, no host can ever start: do not leave a job behind that waits forever.
                with contextlib.suppress(Exception):
                    await self._purge_job()
                raise
        self._registered = True
        log.info("registered Nomad job %s in namespace %s at %s", c.job_id, c.namespace, c.address)

    @property
    def _var_path(self) -> str:
        return f"/v1/var/nomad/jobs/{quote(self.cfg.job_id, safe='')}"

    async def _put_token_variable(self) -> None:
        c = self.cfg
        body = {"Namespace": c.namespace, "Path": f"nomad/jobs/{c.job_id}", "Items": {"token": self._token}}
        resp = await self._request("PUT", self._var_path, json=body)
        if resp.status_code == 404:
            raise ConfigError(f"Nomad at {c.address} has no variables API (Nomad >= 1.4 needed; this backend "
                              "wants >= 2.0.4); or set token_delivery='env'")
        if resp.status_code != 200:
            raise NomadAPIError("PUT", self._var_path, resp.status_code, resp.text)

    async def _ensure_ready(self) -> None:
        if self._closed:
            raise HostUnavailable("the Nomad backend is closed")
        async with self._setup_lock:
            if not self._registered:
                job = await self._read_job()
                if job is not None and (job.get("Meta") or {}).get(META_INSTANCE) == self._instance:
                    # ours, but stopped or lost track of: bring it back at zero
                    log.warning("Nomad job %s was stopped from outside; registering it again", self.cfg.job_id)
                    await self._purge_job()
                else:
                    await self._claim_job_id()
                await self._register()
            if self._watcher is None or self._watcher.done():
                self._watcher = asyncio.ensure_future(self._watch())
            if self._janitor is None or self._janitor.done():
                self._janitor = asyncio.ensure_future(self._janitor_loop())

    # -- following the allocations ------------------------------------------------------------
    async def _watch(self) -> None:
        """Blocking queries on the job's allocations; the cache behind alive() and start_host()."""
        path = f"{self._job_path}/allocations"
        index, backoff = 0, 0.1
        wait = self.cfg.watch_wait_s
        while not self._closed:
            params = {"index": str(index), "wait": f"{int(wait * 1000)}ms"} if index else {}
            try:
                resp = await self._request("GET", path, params=params,
                                           timeout=wait + wait / 16 + self.cfg.request_timeout_s)
                if resp.status_code != 200:
                    raise NomadAPIError("GET", path, resp.status_code, resp.text)
                new = int(resp.headers.get("X-Nomad-Index", "0") or 0)
                if not index:
                    self._alloc_index = 0  # a fresh read is the truth (even after an agent restart)
                self._apply(resp.json(), new)
                # An index that goes backwards (agent restart, new leader) restarts the watch.
                index = new if new > index else (0 if new < index else index)
                if backoff > 0.1:
                    log.info("Nomad at %s reachable again", self.cfg.address)
                backoff = 0.1
                if new == 0:
                    await asyncio.sleep(0.5)
            except asyncio.CancelledError:
                raise
            except (HostUnavailable, ConfigError, ValueError) as exc:
                if backoff == 0.1:
                    log.warning("watching Nomad allocations failed (%s); known hosts keep working, retrying", exc)
                if isinstance(exc, NomadUnreachable):
                    self.stats["unreachable"] += 1
                self._back_online.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._back_online.wait(), backoff)
                backoff = min(backoff * 2, 5.0)
                index = 0

    def _apply(self, stubs: list[dict[str, Any]], index: int) -> None:
        """Replace the cache with a listing, unless it is older than what the cache holds."""
        if index < self._alloc_index:
            return
        self._alloc_index = index
        now = time.monotonic()
        self._allocs = {a["ID"]: a for a in stubs if a.get("TaskGroup", GROUP) == GROUP}
        for alloc_id in list(self._retired):
            alloc = self._allocs.get(alloc_id)
            if alloc is None or not _is_usable(alloc):
                self._retired.discard(alloc_id)  # Nomad stopped or replaces it by itself
        self._removing &= {a for a, x in self._allocs.items() if _is_live(x)}
        for alloc_id in list(self._suspects):
            if alloc_id not in self._allocs or not _is_usable(self._allocs[alloc_id]):
                del self._suspects[alloc_id]  # Nomad noticed: it reschedules it (or it is gone)
        spares = {a["ID"] for a in self._spares()}
        for alloc_id in spares - set(self._unclaimed_since):
            self._unclaimed_since[alloc_id] = now
        for alloc_id in set(self._unclaimed_since) - spares:
            del self._unclaimed_since[alloc_id]
        self._changed.set()
        self._changed = asyncio.Event()
        if self._retired:
            self._tidy_wanted.set()

    async def _wait_change(self, deadline: float) -> None:
        """Until the watch cache changes (at most ~1 s, so callers re-check); TimeoutError past deadline."""
        event = self._changed
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise asyncio.TimeoutError
        try:
            await asyncio.wait_for(event.wait(), min(remaining, 1.0))
        except asyncio.TimeoutError:
            if time.monotonic() >= deadline:
                raise

    def _spares(self) -> list[dict[str, Any]]:
        """Usable allocations nobody uses: adoptable by start_host, trimmable when on top."""
        taken = self._claimed | self._retired | self._removing | set(self._suspects)
        spares = [a for a in self._allocs.values() if _is_usable(a) and a["ID"] not in taken]
        return sorted(spares, key=lambda a: (a.get("ClientStatus") != "running", name_index(a.get("Name", ""))))

    # -- start ----------------------------------------------------------------------------------
    async def start_host(self) -> HostInfo:
        await self._ensure_ready()
        self._pending_starts += 1
        try:
            return await self._start(time.monotonic() + self.cfg.start_timeout_s)
        finally:
            self._pending_starts -= 1

    def _replacements_due(self) -> int:
        """Names whose allocation failed and that Nomad has yet to reschedule (a spare is coming)."""
        names = {name_index(a.get("Name", "")) for a in self._allocs.values()
                 if (a.get("DesiredStatus") == "run" and a.get("ClientStatus") == "failed"
                     and not a.get("NextAllocation")) or a["ID"] in self._suspects}
        return len(names)

    def _unreserve(self, reserved: str | None) -> None:
        if reserved == "scale":
            self._scale_reservations -= 1
        elif reserved == "replacement":
            self._replacement_reservations -= 1

    async def _start(self, deadline: float) -> HostInfo:
        """Claim a spare, or reserve the allocation a scale-up (or a pending reschedule) will bring.

        A start that scaled the group (or waits for Nomad to replace a failed allocation) has the
        first claim on the next spare; other starts only take spares beyond those reservations."""
        scaled = False
        reserved: str | None = None  # "scale" | "replacement"
        wait_until = deadline
        alloc_id: str | None = None
        last: str | None = None  # what killed an earlier allocation of this start
        try:
            while True:
                if alloc_id is None:
                    async with self._lock:
                        spares = self._spares()
                        reservations = self._scale_reservations + self._replacement_reservations
                        if len(spares) > (0 if reserved else reservations):
                            alloc_id = spares[0]["ID"]
                            self._claimed.add(alloc_id)
                            log.debug("start claims %s (%s, %s)", alloc_id[:8], spares[0].get("Name"),
                                      spares[0].get("ClientStatus"))
                            if reserved is None and not scaled:
                                self.stats["adopted"] += 1
                            self._unreserve(reserved)
                            reserved = None
                if alloc_id is None:
                    if reserved == "replacement" and (time.monotonic() >= wait_until
                                                      or self._replacements_due() == 0):
                        self._unreserve(reserved)  # no replacement (any more): scale up instead
                        reserved = None
                    if reserved is not None:
                        try:
                            await self._wait_change(wait_until)
                        except asyncio.TimeoutError:
                            if reserved == "scale":
                                raise
                        continue
                    if not scaled and self._replacements_due() > self._replacement_reservations:
                        reserved, wait_until = "replacement", min(deadline, time.monotonic() + REPLACEMENT_WAIT_S)
                        self._replacement_reservations += 1
                        continue
                    await self._scale_up(deadline)
                    scaled = True
                    reserved, wait_until = "scale", deadline
                    self._scale_reservations += 1
                    continue
                try:
                    return await self._await_host(alloc_id, deadline)
                except _AllocDied as died:
                    last = str(died)
                    log.warning("nomad host %s died while starting: %s", alloc_id[:8], died)
                    # Nomad reschedules it (new ID, same name): that replacement is this start's.
                    self._claimed.discard(alloc_id)
                    alloc_id = None
                    if died.start_error:
                        # Not a crash but a container that cannot start: waiting out start_timeout_s
                        # would only hide it. Nomad's replacement stays a spare for the next start.
                        raise HostUnavailable(
                            f"Nomad could not start a sandbox host of job {self.cfg.job_id!r}: {died.start_error} "
                            f"({died}); check the client's docker plugin configuration (nomad/client.hcl) "
                            "and the image") from None
                    reserved, wait_until = "scale", deadline
                    self._scale_reservations += 1
        except asyncio.TimeoutError:
            raise HostUnavailable(await self._start_failure(alloc_id, scaled, last)) from None
        except BaseException:
            with contextlib.suppress(Exception):
                await self._give_back(alloc_id, scaled)
            raise
        finally:
            self._unreserve(reserved)

    async def _start_failure(self, alloc_id: str | None, scaled: bool, last: str | None) -> str:
        msg = f"no Nomad sandbox host of job {self.cfg.job_id!r} became ready within {self.cfg.start_timeout_s:g}s"
        if alloc_id is not None and alloc_id in self._allocs:
            current = describe_alloc(self._allocs[alloc_id])
            # Keep what killed an earlier allocation of this start: the current one may only be pending.
            last = current if last in (None, current) else f"{current}; before it: {last}"
        msg += f" (last: {last or 'no allocation was placed'})"
        with contextlib.suppress(Exception):
            msg += await self._placement_problem()
        with contextlib.suppress(Exception):
            await self._give_back(alloc_id, scaled)
        return msg

    async def _placement_problem(self) -> str:
        evals = await self._json("GET", f"{self._job_path}/evaluations")
        for ev in sorted(evals, key=lambda e: e.get("CreateIndex", 0), reverse=True):
            failed = ev.get("FailedTGAllocs") or {}
            if failed:
                m = failed.get(GROUP) or next(iter(failed.values()))
                keys = ("NodesEvaluated", "NodesFiltered", "NodesAvailable", "NodesExhausted",
                        "ConstraintFiltered", "DimensionExhausted")
                detail = ", ".join(f"{k}={m.get(k)}" for k in keys if m.get(k))
                return f"; Nomad could not place it: {detail or m}"
        return ""

    async def _give_back(self, alloc_id: str | None, scaled: bool) -> None:
        """A failed start: return what it took (its allocation, or the unplaced count)."""
        if alloc_id is not None:
            self._claimed.discard(alloc_id)
            self._hosts.pop(alloc_id, None)
            if alloc_id in self._allocs and _is_usable(self._allocs[alloc_id]):
                self._retired.add(alloc_id)
            async with self._lock:
                await self._tidy()
            return
        if scaled:
            async with self._lock:
                job, allocs = await self._snapshot()
                live = {name_index(a["Name"]) for a in allocs if _is_live(a)}
                count = self._count(job)
                if count > len(live):  # our placement never happened: cancel it, stops nothing
                    await self._scale_to(count - 1, "start failed")

    async def _await_host(self, alloc_id: str, deadline: float) -> HostInfo:
        while True:
            alloc = self._allocs.get(alloc_id)
            if alloc is None or not _is_usable(alloc):
                raise _AllocDied.of(alloc) if alloc else _AllocDied(f"allocation {alloc_id} vanished")
            if alloc.get("ClientStatus") == "running":
                break
            await self._wait_change(deadline)
        full = await self._json("GET", f"/v1/allocation/{alloc_id}")
        if not _is_usable(full):
            raise _AllocDied.of(full)
        address = alloc_address(full)
        info = HostInfo(id=alloc_id, address=address, token=self._token, slots=self.cfg.slots_per_host,
                        labels={"backend": "nomad", "job": self.cfg.job_id, "alloc_name": full.get("Name", ""),
                                "node": full.get("NodeName") or full.get("NodeID", "")})
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {self._token}"}) as http:
            while True:
                current = self._allocs.get(alloc_id)
                if current is not None and not _is_usable(current):
                    raise _AllocDied.of(current)
                try:
                    resp = await http.get(f"{address}/v1/health", timeout=min(5.0, max(deadline - time.monotonic(),
                                                                                      0.1)))
                    if resp.status_code == 200:
                        break
                    if resp.status_code == 401:
                        raise ConfigError(f"sandbox host {address} (allocation {alloc_id[:8]}) rejected the pool's "
                                          "token: the token variable nomad/jobs/"
                                          f"{self.cfg.job_id} was changed by someone else")
                except httpx.TransportError:
                    pass
                if time.monotonic() >= deadline:
                    raise asyncio.TimeoutError
                await asyncio.sleep(0.1)
        self._hosts[alloc_id] = _Host(alloc_id, full.get("Name", ""), _restarts(full), info)
        log.info("nomad host %s (%s on %s) ready at %s", alloc_id[:8], info.labels["alloc_name"],
                 info.labels["node"], address)
        return info

    # -- scaling --------------------------------------------------------------------------------
    async def _snapshot(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The job and its allocations, read now (not from the watch cache, which it refreshes)."""
        job = await self._read_job()
        if job is None:
            raise _JobGone
        path = f"{self._job_path}/allocations"
        resp = await self._request("GET", path)
        if resp.status_code != 200:
            raise NomadAPIError("GET", path, resp.status_code, resp.text)
        allocs = [a for a in resp.json() if a.get("TaskGroup", GROUP) == GROUP]
        self._apply(allocs, int(resp.headers.get("X-Nomad-Index", "0") or 0))
        return job, allocs

    @staticmethod
    def _count(job: dict[str, Any]) -> int:
        for g in job.get("TaskGroups") or []:
            if g.get("Name") == GROUP:
                return int(g.get("Count") or 0)
        raise ConfigError(f"Nomad job {job.get('ID')!r} has no task group {GROUP!r}")

    async def _scale_to(self, count: int, why: str) -> httpx.Response:
        body = {"Count": count, "Target": {"Group": GROUP}, "Message": f"atropos-sandbox: {why}",
                "Meta": {META_INSTANCE: self._instance}}
        resp = await self._request("POST", f"{self._job_path}/scale", json=body)
        if resp.status_code == 404:
            raise _JobGone
        if resp.status_code == 200:
            log.info("scaled Nomad job %s to %d (%s)", self.cfg.job_id, count, why)
        return resp

    async def _scale_up(self, deadline: float) -> None:
        """Count + 1, retrying while a deployment blocks scaling or Nomad is unreachable."""
        backoff = 0.2
        while True:
            problem = ""
            try:
                async with self._lock:
                    job = await self._read_job()
                    if job is None or job.get("Stop"):
                        raise _JobGone
                    resp = await self._scale_to(self._count(job) + 1, "host wanted")
                if resp.status_code == 200:
                    self.stats["scale_up"] += 1
                    return
                if resp.status_code == 400 and SCALE_BLOCKED in resp.text:
                    self.stats["scale_blocked"] += 1
                    problem = resp.text.strip()
                    log.info("Nomad refused to scale %s (%s); retrying in %.1fs", self.cfg.job_id, problem, backoff)
                else:
                    raise NomadAPIError("POST", f"{self._job_path}/scale", resp.status_code, resp.text)
            except NomadUnreachable as exc:
                problem = str(exc)
            except _JobGone:
                log.warning("Nomad job %s is gone or stopped; registering it again", self.cfg.job_id)
                self._registered = False
                await self._ensure_ready()
                continue
            if time.monotonic() + backoff > deadline:
                raise HostUnavailable(f"could not scale Nomad job {self.cfg.job_id!r} up within "
                                      f"{self.cfg.start_timeout_s:g}s: {problem}")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    # -- stop -----------------------------------------------------------------------------------
    def removal_order(self, host_ids: list[str]) -> list[str]:
        """Hosts in the order they are cheapest to give back: highest name index first (a scale-down
        stops exactly those; others leave a spare behind until they are on top)."""
        def key(host_id: str) -> int:
            host = self._hosts.get(host_id)
            alloc = self._allocs.get(host_id)
            return name_index(host.name if host else (alloc or {}).get("Name", ""))

        return sorted(host_ids, key=key, reverse=True)

    async def stop_host(self, host_id: str) -> None:
        host = self._hosts.pop(host_id, None)
        self._claimed.discard(host_id)
        alloc = self._allocs.get(host_id)
        if self._closed or alloc is None or not _is_usable(alloc):
            return  # unknown, or already failed/lost: Nomad replaces it, the replacement is a spare
        # Until the probe below says otherwise it is a suspect: no spare a concurrent start could claim.
        self._suspects[host_id] = float("inf")
        if host is not None and not await self._answers(host.info):
            # Dead for the pool while Nomad still says running: most likely a crash Nomad has not
            # processed yet. Lowering the count now would stop it for good and place a new allocation;
            # left alone, Nomad fails it and reschedules a replacement under the same name
            # (PreviousAllocation = this one) that the next start adopts. Still "running" after the
            # grace (a hung host), it is given back like any other.
            log.info("nomad host %s does not answer; leaving it %gs for Nomad to reschedule", host_id[:8],
                     SUSPECT_GRACE_S)
            if host_id in self._suspects:  # (the watch may have dropped it already: Nomad noticed)
                self._suspects[host_id] = time.monotonic() + SUSPECT_GRACE_S
            self._tidy_wanted.set()
            return
        self._suspects.pop(host_id, None)
        if host_id not in self._allocs or not _is_usable(self._allocs[host_id]):
            return  # Nomad stopped or replaces it meanwhile
        self._retired.add(host_id)
        try:
            async with self._lock:
                await asyncio.wait_for(self._tidy(), self.cfg.request_timeout_s)
        except (HostUnavailable, asyncio.TimeoutError, _JobGone) as exc:
            log.warning("could not stop Nomad allocation %s now (%s); retrying in the background", host_id[:8], exc)
            self._tidy_wanted.set()

    async def _answers(self, info: HostInfo) -> bool:
        """Does the host's server answer at all (any HTTP status)?

        Every host given back is probed, so the client is made once (its TLS context is the costly
        part); without keep-alive, no probe holds a connection open to a host being stopped."""
        if self._probe_http is None:
            self._probe_http = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0))
        try:
            await self._probe_http.get(f"{info.address}/v1/health", timeout=1.0,
                                       headers={"Authorization": f"Bearer {info.token}"})
            return True
        except httpx.HTTPError:
            return False

    def _role(self, alloc: dict[str, Any], now: float) -> Literal["used", "idle", "removable"]:
        """used: a host in use (or in a state we cannot judge); removable: retired, or a spare past its
        grace; idle: neither (a spare in its grace, a failed one Nomad replaces, one being stopped, a
        suspect Nomad has yet to report)."""
        alloc_id = alloc["ID"]
        if alloc_id in self._claimed:
            return "used"
        status = alloc.get("ClientStatus")
        if status == "failed" or alloc_id in self._removing or alloc_id in self._suspects:
            return "idle"
        if status not in _LIVE_CLIENT:
            return "used"  # e.g. "unknown" (client disconnected): leave it alone
        if alloc_id in self._retired:
            return "removable"
        since = self._unclaimed_since.get(alloc_id, now)
        if self._pending_starts == 0 and now - since >= self.cfg.spare_grace_s:
            return "removable"
        return "idle"

    def _expired_suspects(self, now: float) -> list[str]:
        """Suspects Nomad has not reported within their grace (hung hosts: stop them)."""
        return [alloc_id for alloc_id, deadline in self._suspects.items() if deadline <= now]

    def _tidy_due(self) -> bool:
        now = time.monotonic()
        if self._retired or self._expired_suspects(now):
            return True
        return any(now - self._unclaimed_since.get(a["ID"], now) >= self.cfg.spare_grace_s for a in self._spares())

    async def _tidy(self) -> None:
        """Give back retired allocations (and spares past their grace): lower the count when they hold
        the highest names, else stop them so that Nomad replaces them with spares. Hold the lock."""
        if not self._tidy_due():
            return
        for alloc_id in self._expired_suspects(time.monotonic()):
            del self._suspects[alloc_id]
            self._retired.add(alloc_id)  # Nomad never reported it: a hung host, stop it
        job, allocs = await self._snapshot()
        count = self._count(job)
        now = time.monotonic()
        by_name: dict[int, list[dict[str, Any]]] = {}
        for a in allocs:
            if _is_live(a):
                by_name.setdefault(name_index(a.get("Name", "")), []).append(a)
        roles = {idx: {self._role(a, now) for a in group} for idx, group in by_name.items()}
        if count > len(by_name) and self._pending_starts == 0:
            # Placements nobody waits for (e.g. a blocked one of a start that gave up): cancelling
            # them stops nothing, and lets the count come down onto the names below.
            resp = await self._scale_to(len(by_name), "cancel placements nobody waits for")
            if resp.status_code == 200:
                count = len(by_name)

        top: list[int] = []
        for idx in sorted(by_name, reverse=True):
            if roles[idx] != {"removable"}:
                break
            top.append(idx)
        # Only when every name the count asks for is placed: a placement still pending could land
        # above the names we mean, and Nomad would stop it instead.
        if top and count == len(by_name):
            resp = await self._scale_to(count - len(top), f"{len(top)} host(s) given back")
            if resp.status_code == 200:
                self.stats["scale_down"] += 1
                for idx in top:
                    for a in by_name[idx]:
                        self._retired.discard(a["ID"])
                        self._removing.add(a["ID"])
                        self._unclaimed_since.pop(a["ID"], None)
            else:
                log.info("scale-down of %s refused (%s); later", self.cfg.job_id, resp.text.strip())
        highest_used = max((idx for idx, r in roles.items() if "used" in r), default=-1)
        for alloc_id in sorted(self._retired):
            alloc = next((a for a in allocs if a["ID"] == alloc_id), None)
            if alloc is None or not _is_usable(alloc):
                self._retired.discard(alloc_id)
                continue
            if name_index(alloc.get("Name", "")) > highest_used:
                continue  # nothing in use above it: a later pass lowers the count instead
            # A host in use sits above it: stop it now; Nomad places a replacement, a spare.
            resp = await self._request("POST", f"/v1/allocation/{alloc_id}/stop")
            if resp.status_code in (200, 404):
                self._retired.discard(alloc_id)
                # Stopping: until the watch shows it, the cache still says running, and it must
                # not pass for a spare that the next start_host would adopt.
                self._removing.add(alloc_id)
                self.stats["alloc_stop"] += 1
                log.info("stopped Nomad allocation %s (%s); its replacement is a spare", alloc_id[:8],
                         alloc.get("Name"))
            else:
                log.warning("stopping Nomad allocation %s failed: %s %s", alloc_id[:8], resp.status_code,
                            resp.text.strip())

    async def _janitor_loop(self) -> None:
        """Retries what stop_host could not finish and trims spares whose grace ran out."""
        while not self._closed:
            wait = max(self.cfg.spare_grace_s / 2, 0.5)
            if self._suspects:
                wait = min(wait, max(min(self._suspects.values()) - time.monotonic(), 0.05))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._tidy_wanted.wait(), wait)
            self._tidy_wanted.clear()
            if not self._tidy_due():
                continue
            try:
                async with self._lock:
                    await self._tidy()
            except asyncio.CancelledError:
                raise
            except (HostUnavailable, ConfigError, _JobGone) as exc:
                log.debug("background tidy failed: %s", exc)
                await asyncio.sleep(1.0)
            except Exception:
                log.exception("background tidy failed")
                await asyncio.sleep(1.0)
            await asyncio.sleep(0.2)

    # -- queries --------------------------------------------------------------------------------
    async def alive(self, host_id: str) -> bool:
        host = self._hosts.get(host_id)
        alloc = self._allocs.get(host_id)
        if host is None or alloc is None:
            return False
        return (alloc.get("DesiredStatus") == "run" and alloc.get("ClientStatus") == "running"
                and _restarts(alloc) == host.restarts)

    def allocations(self) -> list[dict[str, Any]]:
        """The cached allocation stubs of the job (from the blocking query)."""
        return list(self._allocs.values())

    def spare_ids(self) -> list[str]:
        return [a["ID"] for a in self._spares()]

    async def reap_orphans(self) -> int:
        """Purge a job with our ID left by a crashed pool (owner pid gone on this machine and boot)."""
        if self._closed:
            return 0
        async with self._setup_lock:
            if self._registered:
                return 0
            return await self._claim_job_id()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in (self._watcher, self._janitor):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (self._watcher, self._janitor) if t is not None), return_exceptions=True)
        if self._registered and self.cfg.purge_on_close:
            try:
                await self._purge_job()
                if self.cfg.token_delivery == "variable":
                    await self._request("DELETE", self._var_path)
                log.info("purged Nomad job %s", self.cfg.job_id)
            except (HostUnavailable, ConfigError) as exc:
                log.warning("could not purge Nomad job %s (%s); the next pool with this job_id reaps it",
                            self.cfg.job_id, exc)
        self._hosts.clear()
        self._claimed.clear()
        self._suspects.clear()
        for http in (self._http, self._probe_http):
            if http is not None:
                await http.aclose()
        self._http = self._probe_http = None
