"""How every backend starts a sandbox host: one command line, one token variable.

A host is always ``python -m atropos.sandbox`` (a child process, a container whose entrypoint is
that module, a Nomad task, a process a Ray actor starts); backends differ only in *where* it runs.
The token never goes on the command line nor in the environment block of a process this module
starts: argv is readable by every process on the machine, and ``/proc/<pid>/environ`` by every
process of the same user (on a Ray node: every task Ray runs there), even after the host pops the
variable (the kernel shows the block the process was started with). A host this module starts
(``start_host_process``) reads it as one line on a pipe that is its stdin (``--token-stdin``),
then swaps stdin for /dev/null and marks itself non-dumpable, so no process of its user can read
its memory or environ. Only a container (Docker, Nomad) still gets ``HOST_TOKEN_ENV`` from its
orchestrator: there the host is non-dumpable too and its slots run under other uids in their own
pid namespaces (``tests/test_isolation.py``, rows 17-18).

Valued flags whose value is a number are written ``--flag=value``: ``nomad/sandbox.hcl`` spells
them that way (an HCL string that is only ``${var.x}`` would keep the number type) and the test
comparing it with the job the backend registers reads these very args.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Mapping
from typing import IO

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
    token_stdin: bool = Field(False, description="the token arrives on stdin (start_host_process), not in the env")

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
        if self.token_stdin:
            args.append("--token-stdin")
        return args

    def argv(self, python: str | None = None) -> list[str]:
        """The whole command line of a host process run by ``python`` (default: this interpreter)."""
        return [python or sys.executable, "-m", HOST_MODULE, *self.args()]


def host_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a host process: ``base`` (default ours) without the CLI's settings
    variables (nor a host token: it never travels in an environment this module builds)."""
    return {k: v for k, v in (os.environ if base is None else base).items()
            if not k.startswith(SETTINGS_ENV_PREFIX) and k != HOST_TOKEN_ENV}


async def start_host_process(launch: HostLaunch, token: str, stderr: IO[bytes],
                             python: str | None = None) -> asyncio.subprocess.Process:
    """Start ``python -m atropos.sandbox`` for ``launch`` in a session of its own, its token
    written on its stdin (a pipe closed at once); its stdout is a pipe for the ready line."""
    proc = await asyncio.create_subprocess_exec(
        *launch.model_copy(update={"token_stdin": True}).argv(python), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=stderr, env=host_env(), start_new_session=True)
    assert proc.stdin is not None
    # far below a pipe's buffer: the write never waits for the host. A host that died at once
    # (a bad interpreter) is reported by the caller from its log, not as a broken pipe here.
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        proc.stdin.write(token.encode() + b"\n")
        await proc.stdin.drain()
    proc.stdin.close()
    return proc
