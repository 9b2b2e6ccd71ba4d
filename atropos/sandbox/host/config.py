"""Configuration of one sandbox host (the server that owns N slots)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from atropos.sandbox.contract.egress import EgressPolicy
from atropos.sandbox.contract.hostdirs import default_data_dir
from atropos.sandbox.contract.launch import (
    SlotCpus,
    SlotLimits,
    SlotMemoryBytes,
    SlotPids,
    SlotWorkspaceBytes,
)
from atropos.sandbox.contract.protocol import CallTimeouts, DefaultTimeoutS, MaxTimeoutS
from atropos.sandbox.inslot import inslot_protocol as slot_protocol

RUN_DIR_INODES = 1024  # the run dir holds the terminal's socket and log, nothing else


_SLOT = SlotLimits()  # the defaults of the limits a host is launched with (declared there)


class Limits(BaseModel):
    """Resource limits applied inside each slot's sandbox (rlimits, tmpfs sizes)."""

    nproc: int = Field(256, ge=8, description="processes per slot sandbox (RLIMIT_NPROC, per user namespace)")
    address_space_bytes: int = Field(4 << 30, ge=64 << 20, description="RLIMIT_AS per process")
    file_size_bytes: int = Field(1 << 30, ge=1 << 20, description="RLIMIT_FSIZE: largest file a slot can write")
    open_files: int = Field(1024, ge=64, description="RLIMIT_NOFILE")
    cpu_seconds_per_call: int = Field(600, ge=1, description="RLIMIT_CPU of each call's main process")
    tmp_bytes: int = Field(256 << 20, ge=1 << 20, description="size of the slot's private /tmp tmpfs")
    shm_bytes: int = Field(64 << 20, ge=1 << 20, description="size of the slot's /dev/shm tmpfs")
    # Every inode of a tmpfs is kernel memory that no size cap counts (~1.7 KiB per empty file):
    # an uncapped tmpfs lets one call pin gigabytes with empty files.
    tmp_inodes: int = Field(1 << 16, ge=64, description="files and directories a slot can create in /tmp")
    shm_inodes: int = Field(1 << 12, ge=64, description="files and directories a slot can create in /dev/shm")
    workspace_bytes: SlotWorkspaceBytes = _SLOT.workspace_bytes  # each slot's workspace (a fork's upper layer)
    workspace_inodes: int = Field(1 << 18, ge=1024, description="files and directories a slot can create")

    def workspace_quota(self, uid: int | None) -> dict[str, int | None] | None:
        """The mount helper's view of the cap (None: uncapped)."""
        if not self.workspace_bytes:
            return None
        return {"bytes": self.workspace_bytes, "inodes": self.workspace_inodes, "uid": uid}

    def scratch_quotas(self, uid: int | None) -> list[dict[str, Any]]:
        """The mount helper's caps of the run dir (the terminal's socket and log), /tmp and /dev/shm."""
        return [{"bytes": self.tmp_bytes, "inodes": RUN_DIR_INODES, "uid": uid},
                {"bytes": self.tmp_bytes, "inodes": self.tmp_inodes, "uid": uid, "mode": 0o1777},
                {"bytes": self.shm_bytes, "inodes": self.shm_inodes, "uid": uid, "mode": 0o1777}]

    def rlimits(self) -> dict[str, int]:
        return {"nproc": self.nproc, "as": self.address_space_bytes, "fsize": self.file_size_bytes,
                "nofile": self.open_files, "core": 0}


class HostConfig(BaseModel):
    """Everything a sandbox host needs; the CLI flags map one to one onto these fields."""

    slots: int = Field(4, ge=1, le=1024)
    data_dir: Path = Field(default_factory=default_data_dir)
    image_store: Path | None = Field(
        None, description="task images' layer store (docs/task-images.md); default: images/ beside the data dir, "
                          "shared by the hosts of one machine")
    image_store_bytes: int = Field(64 << 30, ge=0, description="disk budget of the image store: least recently "
                                   "used images no host is using are evicted past it, and an import that would "
                                   "pass it is refused while it unpacks")
    image_layer_entries: int = Field(1_000_000, ge=1, description="most members one image layer may hold (bounds "
                                     "the time an import takes); a layer with more is refused")
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port (printed on start)")
    token: str = Field("", repr=False, description="bearer token every request must carry")
    uid_base: int | None = Field(
        None, description="first per-slot uid when the host runs as root (slot i runs as uid_base+i)"
    )
    default_timeout_s: DefaultTimeoutS = CallTimeouts.model_fields["default_timeout_s"].default
    max_timeout_s: MaxTimeoutS = _SLOT.max_timeout_s
    # the in-slot protocol's defaults and bounds (atropos/sandbox/inslot/inslot_protocol.py), written there once
    max_output_bytes: int = Field(slot_protocol.DEFAULT_MAX_OUTPUT, ge=1024, le=slot_protocol.MAX_OUTPUT_CAP,
                                  description="kept per stream (head+tail) per call")
    hard_output_bytes: int = Field(slot_protocol.DEFAULT_HARD_OUTPUT, ge=1 << 20, le=slot_protocol.MAX_HARD_OUTPUT,
                                   description="a call printing more is killed")
    session_grace_s: float = Field(
        3.0, gt=0, le=60, description="python_session: how long code may take to stop after its timeout "
                                      "interrupt before the session is killed (and restarted empty)")
    max_body_bytes: int = Field(32 << 20, ge=1 << 16, description="largest request body accepted (413 over)")
    max_read_bytes: int = Field(8 << 20, ge=1024, le=64 << 20, description="largest file read through the API")
    max_write_bytes: int = Field(16 << 20, ge=1024, description="largest file write through the API")
    max_archive_bytes: int = Field(48 << 20, ge=1 << 16, le=64 << 20,
                                   description="largest archive download (it travels base64 in one frame)")
    limits: Limits = Field(default_factory=Limits)
    unsafe_no_isolation: bool = Field(
        False, description="DEVELOPMENT ONLY: run slots without bubblewrap (no isolation at all)"
    )
    bwrap: str = "/usr/bin/bwrap"
    python: str = Field("/usr/bin/python3", description="interpreter inside the sandbox (from its /usr)")
    native_supervisor: Literal["auto", "always", "never"] = Field(
        "auto", description="slotd, the compiled supervisor (no Python start per sandbox; docs/native-supervisor.md): "
                            "auto: new sandboxes start with it unless most recent leases needed the Python one "
                            "(file tools); always; never: the Python supervisor serves every call")
    workspace_mode: Literal["auto", "overlay", "copy"] = Field(
        "auto", description="template forks: overlayfs copy-on-write (auto falls back to copies when overlays "
                            "cannot be mounted; overlay fails instead) or always full copies")
    template_source_dirs: list[Path] = Field(
        default_factory=list, description="host directories templates may be made from (dir and local git sources)")
    max_template_bytes: int = Field(16 << 30, ge=1 << 20, description="largest template tar upload")
    network_isolation: Literal["auto", "private", "shared"] = Field(
        "auto", description="slots leased with network: their own network namespace behind slirp4netns "
                            "(private; the host's loopback unreachable) or the host's namespace (shared); auto "
                            "picks private when slirp4netns and /dev/net/tun are present, else shared with a warning")
    request_read_timeout_s: float = Field(60.0, gt=0, description="a request's head and body must arrive within "
                                                                 "this (else 408 and the connection closes)")
    egress: EgressPolicy = Field(
        default_factory=EgressPolicy, description="where network slots may connect (private network only: "
                                                  "shared slots have the host's own routes)")

    # past the memory cap the kernel OOM-kills inside that slot only
    slot_memory_bytes: SlotMemoryBytes = _SLOT.memory_bytes
    slot_pids: SlotPids = _SLOT.pids
    slot_cpus: SlotCpus = _SLOT.cpus
    cgroup_dir: Path | None = Field(
        None, description="a writable (delegated) cgroup directory for the slot cgroups; default: a subtree of "
                          "the host's own cgroup")
    unsafe_no_cgroups: bool = Field(
        False, description="DEVELOPMENT ONLY: run without per-slot cgroups (no memory, process or CPU cap per slot)")

    def timeouts(self) -> CallTimeouts:
        """The per-call time limits this host declares to its clients (in every health reply)."""
        return CallTimeouts(max_timeout_s=self.max_timeout_s, default_timeout_s=self.default_timeout_s)

    def slot_limits(self) -> SlotLimits:
        """The limits this host was launched with (its cgroups apply them)."""
        return SlotLimits(max_timeout_s=self.max_timeout_s, workspace_bytes=self.limits.workspace_bytes,
                          memory_bytes=self.slot_memory_bytes, pids=self.slot_pids, cpus=self.slot_cpus)

    @model_validator(mode="after")
    def _default_within_max(self) -> HostConfig:
        # `--max-timeout 5` alone must mean what it says: a call without a timeout gets 5 s, not
        # the 60 s default (an operator lowering the ceiling would otherwise not lower the floor).
        if self.default_timeout_s > self.max_timeout_s:
            self.default_timeout_s = self.max_timeout_s
        return self

    @field_validator("token")
    @classmethod
    def _token_printable(cls, v: str) -> str:
        if any(c.isspace() for c in v):
            raise ValueError("token must not contain whitespace")
        return v


def host_settings(slot: SlotLimits) -> dict[str, Any]:
    """The fields of a HostConfig that ``slot`` sets, but ``limits.workspace_bytes``: the inverse of
    ``HostConfig.slot_limits`` (the host's flags, atropos/sandbox/host/main.py)."""
    return {"max_timeout_s": slot.max_timeout_s, "slot_memory_bytes": slot.memory_bytes,
            "slot_pids": slot.pids, "slot_cpus": slot.cpus}
