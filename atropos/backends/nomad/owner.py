"""Whose job is it: registering the sandbox job under its ID, and reaping one a crashed pool left.

The job's ``Meta`` records its owner (host name, boot id, pid and the pid's start time, an instance
id). A job with our ID is purged only when that owner is provably gone (same machine, and rebooted
since or the pid dead or reused); anything else is refused with what to do.

The host token travels by default in the Nomad variable ``nomad/jobs/<job_id>``, written right after
the job registers with ``EnforceIndex`` (so the ID is ours; the job starts at count 0, so no template
renders before); see the package docstring.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from typing import Any, Literal

from atropos import __version__
from atropos.backends.base import pid_alive
from atropos.backends.docker import boot_id
from atropos.backends.nomad.api import NomadAPI
from atropos.backends.nomad.job import (
    META_BOOT,
    META_INSTANCE,
    META_MANAGED,
    META_OWNER_HOST,
    META_OWNER_PID,
    META_OWNER_START,
    META_VERSION,
    render_job,
)
from atropos.errors import ConfigError, NomadAPIError

log = logging.getLogger(__name__)

OwnerState = Literal["me", "alive", "gone", "foreign-host"]


def process_start(pid: int) -> str:
    """The process's start time in clock ticks since boot ("" if unknown): with the pid, it tells a
    live owner from a reused pid (a restarted container gets the same small pids again)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


class JobOwner:
    """Registers the job as this pool's (with its token) and judges a job found under its ID."""

    def __init__(self, api: NomadAPI, token: str, instance: str, stats: dict[str, int]) -> None:
        self.api = api
        self.cfg = api.cfg
        self.token = token
        self.instance = instance
        self.stats = stats  # the backend's counters ("reaped")

    def meta(self) -> dict[str, str]:
        pid = os.getpid()
        return {META_MANAGED: "true", META_OWNER_PID: str(pid), META_OWNER_START: process_start(pid),
                META_OWNER_HOST: socket.gethostname(), META_BOOT: boot_id(), META_INSTANCE: self.instance,
                META_VERSION: __version__}

    def render_job(self, count: int = 0) -> dict[str, Any]:
        """What this backend registers: ``render_job(cfg)`` with its token and owner ``Meta``."""
        return render_job(self.cfg, count, token=self.token, meta=self.meta())

    def is_mine(self, job: dict[str, Any] | None) -> bool:
        return job is not None and (job.get("Meta") or {}).get(META_INSTANCE) == self.instance

    def owner_state(self, meta: dict[str, Any]) -> OwnerState:
        if meta.get(META_INSTANCE) == self.instance:
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

    async def claim_job_id(self) -> int:
        """Make the job ID free or ours: purge a leftover of a dead pool (1); refuse anything else."""
        c = self.cfg
        job = await self.api.read_job()
        if job is None:
            return 0
        meta = job.get("Meta") or {}
        where = f"Nomad job {c.job_id!r} (namespace {c.namespace!r})"
        if meta.get(META_MANAGED) != "true":
            raise ConfigError(f"{where} exists and was not registered by atropos-sandbox; refusing to replace it. "
                              "Choose another NomadBackendConfig.job_id or stop that job.")
        state = self.owner_state(meta)
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
        resp = await self.api.purge_job()
        if resp.status_code != 200:
            raise NomadAPIError("DELETE", self.api.job_path, resp.status_code, resp.text)
        self.stats["reaped"] += 1
        return 1

    async def register(self) -> None:
        """Register the job at count 0 (only if its ID is free), then its token variable."""
        c = self.cfg
        # The job first: EnforceIndex with index 0 registers only if the ID is free, so once it is in,
        # the ID (and the variable named after it) is ours. Its count is 0, so no template waits yet.
        body = {"Job": self.render_job(0), "EnforceIndex": True, "JobModifyIndex": 0}
        resp = await self.api.request("POST", "/v1/jobs", json=body)
        if resp.status_code != 200:
            raise self._register_error(resp.status_code, resp.text)
        if c.token_delivery == "variable":
            try:
                await self._put_token_variable()
            except BaseException:
                # No token, no host can ever start: do not leave a job behind that waits forever.
                with contextlib.suppress(Exception):
                    await self.api.purge_job()
                raise
        log.info("registered Nomad job %s in namespace %s at %s", c.job_id, c.namespace, c.address)

    def _register_error(self, status: int, text: str) -> Exception:
        c = self.cfg
        if status == 500 and "job already exists" in text:
            return ConfigError(f"Nomad job {c.job_id!r} was registered by someone else meanwhile; use another job_id")
        if status == 500 and "nonexistent namespace" in text:
            return ConfigError(f"Nomad has no namespace {c.namespace!r} (NomadBackendConfig.namespace / "
                               f"NOMAD_NAMESPACE): {text.strip()}")
        if status == 400 or (status == 500 and "occurred" in text):
            # 400: a malformed request; 500 with go-multierror text ("1 error occurred:"): validation
            return ConfigError(f"Nomad rejected the sandbox job {c.job_id!r}: {text.strip()}")
        return NomadAPIError("POST", "/v1/jobs", status, text)

    async def _put_token_variable(self) -> None:
        c = self.cfg
        body = {"Namespace": c.namespace, "Path": f"nomad/jobs/{c.job_id}", "Items": {"token": self.token}}
        resp = await self.api.request("PUT", self.api.var_path, json=body)
        if resp.status_code == 404:
            raise ConfigError(f"Nomad at {c.address} has no variables API (Nomad >= 1.4 needed; this backend "
                              "wants >= 2.0.4); or set token_delivery='job'")
        if resp.status_code != 200:
            raise NomadAPIError("PUT", self.api.var_path, resp.status_code, resp.text)

    async def remove(self) -> None:
        """Purge the job and its token variable (close)."""
        await self.api.purge_job()
        if self.cfg.token_delivery == "variable":
            await self.api.request("DELETE", self.api.var_path)
