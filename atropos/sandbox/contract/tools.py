"""The tools a slot runs, each declared once (``TOOLS``): its arguments, the in-slot op it becomes,
its toolset, whether it writes (refused once the slot is sealed) and how its result reads to the model.

The tool registry the model sees (``atropos/tools/registry.py``), the result formatting
(``atropos/tools/formatting.py``), the host's sealed-phase refusal and the tools page
(docs/tools.md) are derived from it. Adding a tool: its definition here, its in-slot op
(supervisor.py or session.py) and a test; tests/test_tool_definitions.py fails on anything missed.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from atropos.errors import ToolInputError, validation_message

if TYPE_CHECKING:  # the host's config is only ever passed in: the definitions are shared with the pool
    from atropos.sandbox.host.config import HostConfig

# One exec argument is at most 32 pages with its NUL (the kernel's MAX_ARG_STRLEN, 128 KiB): a `-c`
# source up to that runs as `bash -c` / `python3 -c` would; a longer one cannot be a `-c` argument
# at all (`bash -c` itself fails with E2BIG) and runs from stdin instead (docs/warm-interpreters.md).
_ARGV_LIMIT = (128 << 10) - 1
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


# -- how validated arguments become the in-slot request ------------------------------------
# Each takes (op, args, timeout, cfg); the keys and their order are the wire the in-slot op reads.
Request = Callable[[str, Any, float, "HostConfig"], dict[str, Any]]


def _exec_request(op: str, args: BashArgs | PythonArgs, timeout: float, cfg: HostConfig) -> dict[str, Any]:
    bash = isinstance(args, BashArgs)
    source, interpreter = (args.command, ["/bin/bash"]) if isinstance(args, BashArgs) else (args.code, ["python3"])
    stdin = args.stdin if isinstance(args, BashArgs) else None
    if len(source.encode()) > _ARGV_LIMIT:
        if stdin:
            raise ToolInputError("stdin cannot be combined with a command over 128 KiB")
        argv = [*interpreter, "-s" if bash else "-"]
        stdin = source
    else:
        argv = [*interpreter, "-c", source]
    if "\0" in source:
        raise ToolInputError("the command contains a NUL byte")
    return {
        "op": op, "argv": argv, "stdin": stdin, "timeout": timeout,
        "cwd": args.workdir if isinstance(args, BashArgs) else ".",
        "max_output": cfg.max_output_bytes, "hard_output": cfg.hard_output_bytes,
        "cpu_seconds": cfg.limits.cpu_seconds_per_call,
    }


def _session_request(op: str, args: PythonSessionArgs, timeout: float, cfg: HostConfig) -> dict[str, Any]:
    if "\0" in args.code:
        raise ToolInputError("the code contains a NUL byte")
    return {"op": op, "code": args.code, "restart": args.restart, "timeout": timeout,
            "max_output": cfg.max_output_bytes, "hard_output": cfg.hard_output_bytes}


def _terminal_request(op: str, args: TerminalArgs, timeout: float, cfg: HostConfig) -> dict[str, Any]:
    # The model's wait never outlasts the call's timeout (a long wait is not a dead sandbox).
    return {"op": op, **args.model_dump(), "max_output": cfg.max_output_bytes,
            "wait_ms": min(args.wait_ms, int(timeout * 1000))}


def _as_given(op: str, args: _Args, _timeout: float, _cfg: HostConfig) -> dict[str, Any]:
    return {"op": op, **args.model_dump()}


def _capped(limit: Callable[[HostConfig], int]) -> Request:
    """The arguments as given, with the host's byte limit for this op as ``max_bytes``."""
    def request(op: str, args: _Args, _timeout: float, cfg: HostConfig) -> dict[str, Any]:
        return {"op": op, **args.model_dump(), "max_bytes": limit(cfg)}
    return request


# -- how a result reads to the model: (ok, text), short plain text, none of the platform's internals --
Formatter = Callable[[dict[str, Any]], tuple[bool, str]]
_CONTROL_TO_MARK = {c: "\ufffd" for c in (*range(0, 9), 11, 12, *range(14, 32))}


def format_exec(r: dict[str, Any]) -> str:
    parts = []
    if r.get("stdout"):
        parts.append(str(r["stdout"]).rstrip("\n"))
    if r.get("stderr"):
        parts.append("[stderr]\n" + str(r["stderr"]).rstrip("\n"))
    if r.get("timed_out"):
        parts.append("[timed out: the command was killed]")
    elif r.get("output_limited"):
        parts.append("[output limit reached: the command was killed]")
    elif r.get("signal"):
        parts.append(f"[killed by signal {r['signal']}]")
    elif r.get("exit_code") not in (0, None):
        parts.append(f"[exit code: {r['exit_code']}]")
    return "\n".join(parts) if parts else "(no output)"


def format_session(r: dict[str, Any]) -> str:
    """A python_session result as a notebook cell's output: prints, the final value, the error."""
    parts = []
    if r.get("stdout"):
        parts.append(str(r["stdout"]).rstrip("\n"))
    if r.get("stderr"):
        parts.append("[stderr]\n" + str(r["stderr"]).rstrip("\n"))
    if r.get("value") is not None:
        parts.append(f"Out: {r['value']}")
    err = r.get("error") or {}
    if r.get("restarted"):
        parts.append(f"[session restarted: {err.get('message', 'the session was lost')}]")
    elif err:
        parts.append(str(err.get("traceback") or f"{err.get('type')}: {err.get('message')}").rstrip("\n"))
    elif r.get("timed_out"):  # the code caught its interrupt and finished anyway
        parts.append("[timed out: the code was interrupted; the session is kept]")
    if r.get("output_limited") and not r.get("restarted"):
        parts.append("[output limit reached: the code was interrupted]")
    return "\n".join(parts) if parts else "(no output)"


def _exec_result(r: dict[str, Any]) -> tuple[bool, str]:
    return not r.get("timed_out") and r.get("exit_code") == 0, format_exec(r)


def _session_result(r: dict[str, Any]) -> tuple[bool, str]:
    return not r.get("error") and not r.get("timed_out") and not r.get("restarted"), format_session(r)


def _read_result(r: dict[str, Any]) -> tuple[bool, str]:
    if r.get("encoding") == "base64":
        text = base64.b64decode(r["content"]).decode("utf-8", "replace").translate(_CONTROL_TO_MARK)
        return True, f"(binary content, {r.get('size')} bytes; undecodable and control bytes shown as \ufffd)\n{text}"
    return True, str(r["content"])


def _write_result(r: dict[str, Any]) -> tuple[bool, str]:
    return True, f"wrote {r['bytes_written']} bytes to {r['path']}"


def _edit_result(r: dict[str, Any]) -> tuple[bool, str]:
    return True, f"replaced {r['replacements']} occurrence(s) in {r['path']}"


def _list_result(r: dict[str, Any]) -> tuple[bool, str]:
    lines = [e["name"] + ("/" if e["type"] == "dir" else "") + (f"  ({e['size']} bytes)" if e["type"] == "file"
             else "") for e in r["entries"]]
    if r.get("truncated"):
        lines.append(f"... ({r['total']} entries in all)")
    return True, "\n".join(lines) if lines else "(empty directory)"


def _terminal_result(r: dict[str, Any]) -> tuple[bool, str]:
    out = str(r.get("output", ""))
    return True, out if out.strip() else "(no new output)"


def format_json(r: dict[str, Any]) -> tuple[bool, str]:
    return True, json.dumps(r, ensure_ascii=False)


# -- the tools --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolSpec:
    """Everything about one tool, declared once: the registry the model sees, the host's sealed-phase
    refusal and the result formatting are derived from these (tests/test_tool_definitions.py)."""

    name: str
    args: type[_Args]  # its arguments; the docstring is the description the model reads
    op: str  # the in-slot op it becomes: supervisor.py's Supervisor.ops(), or session.py's OPS
    toolset: str | None  # the model's toolset; None: for programs only (REST), never offered to a model
    writes: bool  # runs code or changes the workspace: refused once the slot is sealed (docs/verification.md)
    format: Formatter  # its successful result as the model reads it
    request: Request = _as_given

    @property
    def description(self) -> str:
        return (self.args.__doc__ or "").strip()


TOOLS: dict[str, ToolSpec] = {
    spec.name: spec
    for spec in (
        ToolSpec("bash", BashArgs, "exec", "shell", writes=True, format=_exec_result, request=_exec_request),
        ToolSpec("python", PythonArgs, "exec", "python", writes=True, format=_exec_result, request=_exec_request),
        ToolSpec("python_session", PythonSessionArgs, "session", "python", writes=True, format=_session_result,
                 request=_session_request),
        ToolSpec("read_file", ReadFileArgs, "read_file", "files", writes=False, format=_read_result,
                 request=_capped(lambda cfg: cfg.max_read_bytes)),
        ToolSpec("write_file", WriteFileArgs, "write_file", "files", writes=True, format=_write_result,
                 request=_capped(lambda cfg: cfg.max_write_bytes)),
        ToolSpec("edit_file", EditFileArgs, "edit_file", "files", writes=True, format=_edit_result,
                 request=_capped(lambda cfg: cfg.max_read_bytes)),
        ToolSpec("list_dir", ListDirArgs, "list_dir", "files", writes=False, format=_list_result),
        ToolSpec("stat", StatArgs, "stat", "files", writes=False, format=format_json),
        ToolSpec("terminal", TerminalArgs, "terminal", "terminal", writes=True, format=_terminal_result,
                 request=_terminal_request),
        ToolSpec("archive", ArchiveArgs, "archive", None, writes=False, format=format_json,
                 request=_capped(lambda cfg: cfg.max_archive_bytes)),
    )
}

# What a sealed slot (its verification phase) refuses: every tool that runs or writes in it.
SEALED_REFUSED = frozenset(name for name, spec in TOOLS.items() if spec.writes)
# Tools for programs (the REST API), never offered to a model.
PROGRAM_ONLY = frozenset(name for name, spec in TOOLS.items() if spec.toolset is None)


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
    """Translate validated arguments into the in-slot request frame."""
    spec = TOOLS[tool]
    return spec.request(spec.op, args, timeout, cfg)
