"""The tools a slot runs, as argument models plus their translation into supervisor requests.

These models are the single source of the tools' JSON schemas: the tool registry the model sees
(``atropos.tools``) is generated from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from atropos.errors import ToolInputError, validation_message
from atropos.sandbox.config import HostConfig

# Commands longer than this go through stdin: a huge argv fails with E2BIG.
_ARGV_LIMIT = 64 << 10
_MAX_OFFSET = (1 << 63) - 1  # a file offset (off_t)


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BashArgs(_Args):
    """Run a bash command in the workspace (a fresh shell each call; files persist)."""

    command: str = Field(description="bash command line or script")
    timeout_s: float | None = Field(None, gt=0, description="seconds before the command is killed")
    workdir: str = Field(".", description="directory: relative to /workspace, or absolute under /workspace/")
    stdin: str | None = Field(None, description="text fed to the command's standard input")


class PythonArgs(_Args):
    """Run a Python snippet with python3 in the workspace (a fresh interpreter each call)."""

    code: str = Field(description="Python source to run")
    timeout_s: float | None = Field(None, gt=0, description="seconds before it is killed")


class PythonSessionArgs(_Args):
    """Run Python code in a persistent interpreter: variables, imports and functions survive between
    calls, like a notebook. The value of a final expression is shown. A timeout interrupts the code
    (KeyboardInterrupt) and keeps the session; restart=true starts from an empty one."""

    code: str = Field("", description="Python source to run in the session")
    timeout_s: float | None = Field(None, gt=0, description="seconds before the running code is interrupted")
    restart: bool = Field(False, description="discard the session's state and start a fresh interpreter first")


class ReadFileArgs(_Args):
    """Read a file of the workspace."""

    path: str = Field(description="relative to /workspace, or absolute under /workspace/")
    offset: int = Field(0, ge=0, le=_MAX_OFFSET, description="byte offset to start at")
    limit: int = Field(0, ge=0, le=_MAX_OFFSET, description="bytes to read (0 = to the end)")
    encoding: Literal["text", "base64"] = "text"


class WriteFileArgs(_Args):
    """Create or overwrite a file of the workspace (parent directories are created)."""

    path: str = Field(description="relative to /workspace, or absolute under /workspace/")
    content: str = Field(description="the new content")
    encoding: Literal["text", "base64"] = "text"
    append: bool = Field(False, description="append instead of overwriting")


class EditFileArgs(_Args):
    """Replace an exact string in a file; refuses when the string is missing or ambiguous."""

    path: str = Field(description="relative to /workspace, or absolute under /workspace/")
    old_string: str = Field(min_length=1, description="exact text to replace (must be unique)")
    new_string: str = Field(description="replacement text")
    replace_all: bool = Field(False, description="replace every occurrence")


class ListDirArgs(_Args):
    """List a directory of the workspace."""

    path: str = Field(".", description="directory: relative to /workspace, or absolute under /workspace/")
    max_entries: int = Field(1000, ge=1, le=100_000)


class StatArgs(_Args):
    """Type, size, mode and modification time of a path (symlinks are not followed)."""

    path: str


class TerminalArgs(_Args):
    """Type into a persistent terminal (tmux) and read what it printed since the last read."""

    input: str = Field("", description="text to type")
    enter: bool | None = Field(None, description="press Enter after the text (default: when text given)")
    keys: list[str] = Field(default_factory=list, description="tmux key names to send first, e.g. C-c")
    wait_ms: int = Field(2000, ge=0, le=60_000,
                         description="longest wait for the command to finish (returns early at the prompt)")


class ArchiveArgs(_Args):
    """A tar.gz of a directory of the workspace (base64)."""

    path: str = "."


@dataclass(frozen=True)
class ToolSpec:
    name: str
    args: type[_Args]
    op: str
    timed: bool = False  # takes a model-chosen timeout

    @property
    def description(self) -> str:
        return (self.args.__doc__ or "").strip()


TOOLS: dict[str, ToolSpec] = {
    spec.name: spec
    for spec in (
        ToolSpec("bash", BashArgs, "exec", timed=True),
        ToolSpec("python", PythonArgs, "exec", timed=True),
        ToolSpec("python_session", PythonSessionArgs, "session", timed=True),
        ToolSpec("read_file", ReadFileArgs, "read_file"),
        ToolSpec("write_file", WriteFileArgs, "write_file"),
        ToolSpec("edit_file", EditFileArgs, "edit_file"),
        ToolSpec("list_dir", ListDirArgs, "list_dir"),
        ToolSpec("stat", StatArgs, "stat"),
        ToolSpec("terminal", TerminalArgs, "terminal"),
        ToolSpec("archive", ArchiveArgs, "archive"),
    )
}


def validate_args(tool: str, raw: dict[str, Any]) -> _Args:
    spec = TOOLS.get(tool)
    if spec is None:
        raise ToolInputError(f"unknown tool {tool!r}; available: {', '.join(sorted(TOOLS))}")
    try:
        return spec.args.model_validate(raw)
    except ValidationError as exc:
        raise ToolInputError(f"invalid arguments for {tool}: {validation_message(exc)}") from None


def clamp_timeout(requested: float | None, cfg: HostConfig) -> tuple[float, list[str]]:
    """The timeout a call runs with, never above the host's maximum, and a note when it was lowered."""
    if requested is None:
        # HostConfig already keeps its default within the maximum; this holds for a config that
        # was changed after validation too.
        if cfg.default_timeout_s > cfg.max_timeout_s:
            return cfg.max_timeout_s, [
                f"this host's default timeout {cfg.default_timeout_s:g}s is above its maximum of "
                f"{cfg.max_timeout_s:g}s; clamped"
            ]
        return cfg.default_timeout_s, []
    if requested > cfg.max_timeout_s:
        return cfg.max_timeout_s, [
            f"timeout {requested:g}s is above this host's maximum of {cfg.max_timeout_s:g}s; clamped"
        ]
    return requested, []


def supervisor_request(tool: str, args: _Args, timeout: float, cfg: HostConfig) -> dict[str, Any]:
    """Translate validated arguments into the supervisor's request frame."""
    if isinstance(args, BashArgs | PythonArgs):
        source, interpreter = (
            (args.command, ["/bin/bash"]) if isinstance(args, BashArgs) else (args.code, ["python3"])
        )
        stdin = args.stdin if isinstance(args, BashArgs) else None
        if len(source.encode()) > _ARGV_LIMIT:
            if stdin:
                raise ToolInputError("stdin cannot be combined with a command over 64 KiB")
            argv = [*interpreter, "-s" if isinstance(args, BashArgs) else "-"]
            stdin = source
        else:
            argv = [*interpreter, "-c", source]
        if "\0" in source:
            raise ToolInputError("the command contains a NUL byte")
        return {
            "op": "exec", "argv": argv, "stdin": stdin, "timeout": timeout,
            "cwd": args.workdir if isinstance(args, BashArgs) else ".",
            "max_output": cfg.max_output_bytes, "hard_output": cfg.hard_output_bytes,
            "cpu_seconds": cfg.limits.cpu_seconds_per_call,
        }
    if isinstance(args, PythonSessionArgs):
        if "\0" in args.code:
            raise ToolInputError("the code contains a NUL byte")
        return {"op": "session", "code": args.code, "restart": args.restart, "timeout": timeout,
                "max_output": cfg.max_output_bytes, "hard_output": cfg.hard_output_bytes}
    payload: dict[str, Any] = {"op": TOOLS[tool].op, **args.model_dump()}
    if isinstance(args, ReadFileArgs | EditFileArgs):
        payload["max_bytes"] = cfg.max_read_bytes
    elif isinstance(args, WriteFileArgs):
        payload["max_bytes"] = cfg.max_write_bytes
    elif isinstance(args, ArchiveArgs):
        payload["max_bytes"] = cfg.max_archive_bytes
    elif isinstance(args, TerminalArgs):
        payload["max_output"] = cfg.max_output_bytes
        # The model's wait never outlasts the call's timeout (a long wait is not a dead sandbox).
        payload["wait_ms"] = min(args.wait_ms, int(timeout * 1000))
    return payload
