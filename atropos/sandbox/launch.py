"""How every backend starts a sandbox host: one command line, one token variable.

A host is always ``python -m atropos.sandbox`` (a child process, a container whose entrypoint is
that module, a Nomad task, a process a Ray actor starts); backends differ only in *where* it runs.
The token never goes on the command line (argv is readable by every process on the machine): it
travels in ``HOST_TOKEN_ENV``, which the host pops from its environment at start
(``atropos/sandbox/__main__.py``), so nothing it starts inherits it.

Valued flags whose value is a number are written ``--flag=value``: ``nomad/sandbox.hcl`` spells
them that way (an HCL string that is only ``${var.x}`` would keep the number type) and the test
comparing it with the job the backend registers reads these very args.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

from atropos.sandbox.egress import EgressSettings

HOST_TOKEN_ENV = "ATROPOS_SANDBOX_TOKEN"
HOST_MODULE = "atropos.sandbox"
# Settings variables of the CLI (ATROPOS_SANDBOX_<FIELD>) mean nothing to a host; not passed on.
SETTINGS_ENV_PREFIX = "ATROPOS_SANDBOX_"


class HostLaunch(BaseModel):
    """The arguments of one sandbox host (everything but the token)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    slots: int = Field(ge=1)
    data_dir: str
    max_timeout_s: float = Field(gt=0)
    workspace_bytes: int = Field(ge=0)
    prewarm: bool = True
    parent_pid: int | None = Field(None, description="the host exits when this process dies")
    unsafe_no_isolation: bool = False
    cgroup_dir: str | None = Field(None, description="a delegated cgroup directory for the slot cgroups")
    slot_memory_bytes: int | None = Field(None, description="per-slot caps; None: the host's defaults")
    slot_pids: int | None = None
    slot_cpus: float | None = None
    unsafe_no_cgroups: bool = False
    egress: EgressSettings = Field(default_factory=EgressSettings, description="network slots' egress policy")
    log_level: str | None = None

    def args(self) -> list[str]:
        """The flags after ``python -m atropos.sandbox`` (a container's command)."""
        args = ["--host", self.host, "--port", str(self.port), f"--slots={self.slots}", "--data-dir", self.data_dir,
                f"--max-timeout={self.max_timeout_s:g}", f"--workspace-bytes={self.workspace_bytes}"]
        if self.cgroup_dir is not None:
            args.append(f"--cgroup-dir={self.cgroup_dir}")
        if self.slot_memory_bytes is not None:
            args.append(f"--slot-memory-bytes={self.slot_memory_bytes}")
        if self.slot_pids is not None:
            args.append(f"--slot-pids={self.slot_pids}")
        if self.slot_cpus is not None:
            args.append(f"--slot-cpus={self.slot_cpus:g}")
        if self.unsafe_no_cgroups:
            args.append("--unsafe-no-cgroups")
        args += self.egress.host_args()
        if self.parent_pid is not None:
            args.append(f"--parent-pid={self.parent_pid}")
        if not self.prewarm:
            args.append("--no-prewarm")
        if self.unsafe_no_isolation:
            args.append("--unsafe-no-isolation")
        if self.log_level:
            args += ["--log-level", self.log_level]
        return args

    def argv(self, python: str | None = None) -> list[str]:
        """The whole command line of a host process run by ``python`` (default: this interpreter)."""
        return [python or sys.executable, "-m", HOST_MODULE, *self.args()]


def host_env(token: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a host process: ``base`` (default ours) without the CLI's settings
    variables, plus the token."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith(SETTINGS_ENV_PREFIX)}
    env[HOST_TOKEN_ENV] = token
    return env
