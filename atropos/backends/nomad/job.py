"""The sandbox job this backend registers: ``nomad/sandbox.hcl`` as the HTTP API takes it.

One task group ``hosts``; every allocation is one sandbox host (a docker container with N slots).
A test parses the HCL and compares it with ``render_job()``.
"""

from __future__ import annotations

from typing import Any

from atropos.backends.nomad.config import NomadBackendConfig
from atropos.sandbox.contract.launch import HostLaunch

# What the package re-exports (atropos/backends/nomad/__init__.py takes this list as it is).
__all__ = ["GROUP", "META_BOOT", "META_INSTANCE", "META_MANAGED", "META_OWNER_HOST", "META_OWNER_PID",
           "META_OWNER_START", "META_VERSION", "TASK", "TOKEN_FILE", "TOKEN_PERMS", "render_job",
           "token_template"]

NS = 1_000_000_000  # Nomad durations are int64 nanoseconds
GROUP = "hosts"
TASK = "host"
PORT_LABEL = "http"
CONTAINER_PORT = 8080
SLOT_UID = 1000
IMAGE_VOLUME = "images"  # the group's name for the host volume of the task-image store (image_volume)
IMAGE_STORE_IN_TASK = "/images"
SLOT_CGROUP_DIR = "/run/atropos/cgroup"  # nomad/atropos-runc mounts the delegated subtree here
# The host token: rendered into the task's own secrets directory (per task, tmpfs, mounted into no
# other task), readable by the task's uid alone; the host reads it once and removes it. Never in the
# task's environment: /proc/<pid>/environ is readable by every process of the same uid.
TOKEN_FILE = "secrets/token"  # relative to the task directory, where templates render
TOKEN_PERMS = "0400"
TOKEN_FILE_IN_TASK = "${NOMAD_SECRETS_DIR}/token"  # the same file where the task sees it (/secrets): Nomad fills it in
TOKEN_PLACEHOLDER = "<generated per pool>"
TMP_BYTES = 64 << 20
TMPFS_MODE = 0o1777  # HCL has no octal literals: nomad/sandbox.hcl writes 1023
MIN_NOMAD_VERSION = "2.0.4"
# The host in its container sees only the container's addresses; Nomad interpolates the node's into
# the task's args, so network slots are denied the node's own address too (docs/containment.md).
NODE_ADDRESS_ARG = "--egress-machine-address=${attr.unique.network.ip-address}"

# The owner record in the job's Meta (see atropos/backends/nomad/owner.py).
META_MANAGED = "atropos_managed"
META_OWNER_PID = "atropos_owner_pid"
META_OWNER_HOST = "atropos_owner_host"
META_OWNER_START = "atropos_owner_start"
META_BOOT = "atropos_boot_id"
META_INSTANCE = "atropos_instance"
META_VERSION = "atropos_version"


def token_template(job_id: str) -> str:
    """The template that renders the token variable into the token file."""
    return f'{{{{ with nomadVar "nomad/jobs/{job_id}" }}}}{{{{ .token }}}}{{{{ end }}}}\n'


def render_job(cfg: NomadBackendConfig, count: int = 0, *, token: str | None = None,
               meta: dict[str, str] | None = None) -> dict[str, Any]:
    """The sandbox job as the HTTP API takes it (``{"Job": render_job(cfg)}``): ``nomad/sandbox.hcl``
    in JSON. ``token`` matters only with ``token_delivery="job"``; ``meta`` is the owner record."""
    c = cfg
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
        "TaskGroups": [_group(c, count, _task(c, token))],
    }
    if meta is not None:
        job["Meta"] = dict(meta)
    if c.region:
        job["Region"] = c.region
    return job


def _group(c: NomadBackendConfig, count: int, task: dict[str, Any]) -> dict[str, Any]:
    return {
        "Name": GROUP,
        "Count": count,
        "Update": {"MaxParallel": 0},  # no deployments: a scale is never blocked by our own scaling
        "Networks": [{"Mode": "host", "DynamicPorts": [{"Label": PORT_LABEL, "To": CONTAINER_PORT}]}],
        # A restarted host has lost its leases: fail and let Nomad reschedule (new ID, same name).
        "RestartPolicy": {"Attempts": 0, "Interval": 300 * NS, "Delay": 5 * NS, "Mode": "fail"},
        "ReschedulePolicy": {"Delay": 5 * NS, "DelayFunction": "exponential", "MaxDelay": 60 * NS,
                             "Unlimited": True},
        "Tasks": [task],
        **({"Volumes": {IMAGE_VOLUME: {"Name": IMAGE_VOLUME, "Type": "host", "Source": c.image_volume,
                                       "ReadOnly": False}}} if c.image_volume else {}),
    }


def _task(c: NomadBackendConfig, token: str | None) -> dict[str, Any]:
    task: dict[str, Any] = {
        "Name": TASK,
        "Driver": "docker",
        "User": f"{SLOT_UID}:{SLOT_UID}",  # nothing in the container is uid 0 (isolation.md (a))
        "Config": _docker_config(c),
        "Resources": {"CPU": c.cpu, "MemoryMB": c.memory},
        "KillTimeout": 10 * NS,
    }
    if c.image_volume:
        task["VolumeMounts"] = [{"Volume": IMAGE_VOLUME, "Destination": IMAGE_STORE_IN_TASK, "ReadOnly": False}]
    # "job": the token itself is the template (in the job spec, readable by whoever can read the job)
    data = token_template(c.job_id) if c.token_delivery == "variable" else f"{token or TOKEN_PLACEHOLDER}\n"
    # uid/gid: Nomad writes templates as its agent's user (root) by default; the task runs as SLOT_UID.
    # noop: a new token means a new pool, hence new allocations; the host read the file once anyway.
    task["Templates"] = [{"EmbeddedTmpl": data, "DestPath": TOKEN_FILE, "Perms": TOKEN_PERMS,
                          "Uid": SLOT_UID, "Gid": SLOT_UID, "ChangeMode": "noop"}]
    return task


def _docker_config(c: NomadBackendConfig) -> dict[str, Any]:
    tmpfs = [
        {"type": "tmpfs", "target": "/tmp", "readonly": False,
         "tmpfs_options": [{"size": TMP_BYTES, "mode": TMPFS_MODE}]},
        {"type": "tmpfs", "target": "/slots", "readonly": False,
         "tmpfs_options": [{"size": c.workspace_bytes, "mode": TMPFS_MODE}]},
    ]
    return {
        "image": c.image,
        "ports": [PORT_LABEL],
        # the image's entrypoint is `python3 -m atropos.sandbox`; per-slot cgroups in the subtree the
        # atropos-runc runtime delegates (nomad/README.md). No --no-prewarm: the same job runs by hand
        # (nomad/sandbox.hcl), so its hosts prewarm on their own at start, each within its own hard CPU
        # reservation (cpu_hard_limit), not taking a starting neighbour's; the pool's prewarm request
        # (Backend.prewarm) then finds nothing left to start.
        "args": [*HostLaunch(host="0.0.0.0", port=CONTAINER_PORT, slots=c.slots_per_host, data_dir="/slots/data",
                             limits=c.slot_limits(), cgroup_dir=SLOT_CGROUP_DIR,
                             token_file=TOKEN_FILE_IN_TASK,
                             image_store=IMAGE_STORE_IN_TASK if c.image_volume else None).args(), NODE_ADDRESS_ARG],
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
        # slirp4netns: slots leased with network get their own namespace (atropos.sandbox.host.isolation.network)
        "devices": [{"host_path": "/dev/net/tun", "container_path": "/dev/net/tun"}],
    }
