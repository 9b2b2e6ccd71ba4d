"""How every backend starts a sandbox host: one command line, one token variable.

A host is always ``python -m atropos.sandbox`` (a child process, a container whose entrypoint is
that module, a Nomad task, a process a Ray actor starts); backends differ only in *where* it runs.
The token never goes on the command line nor in the environment block of a process this module
starts: argv is readable by every process on the machine, and ``/proc/<pid>/environ`` by every
process of the same user (on a Ray node: every task Ray runs there), even after the host pops the
variable (the kernel shows the block the process was started with). A host this module starts
(``start_host_process``) reads it as one line on a pipe that is its stdin (``--token-stdin``),
then swaps stdin for /dev/null and marks itself non-dumpable, so no process of its user can read
its memory or environ. A Docker container's host gets the same line on the container's stdin
(atropos/backends/docker.py). A Nomad task has no stdin to write to: Nomad renders the token into
the task's own secrets directory, mode 0400 and the task's uid, and the host reads that file once
and removes it (``token_file``, ``--token-file``; atropos/backends/nomad/job.py). No backend puts
``HOST_TOKEN_ENV`` in a host's environment; the host still takes it from there when run by hand.

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
from typing import IO, Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from atropos.errors import HostUnavailable
from atropos.sandbox.contract.egress import EgressSettings
from atropos.sandbox.contract.hosttoken import token_verifier
from atropos.sandbox.contract.protocol import DEFAULT_MAX_TIMEOUT_S, MaxTimeoutS
from atropos.sandbox.inslot.inslot_common import make_undumpable as make_undumpable  # the host and the Ray actor too

HOST_TOKEN_ENV = "ATROPOS_SANDBOX_TOKEN"
HOST_MODULE = "atropos.sandbox"
# Settings variables of the CLI (ATROPOS_SANDBOX_<FIELD>) mean nothing to a host; not passed on.
SETTINGS_ENV_PREFIX = "ATROPOS_SANDBOX_"


# A limit's type and bounds (its default is SlotLimits'): the backend configs' ``slot_*`` fields
# (atropos/backends/slot_caps.py) and the host's config (atropos/sandbox/host/config.py) use these.
SlotWorkspaceBytes = Annotated[int, Field(ge=0, description="what one slot can write to its workspace (bytes): its "
                                          "own tmpfs, so the pages count against RAM; 0 = uncapped (the data disk)")]
SlotMemoryBytes = Annotated[int, Field(ge=64 << 20, description="memory one slot may hold as a whole (bytes): every "
                                       "process, and the pages of its tmpfs mounts and memfds (its cgroup's limit)")]
SlotPids = Annotated[int, Field(ge=16, description="processes and threads one slot may have at once (pids.max)")]
SlotCpus = Annotated[float, Field(ge=0, description="hard CPU quota of one slot, in CPUs; 0 = none (slots still "
                                                    "share CPU equally: one cgroup each, equal weights)")]


def _flag(name: str) -> dict[str, Any]:
    return {"flag": name}


class SlotLimits(BaseModel):
    """What one slot of a host may use, one field per limit: its default (a host that runs as a
    process beside others on a machine), unit, bounds, description and the host flag it travels as.

    Declared once, here: the host's flags and what they set (``atropos/sandbox/host/main.py``,
    ``HostConfig.slot_limits``), the launch command line (``args``), the slot cgroups
    (``atropos/sandbox/host/isolation/cgroups.py``) and every backend config (``SlotCaps.slot_limits`` in
    atropos/backends/slot_caps.py, whose fields are named ``slot_<field>``, the timeout as is) read
    these fields. Adding a limit: a field here, its setting in slot_caps.py and config.py, where it
    is enforced, and ``nomad/sandbox.hcl`` (tests/test_slot_limits_model.py checks all of them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_timeout_s: MaxTimeoutS = Field(DEFAULT_MAX_TIMEOUT_S, json_schema_extra=_flag("max-timeout"))
    workspace_bytes: SlotWorkspaceBytes = Field(1 << 30, json_schema_extra=_flag("workspace-bytes"))
    memory_bytes: SlotMemoryBytes = Field(4 << 30, json_schema_extra=_flag("slot-memory-bytes"))
    pids: SlotPids = Field(1024, json_schema_extra=_flag("slot-pids"))
    cpus: SlotCpus = Field(0.0, json_schema_extra=_flag("slot-cpus"))

    @staticmethod
    def flag(field: str) -> str:
        extra = SlotLimits.model_fields[field].json_schema_extra
        assert isinstance(extra, dict)
        return f"--{extra['flag']}"

    def args(self) -> list[str]:
        """``--flag=value`` for every limit (numbers: see the module docstring), in field order."""
        return [f"{self.flag(name)}={_number(getattr(self, name))}" for name in SlotLimits.model_fields]


def _number(v: float) -> str:
    """A flag's value as HCL renders the same number (600, not 600.0; 0.5), exact whatever its size."""
    if isinstance(v, int):
        return str(v)
    short = f"{v:g}"
    return short if float(short) == v else repr(v)


class HostLaunch(BaseModel):
    """The arguments of one sandbox host (everything but the token)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    slots: int = Field(ge=1)
    data_dir: str
    limits: SlotLimits = Field(default_factory=SlotLimits)
    prewarm: bool = True
    parent_pid: int | None = Field(None, description="the host exits when this process dies")
    unsafe_no_isolation: bool = False
    cgroup_dir: str | None = Field(None, description="a delegated cgroup directory for the slot cgroups")
    unsafe_no_cgroups: bool = False
    egress: EgressSettings = Field(default_factory=EgressSettings, description="network slots' egress policy")
    log_level: str | None = None
    image_store: str | None = Field(None, description="task images' layer store (default: images/ beside the "
                                    "data dir)")
    image_store_bytes: int | None = Field(None, ge=0, description="the image store's disk budget (default: the "
                                          "host's)")
    token_stdin: bool = Field(False, description="the token arrives on stdin (start_host_process), not in the env")
    token_file: str | None = Field(None, description="the token is in this file, the host's own, mode 0400 "
                                   "(a Nomad task's secrets/token): read once at start, then removed")

    @model_validator(mode="after")
    def _one_token_source(self) -> HostLaunch:
        if self.token_stdin and self.token_file is not None:
            raise ValueError("a host takes its token from stdin or from a file, not both")
        return self

    def args(self) -> list[str]:
        """The flags after ``python -m atropos.sandbox`` (a container's command)."""
        args = ["--host", self.host, "--port", str(self.port), f"--slots={self.slots}", "--data-dir", self.data_dir,
                *self.limits.args()]
        if self.cgroup_dir is not None:
            args.append(f"--cgroup-dir={self.cgroup_dir}")
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
        if self.image_store is not None:
            args.append(f"--image-store={self.image_store}")
        if self.image_store_bytes is not None:
            args.append(f"--image-store-bytes={self.image_store_bytes}")
        if self.token_stdin:
            args.append("--token-stdin")
        if self.token_file is not None:
            args.append(f"--token-file={self.token_file}")
        return args

    def argv(self, python: str | None = None) -> list[str]:
        """The whole command line of a host process run by ``python`` (default: this interpreter)."""
        return [python or sys.executable, "-m", HOST_MODULE, *self.args()]


# The host's first stdout line when its token comes on stdin: it is non-dumpable now (host/main.py).
UNDUMPABLE_LINE = '{"event": "undumpable"}\n'


def host_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a host process: ``base`` (default ours) without the CLI's settings
    variables (nor a host token: it never travels in an environment this module builds)."""
    return {k: v for k, v in (os.environ if base is None else base).items()
            if not k.startswith(SETTINGS_ENV_PREFIX) and k != HOST_TOKEN_ENV}


async def start_host_process(launch: HostLaunch, token: str, stderr: IO[bytes],
                             python: str | None = None, undumpable_timeout_s: float = 60.0,
                             ) -> asyncio.subprocess.Process:
    """Start ``python -m atropos.sandbox`` for ``launch`` in a session of its own, its token
    written on its stdin (a pipe closed at once) only once the host has said it is non-dumpable
    (``UNDUMPABLE_LINE`` on its stdout: before that, a process of the same user could take the pipe
    with pidfd_getfd and read the token); its stdout is then a pipe for the ready line. What is
    written is the token's verifier (``hosttoken.token_verifier``; ``token`` may be one already, as a
    Ray actor has): the host never holds a token a request could carry.

    An interpreter that does not exist is named (``HostUnavailable``); a host that dies before it
    says it is non-dumpable gets no token, and the caller reports it from its log."""
    argv = launch.model_copy(update={"token_stdin": True}).argv(python)
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=stderr, env=host_env(),
            start_new_session=True)
    except (FileNotFoundError, PermissionError) as exc:
        raise HostUnavailable(f"the host's interpreter {argv[0]!r} cannot be run ({exc.strerror}): set the "
                              "backend config's python to an interpreter with atropos-sandbox installed") from None
    assert proc.stdin is not None and proc.stdout is not None
    try:
        try:
            first = await asyncio.wait_for(proc.stdout.readline(), undumpable_timeout_s)
        except asyncio.TimeoutError:
            first = b""
        if first == UNDUMPABLE_LINE.encode():
            # far below a pipe's buffer: the write never waits for the host
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                proc.stdin.write(token_verifier(token).encode() + b"\n")
                await proc.stdin.drain()
    except BaseException:
        # cancelled (the pool stopping while this host starts) before the caller holds the process:
        # nobody else knows it, so it would run on as an orphan (tests/test_chaos.py saw one)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        raise
    proc.stdin.close()
    return proc
