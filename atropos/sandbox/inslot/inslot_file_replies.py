"""What the file tools answer, worded in one place for both supervisors: the Python supervisor's
handlers (``inslot_files.SlotFiles``) and slotd's file tools, whose raw outcome (bytes, stat fields,
the paths the kernel resolved, an errno or which check failed) the host words with these functions
(atropos/sandbox/host/isolation/slotd_wire.py, ``decode_files``). So a message cannot differ between
the two.

Standard library only, no sibling import: copied into the host's lib dir like every in-slot module,
and imported by the host as ``atropos.sandbox.inslot.inslot_file_replies``.
"""

from __future__ import annotations

import base64
import errno
import os
import re
import stat
from typing import Any

_CONTROL = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f]")


class ToolFailure(Exception):
    """An error the model should read; ``code`` is stable for programs."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def os_failure(exc: OSError, path: str) -> ToolFailure:
    codes = {
        errno.ENOENT: ("not_found", f"{path}: no such file or directory"),
        errno.ENOTDIR: ("not_found", f"{path}: a path component is not a directory"),
        errno.EISDIR: ("is_directory", f"{path}: is a directory"),
        errno.EACCES: ("permission_denied", f"{path}: permission denied"),
        errno.EPERM: ("permission_denied", f"{path}: operation not permitted"),
        errno.ENAMETOOLONG: ("invalid_path", f"path too long ({len(path)} characters)"),
        errno.ELOOP: ("invalid_path", f"{path}: too many levels of symbolic links"),
        errno.EXDEV: ("path_escape", f"{path}: leaves the workspace (through '..' or an absolute "
                                     "symlink); file tools reach only files under the workspace"),
        errno.ENOSPC: ("no_space", f"{path}: no space left in the workspace"),
        errno.EFBIG: ("too_large", f"{path}: file size limit reached"),
        errno.EEXIST: ("exists", f"{path}: already exists"),
        errno.ENXIO: ("not_regular", f"{path}: not a regular file (a FIFO or device)"),
    }
    code, message = codes.get(exc.errno or 0, ("os_error", f"{path}: {exc.strerror}"))
    return ToolFailure(code, message)


def escape_failure(path: str, workspace: str) -> ToolFailure:
    """An absolute ``path`` outside the workspace (``SlotFiles._rel``)."""
    root = workspace.rstrip("/") or "/"
    return ToolFailure("path_escape", f"{path}: outside the workspace; file tools reach only {root} and "
                                      f"what is under it (give a path relative to {root}, or {root}/...)")


def failure(code: str, path: str, *nums: int) -> ToolFailure:
    """A file tool's own refusal of ``path`` (an errno's is ``os_failure``)."""
    if code == "is_directory":
        return ToolFailure(code, f"{path}: is a directory (use list_dir)")
    if code == "not_regular":
        return ToolFailure(code, f"{path}: not a regular file")
    if code == "too_large":
        size, max_bytes = nums
        return ToolFailure(code, f"{path}: {size} bytes, over the read limit of {max_bytes} bytes; "
                                 "pass offset/limit to read part of it")
    if code == "not_text":
        return ToolFailure(code, f"{path}: not UTF-8 text; use write_file")
    if code == "no_match":
        return ToolFailure(code, f"{path}: old_string not found")
    if code == "ambiguous_match":
        return ToolFailure(code, f"{path}: old_string occurs {nums[0]} times; add surrounding context to make it "
                                 "unique or set replace_all")
    if code == "resolved_escape":
        return ToolFailure("path_escape", f"{path}: resolves outside the workspace")
    if code == "proc":
        return ToolFailure("not_regular", f"{path}: /proc is not for the file tools (use bash)")
    if code == "nul":
        return ToolFailure("invalid_path", "path contains a NUL byte")
    if code == "empty":
        return ToolFailure("invalid_path", "path must be a non-empty string")
    raise ValueError(f"no file tool failure {code!r}")


def write_content(req: dict[str, Any]) -> bytes:
    """write_file's bytes, checked against its ``max_bytes``."""
    data = base64.b64decode(req["content"]) if req.get("encoding") == "base64" else req["content"].encode()
    if len(data) > int(req["max_bytes"]):
        raise ToolFailure("too_large", f"content is {len(data)} bytes, over the write limit of "
                                       f"{req['max_bytes']} bytes")
    return data


def read_result(data: bytes, size: int, encoding: str) -> dict[str, Any]:
    """read_file's result for the bytes read of a file of ``size`` bytes."""
    if encoding == "base64" or _CONTROL.search(data):
        # Control bytes would each become a 6-byte JSON escape: binary goes as base64.
        return {"content": base64.b64encode(data).decode(), "encoding": "base64", "size": size,
                "binary": encoding != "base64"}
    try:
        return {"content": data.decode("utf-8"), "encoding": "text", "size": size}
    except UnicodeDecodeError:
        return {"content": base64.b64encode(data).decode(), "encoding": "base64", "size": size, "binary": True}


def shown_name(name: str | bytes) -> str:
    """A file name or path as a reply carries it. A name is bytes, a reply is JSON (UTF-8): a
    name that is not UTF-8 (``os.listdir``'s str of it holds lone surrogates, which no JSON
    encoder takes) is shown with each byte that is not UTF-8 as ``\\xNN``, as Python's
    ``backslashreplace`` writes it (``printf 'n\\377'`` is listed as ``n\\xff``); the name's
    exact bytes go beside it (``list_entry``). docs/native-supervisor.md, "Names that are
    not UTF-8"."""
    raw = name if isinstance(name, bytes) else os.fsencode(name)
    return raw.decode("utf-8", "backslashreplace")


def list_entry(name: str | bytes, mode: int, size: int) -> dict[str, Any]:
    """One entry of list_dir's result: ``name_base64`` (the name's bytes) only for a name that is
    not UTF-8, whose ``name`` cannot say it exactly."""
    raw = name if isinstance(name, bytes) else os.fsencode(name)
    entry: dict[str, Any] = {"name": shown_name(raw), "type": kind(mode), "size": size}
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        entry["name_base64"] = base64.b64encode(raw).decode()
    return entry


def shown_path(real: str, rel: str, workspace: str) -> str:
    """The path bash would use for a file the kernel resolved to ``real`` (its descriptor's link),
    asked for as ``rel`` (relative to the workspace): what a result reports (``shown_name``)."""
    root = workspace.rstrip("/")
    if real == root or real.startswith(root + "/"):
        return shown_name(real)
    return shown_name(os.path.normpath(os.path.join(root, rel)))


def edited_path(rel: str, workspace: str) -> str:
    """edit_file's reported path: the file it replaced, ``rel`` to the workspace (``shown_name``)."""
    return shown_name(os.path.normpath(os.path.join(workspace, rel)))


def stat_result(shown: str, mode: int, size: int, mtime: float) -> dict[str, Any]:
    return {"path": shown, "type": kind(mode), "size": size, "mode": oct(stat.S_IMODE(mode)), "mtime": mtime}


def kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"
