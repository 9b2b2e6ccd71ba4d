"""The per-slot supervisor: runs *inside* a slot's sandbox and executes every call of the slot.

One supervisor lives per leased slot (started once inside bubblewrap), so a call costs a
fork+exec, not a sandbox start. It talks to the host over its stdin/stdout with length-prefixed
JSON frames and handles one request at a time (calls of one slot run in order).

This file must stay standard-library only and self-contained: it is copied into the host's data
directory and executed by whatever ``python3`` the sandbox's ``/usr`` offers.

Threat model: everything here runs with the same identity as the untrusted code. The supervisor
protects the *host* from the slot (bounded output, bounded reads, no hangs on FIFOs, nothing of a
call survives it), not itself from its own slot: a command that kills the supervisor only kills
its own slot's sandbox, which the host then restarts.
"""

from __future__ import annotations

import base64
import ctypes
import errno
import io
import json
import os
import re
import resource
import selectors
import signal
import stat
import subprocess
import sys
import tarfile
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from atropos.sandbox.inslot import Capture, apply_limits, protocol_fds, serve
else:  # run from the host's lib dir, beside inslot.py (isolated mode: the dir is not on sys.path)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from inslot import Capture, apply_limits, protocol_fds, serve
    del sys.path[0]

# openat2(2) resolution flags (linux/openat2.h)
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08
SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(os.uname().machine)


class ToolFailure(Exception):
    """An error the model should read; ``code`` is stable for programs."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _openat2(dir_fd: int, path: str, flags: int, mode: int = 0o644) -> int:
    """Open ``path`` strictly beneath ``dir_fd``: an absolute path or symlink, or a ``..`` that
    climbs above ``dir_fd``, fails with EXDEV. Refusing (rather than re-rooting them at ``dir_fd``)
    keeps the file tools' view identical to the shell's: a path either names the same file bash
    would open, or is an error."""
    raw = path.encode("utf-8", "replace")
    if b"\0" in raw:
        raise ToolFailure("invalid_path", "path contains a NUL byte")
    if SYS_OPENAT2 is None:
        raise ToolFailure("unsupported", "openat2 is not available on this architecture")
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)
    for _ in range(64):
        fd = _libc.syscall(SYS_OPENAT2, dir_fd, raw, ctypes.byref(how), ctypes.sizeof(how))
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        # EAGAIN: a rename anywhere on the machine raced a ``..`` step; the kernel asks for a retry
        if err != errno.EAGAIN:
            break
    raise OSError(err, os.strerror(err), path)


def _os_failure(exc: OSError, path: str) -> ToolFailure:
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


_CONTROL = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f]")
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()][0-9A-Za-z]|\x1b[=>78cDEHM]")


def strip_ansi(text: str) -> str:
    text = _ANSI.sub("", text).replace("\r\n", "\n")
    # A bare CR moves to line start: keep what was drawn last on that line.
    return "\n".join(line.rsplit("\r", 1)[-1] for line in text.split("\n"))


# Warm interpreters: a `bash` (and, once the slot has used `python`, a `python3`) that has already
# paid for exec, dynamic loading and start-up, waiting for its command: the next default call only
# writes the source into a memfd (seekable, so bash's `read` takes it in blocks, not a byte per
# syscall) and says go through a pipe. What the bootstrap needs is gone before the source runs, so
# the source sees what a fresh `bash -c` / `python3 -c` gives it.
BASH = "/bin/bash"
PYTHON = "python3"


def _bash_boot(go_fd: int, src_fd: int) -> str:
    return (f'IFS= read -r -n 1 -u {go_fd} __atropos_go || exit 0; '
            f'IFS= read -r -d "" -u {src_fd} __atropos_cmd; exec {go_fd}<&- {src_fd}<&-; '
            # the source runs from BASH_EXECUTION_STRING (as in `bash -c`): a syntax error in it
            # quotes its own line, never this bootstrap
            'unset __atropos_go; BASH_EXECUTION_STRING=$__atropos_cmd; unset __atropos_cmd; '
            ': "$0"; eval "$BASH_EXECUTION_STRING"')


def _python_boot(go_fd: int, src_fd: int) -> str:
    # One function, deleted from __main__ before the source runs in __main__'s namespace. Uncaught
    # exceptions are printed by sys.excepthook without the bootstrap's own frame, as `python3 -c`
    # prints them (exit status 1); SystemExit propagates to the interpreter as usual.
    return f"""def _atropos_boot():
    import os, sys
    if not os.read({go_fd}, 1):
        os._exit(0)
    os.close({go_fd})
    parts = []
    while True:
        part = os.read({src_fd}, 1 << 20)
        if not part:
            break
        parts.append(part)
    os.close({src_fd})
    namespace = sys.modules["__main__"].__dict__
    del namespace["_atropos_boot"]
    source = b"".join(parts).decode("utf-8", "surrogateescape")
    try:
        exec(compile(source, "<string>", "exec"), namespace)
    except SystemExit:
        raise
    except BaseException as exc:
        exc.__traceback__ = exc.__traceback__.tb_next  # the printer reads it from the exception
        sys.excepthook(type(exc), exc, exc.__traceback__)
        raise SystemExit(1) from None
_atropos_boot()
"""


WARM_KINDS = {BASH: _bash_boot, PYTHON: _python_boot}


class WarmInterpreter:
    """A pre-started interpreter for the slot's next default call of its kind (workspace cwd, slot
    env, no stdin), fed its source through a memfd."""

    def __init__(self, kind: str, cwd: str, env: dict[str, str]) -> None:
        self.src_fd = os.memfd_create("source", os.MFD_CLOEXEC)
        go_r, self.go_w = os.pipe2(os.O_CLOEXEC)
        devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.proc = subprocess.Popen(
                [kind, "-c", WARM_KINDS[kind](go_r, self.src_fd)], stdin=devnull,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=env, close_fds=True,
                start_new_session=True, pass_fds=(go_r, self.src_fd),
            )
        except BaseException:
            os.close(self.src_fd)
            os.close(self.go_w)
            raise
        finally:
            os.close(go_r)
            os.close(devnull)
        self.kind = kind
        self.cwd = cwd

    def alive(self) -> bool:
        return self.proc.poll() is None

    def go(self, source: str) -> None:
        data = os.fsencode(source) + (b"\0" if self.kind == BASH else b"")
        os.pwrite(self.src_fd, data, 0)
        os.write(self.go_w, b"g")
        self.close_fds()

    def close_fds(self) -> None:
        for fd in (self.src_fd, self.go_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self.src_fd = self.go_w = -1

    def drop(self) -> None:
        """Kill (if still alive) and reap."""
        self.close_fds()  # EOF on the go pipe: it would exit by itself
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()


class Supervisor:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.workspace = cfg.get("workspace", "/workspace")
        self.run_dir = cfg.get("run_dir", "/run/term")
        self.env = dict(cfg.get("env", {}))
        self.isolated = bool(cfg.get("isolated", True))
        self.warm: dict[str, WarmInterpreter] = {}
        # A bash is always kept warm (cheap, and most calls). A python only while the slot's last
        # exec call was python: every exec call's kill(-1) takes the waiting interpreters with it, so
        # keeping a python warm across bash calls would spend a python start-up on every bash call.
        self.last_kind = BASH
        self.root_dir: str | None = None

    # -- process control -------------------------------------------------------------------
    def kill_leftovers(self) -> None:
        """Kill every process of this sandbox except us (and bwrap's init as PID 1).

        kill(-1) is atomic with respect to fork, so even a fork bomb cannot outrun it. Only
        meaningful inside our own PID namespace; without isolation it would hit the whole uid.
        """
        if not self.isolated:
            return
        try:
            os.kill(-1, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        argv = [str(a) for a in req["argv"]]
        timeout = float(req.get("timeout", 60.0))
        cap = int(req.get("max_output", 65536))
        hard_cap = int(req.get("hard_output", 64 << 20))
        cwd = self._resolve_dir(req.get("cwd") or ".")
        env = dict(self.env)
        env.update({str(k): str(v) for k, v in (req.get("env") or {}).items()})
        warm = self._take_warm(argv, req, cwd)
        if warm is not None:
            proc = warm.proc
            _limit_cpu(proc.pid, req.get("cpu_seconds"))  # before the source starts
            start = time.monotonic()
            warm.go(argv[2])
        else:
            start = time.monotonic()
            try:
                proc = self._popen(argv, req, cwd, env)
            except OSError as exc:
                return {"exit_code": 127, "signal": None, "timed_out": False, "stdout": "",
                        "stderr": f"cannot start {argv[0]}: {exc.strerror}\n", "stdout_bytes": 0,
                        "stderr_bytes": 0, "stdout_truncated": False, "stderr_truncated": False,
                        "duration_ms": 0.0, "output_limited": False}
            _limit_cpu(proc.pid, req.get("cpu_seconds"))
        out, err = Capture(cap), Capture(cap)
        streams = {proc.stdout: out, proc.stderr: err}
        sel = selectors.DefaultSelector()
        for pipe in streams:
            assert pipe is not None
            os.set_blocking(pipe.fileno(), False)
            sel.register(pipe, selectors.EVENT_READ)
        pidfd = os.pidfd_open(proc.pid)
        sel.register(pidfd, selectors.EVENT_READ)
        deadline = start + timeout
        timed_out = output_limited = exited = False
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            # Once the main process is gone, a background child holding the pipe must not keep
            # the call open: give the pipes a short grace to drain, then stop.
            events = sel.select(0.05 if exited else remaining)
            if exited and not events:
                break
            for key, _ in events:
                if key.fileobj == pidfd:
                    exited = True
                    sel.unregister(pidfd)
                    continue
                chunk = b""
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                streams[key.fileobj].feed(chunk)  # type: ignore[index]
            if out.total + err.total > hard_cap:
                output_limited = True
                break
        sel.close()
        os.close(pidfd)
        self.kill_leftovers()
        if self.isolated:
            self._drop_warm()  # kill(-1) took them too: reap them, new ones start when we are idle
        if not self.isolated and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
        for pipe in streams:
            assert pipe is not None
            pipe.close()
        stdout, out_trunc = out.text()
        stderr, err_trunc = err.text()
        return {
            "exit_code": code if code >= 0 else None,
            "signal": -code if code < 0 else None,
            "timed_out": timed_out,
            "output_limited": output_limited,
            "stdout": stdout,
            "stderr": stderr,
            "stdout_bytes": out.total,
            "stderr_bytes": err.total,
            "stdout_truncated": out_trunc,
            "stderr_truncated": err_trunc,
            "duration_ms": round((time.monotonic() - start) * 1000, 3),
        }

    def _popen(self, argv: list[str], req: dict[str, Any], cwd: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        stdin_fd = os.open(os.devnull, os.O_RDONLY)
        if req.get("stdin"):
            os.close(stdin_fd)
            stdin_fd = os.memfd_create("stdin", 0)
            os.write(stdin_fd, str(req["stdin"]).encode())
            os.lseek(stdin_fd, 0, os.SEEK_SET)
        try:
            return subprocess.Popen(
                argv, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=env,
                close_fds=True, start_new_session=True,
            )
        finally:
            os.close(stdin_fd)

    def _take_warm(self, argv: list[str], req: dict[str, Any], cwd: str) -> WarmInterpreter | None:
        """The waiting interpreter of this call's kind, if the call is exactly what it was started for."""
        if not argv or argv[0] not in WARM_KINDS:
            return None
        self.last_kind = argv[0]
        warm = self.warm.get(argv[0])
        if (len(argv) != 3 or argv[1] != "-c" or warm is None or req.get("stdin") or req.get("env") or cwd != warm.cwd
                or not warm.alive()):
            return None
        try:
            os.fsencode(argv[2])
        except UnicodeEncodeError:
            return None  # the regular path reports it
        del self.warm[argv[0]]
        return warm

    def idle(self) -> None:
        """Between calls: have interpreters waiting for the next ones (start-up off the call's path)."""
        for kind in sorted({BASH, self.last_kind}):
            warm = self.warm.get(kind)
            if warm is not None:
                if warm.alive():
                    continue
                del self.warm[kind]
                warm.drop()
            try:
                if self.root_dir is None:  # the workspace root never moves while this sandbox lives
                    self.root_dir = self._resolve_dir(".")
                self.warm[kind] = WarmInterpreter(kind, self.root_dir, self.env)
            except (OSError, ToolFailure, subprocess.SubprocessError):
                return  # e.g. the process limit: calls start their own

    def _drop_warm(self) -> None:
        warm, self.warm = self.warm, {}
        for interpreter in warm.values():
            interpreter.drop()

    # -- paths -----------------------------------------------------------------------------
    def _root_fd(self) -> int:
        return os.open(self.workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def _rel(self, path: str) -> str:
        """``path`` relative to the workspace, read as bash in the slot reads it: ``/workspace/x``
        (the workspace as the slot's processes see it) is ``x``; any other absolute path is outside
        the workspace and refused, never re-rooted into it."""
        if not isinstance(path, str) or not path:
            raise ToolFailure("invalid_path", "path must be a non-empty string")
        if not path.startswith("/"):
            return path
        root = self.workspace.rstrip("/") or "/"
        norm = re.sub("/+", "/", path)
        if norm == root or norm == root + "/":
            return "."
        if norm.startswith(root + "/"):
            return norm[len(root) + 1:]
        raise ToolFailure("path_escape", f"{path}: outside the workspace; file tools reach only {root} and "
                                         f"what is under it (give a path relative to {root}, or {root}/...)")

    def _shown(self, fd: int, rel: str) -> str:
        """The path bash would use for the file open at ``fd``: what a result reports as written."""
        try:
            real = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            real = ""
        root = self.workspace.rstrip("/")
        if real == root or real.startswith(root + "/"):
            return real
        return os.path.normpath(os.path.join(root, rel))

    def _open(self, path: str, flags: int, mode: int = 0o644) -> int:
        rel = self._rel(path)
        root = self._root_fd()
        try:
            return _openat2(root, rel, flags, mode)
        except OSError as exc:
            raise _os_failure(exc, path) from None
        finally:
            os.close(root)

    def _resolve_dir(self, path: str) -> str:
        fd = self._open(path, os.O_PATH | os.O_DIRECTORY)
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)

    def _make_parents(self, path: str) -> None:
        parts = [p for p in path.split("/") if p not in ("", ".")][:-1]
        prefix = ""
        for part in parts:
            prefix = f"{prefix}/{part}" if prefix else part
            try:
                fd = self._open(prefix, os.O_PATH | os.O_DIRECTORY)
                os.close(fd)
                continue
            except ToolFailure as exc:
                if exc.code != "not_found":
                    raise
            parent = prefix.rsplit("/", 1)[0] if "/" in prefix else "."
            pfd = self._open(parent, os.O_PATH | os.O_DIRECTORY)
            try:
                os.mkdir(part, 0o755, dir_fd=pfd)
            except FileExistsError:
                pass
            except OSError as exc:
                raise _os_failure(exc, prefix) from None
            finally:
                os.close(pfd)

    def _read_regular(self, path: str, offset: int, limit: int, max_bytes: int) -> tuple[bytes, int]:
        fd = self._open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise ToolFailure("is_directory", f"{path}: is a directory (use list_dir)")
            if not stat.S_ISREG(st.st_mode):
                raise ToolFailure("not_regular", f"{path}: not a regular file")
            want = st.st_size - offset if limit <= 0 else limit
            if want > max_bytes:
                raise ToolFailure(
                    "too_large",
                    f"{path}: {st.st_size} bytes, over the read limit of {max_bytes} bytes; "
                    "pass offset/limit to read part of it",
                )
            os.lseek(fd, offset, os.SEEK_SET)
            chunks: list[bytes] = []
            got = 0
            while got < want:
                chunk = os.read(fd, min(1 << 20, want - got))
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
            return b"".join(chunks), st.st_size
        finally:
            os.close(fd)

    # -- file tools ------------------------------------------------------------------------
    def read_file(self, req: dict[str, Any]) -> dict[str, Any]:
        data, size = self._read_regular(
            req["path"], int(req.get("offset") or 0), int(req.get("limit") or 0), int(req["max_bytes"])
        )
        if req.get("encoding") == "base64" or _CONTROL.search(data):
            # Control bytes would each become a 6-byte JSON escape: binary goes as base64.
            return {"content": base64.b64encode(data).decode(), "encoding": "base64", "size": size,
                    "binary": req.get("encoding") != "base64"}
        try:
            return {"content": data.decode("utf-8"), "encoding": "text", "size": size}
        except UnicodeDecodeError:
            return {"content": base64.b64encode(data).decode(), "encoding": "base64", "size": size, "binary": True}

    def write_file(self, req: dict[str, Any]) -> dict[str, Any]:
        path = req["path"]
        data = base64.b64decode(req["content"]) if req.get("encoding") == "base64" else req["content"].encode()
        if len(data) > int(req["max_bytes"]):
            raise ToolFailure("too_large", f"content is {len(data)} bytes, over the write limit of "
                                           f"{req['max_bytes']} bytes")
        rel = self._rel(path)
        self._make_parents(rel)
        flags = os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY
        flags |= os.O_APPEND if req.get("append") else os.O_TRUNC
        fd = self._open(path, flags)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ToolFailure("not_regular", f"{path}: not a regular file")
            view = memoryview(data)
            while view:
                try:
                    n = os.write(fd, view)
                except OSError as exc:
                    raise _os_failure(exc, path) from None
                view = view[n:]
            return {"path": self._shown(fd, rel), "bytes_written": len(data), "size": os.fstat(fd).st_size}
        finally:
            os.close(fd)

    def edit_file(self, req: dict[str, Any]) -> dict[str, Any]:
        path, old, new = req["path"], req["old_string"], req["new_string"]
        if old == "":
            raise ToolFailure("invalid_arguments", "old_string must not be empty")
        data, _ = self._read_regular(path, 0, 0, int(req["max_bytes"]))
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ToolFailure("not_text", f"{path}: not UTF-8 text; use write_file") from None
        count = text.count(old)
        if count == 0:
            raise ToolFailure("no_match", f"{path}: old_string not found")
        if count > 1 and not req.get("replace_all"):
            raise ToolFailure(
                "ambiguous_match",
                f"{path}: old_string occurs {count} times; add surrounding context to make it unique "
                "or set replace_all",
            )
        updated = text.replace(old, new) if req.get("replace_all") else text.replace(old, new, 1)
        shown = self._replace_file(path, updated.encode())
        return {"path": shown, "replacements": count if req.get("replace_all") else 1}

    def _replace_file(self, path: str, data: bytes) -> str:
        """Give ``path`` the content ``data`` all at once: written in full to a new file beside it,
        then renamed over it (mode kept). A failure (no space, file size limit, a short write)
        leaves the original untouched, where truncating first would lose it. Returns the path
        (as bash sees it) of the file replaced."""
        rel_in = self._rel(path)
        root = self._root_fd()
        tmp_name: str | None = None
        dir_fd = -1
        try:
            try:
                # opened for writing only to be refused a file we may not write, as in place editing was
                fd = _openat2(root, rel_in, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY)
            except OSError as exc:
                raise _os_failure(exc, path) from None
            try:
                st = os.fstat(fd)
                # Where `path` really is (a symlink is edited at its target, as in place editing
                # did); openat2 guaranteed that this is inside the workspace.
                real = os.readlink(f"/proc/self/fd/{fd}")
            finally:
                os.close(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ToolFailure("not_regular", f"{path}: not a regular file")
            rel = os.path.relpath(real, os.readlink(f"/proc/self/fd/{root}"))
            parent, name = os.path.split(rel)
            if rel.startswith("..") or not name:
                raise ToolFailure("path_escape", f"{path}: resolves outside the workspace")
            try:
                dir_fd = _openat2(root, parent or ".", os.O_PATH | os.O_DIRECTORY)
                tmp_name = f".{name[:200]}.edit-{os.getpid()}-{time.monotonic_ns()}"
                tfd = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                              0o600, dir_fd=dir_fd)
                try:
                    view = memoryview(data)
                    while view:  # os.write may write less than asked (a short write): loop
                        view = view[os.write(tfd, view):]
                    os.fchmod(tfd, stat.S_IMODE(st.st_mode))
                finally:
                    os.close(tfd)
                os.rename(tmp_name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                tmp_name = None
                return os.path.normpath(os.path.join(self.workspace, rel))
            except OSError as exc:
                raise _os_failure(exc, path) from None
        finally:
            if tmp_name is not None and dir_fd >= 0:
                try:
                    os.unlink(tmp_name, dir_fd=dir_fd)
                except OSError:
                    pass
            if dir_fd >= 0:
                os.close(dir_fd)
            os.close(root)

    def list_dir(self, req: dict[str, Any]) -> dict[str, Any]:
        path = req.get("path") or "."
        limit = int(req.get("max_entries") or 1000)
        fd = self._open(path, os.O_RDONLY | os.O_DIRECTORY)
        entries = []
        try:
            shown = self._shown(fd, self._rel(path))
            names = sorted(os.listdir(fd))
            for name in names[:limit]:
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except OSError:
                    continue
                entries.append({"name": name, "type": _kind(st.st_mode), "size": st.st_size})
        finally:
            os.close(fd)
        return {"path": shown, "entries": entries, "truncated": len(names) > limit, "total": len(names)}

    def stat(self, req: dict[str, Any]) -> dict[str, Any]:
        path = req["path"]
        fd = self._open(path, os.O_PATH | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            shown = self._shown(fd, self._rel(path))
        finally:
            os.close(fd)
        return {"path": shown, "type": _kind(st.st_mode), "size": st.st_size,
                "mode": oct(stat.S_IMODE(st.st_mode)), "mtime": st.st_mtime}

    def archive(self, req: dict[str, Any]) -> dict[str, Any]:
        path = req.get("path") or "."
        max_bytes = int(req["max_bytes"])
        fd = self._open(path, os.O_RDONLY | os.O_DIRECTORY)
        buf = _BoundedBuffer(max_bytes)
        try:
            with tarfile.open(fileobj=buf, mode="w:gz") as tar:
                base = f"/proc/self/fd/{fd}"
                for dirpath, dirnames, filenames in os.walk(base):
                    dirnames.sort()
                    for name in sorted(dirnames) + sorted(filenames):
                        full = os.path.join(dirpath, name)
                        rel = os.path.relpath(full, base)
                        try:
                            info = tar.gettarinfo(full, arcname=rel)
                        except OSError:
                            continue
                        if info.isreg():
                            try:
                                with _open_nonblock(full) as fh:
                                    tar.addfile(info, fh)
                            except OSError:
                                continue
                        elif info.isdir() or info.issym() or info.islnk():
                            tar.addfile(info)
        except _ArchiveTooLarge:
            raise ToolFailure("too_large", f"{path}: archive exceeds the limit of {max_bytes} bytes") from None
        finally:
            os.close(fd)
        return {"content": base64.b64encode(buf.getvalue()).decode(), "encoding": "base64",
                "format": "tar.gz", "size": len(buf.getvalue())}

    # -- terminal --------------------------------------------------------------------------
    def terminal(self, req: dict[str, Any]) -> dict[str, Any]:
        sock = os.path.join(self.run_dir, "tmux.sock")
        log = os.path.join(self.run_dir, "terminal.log")
        tmux = ["tmux", "-S", sock]
        env = dict(self.env)

        def tmux_run(*args: str) -> subprocess.CompletedProcess[bytes]:
            return subprocess.run([*tmux, *args], env=env, capture_output=True, timeout=10,
                                  stdin=subprocess.DEVNULL)

        if tmux_run("has-session", "-t", "main").returncode != 0:
            created = tmux_run("new-session", "-d", "-s", "main", "-x", str(req.get("cols", 200)),
                               "-y", str(req.get("rows", 50)), "-c", self.workspace)
            if created.returncode != 0:
                raise ToolFailure("terminal_unavailable",
                                  "cannot start the terminal: " + created.stderr.decode(errors="replace"))
            tmux_run("pipe-pane", "-O", "-t", "main", f"exec cat >> {log}")
        for key in req.get("keys") or []:
            tmux_run("send-keys", "-t", "main", str(key))
        text = req.get("input") or ""
        if text:
            tmux_run("send-keys", "-t", "main", "-l", "--", text)
        enter = req.get("enter")
        if enter if enter is not None else bool(text):
            tmux_run("send-keys", "-t", "main", "Enter")
        wait = float(req.get("wait_ms", 2000)) / 1000.0
        settle = float(req.get("settle_ms", 300)) / 1000.0
        offset = int(req.get("offset") or 0)
        size = _size(log)
        end = time.monotonic() + wait
        last_change = time.monotonic()
        while time.monotonic() < end:
            time.sleep(0.01)
            now_size = _size(log)
            if now_size != size:
                size, last_change = now_size, time.monotonic()
                if _ends_with_prompt(log, size):
                    break  # the shell is back at its prompt: the command finished
            elif now_size > offset and time.monotonic() - last_change >= settle:
                break
        cap = int(req.get("max_output", 65536))
        if size < offset:
            offset = 0  # the log was truncated from inside the slot: what it holds now is all new
        text_out, truncated = _read_region(log, offset, size, cap)
        # Everything up to `size` counts as shown, even what the cap dropped: the next read starts
        # at what is new then, never in the middle of an old burst.
        return {"output": strip_ansi(text_out), "offset": size, "truncated": truncated, "bytes": size - offset}

    # -- protocol --------------------------------------------------------------------------
    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        handler = {
            "exec": self.run, "read_file": self.read_file, "write_file": self.write_file,
            "edit_file": self.edit_file, "list_dir": self.list_dir, "stat": self.stat,
            "archive": self.archive, "terminal": self.terminal, "ping": lambda _r: {"pong": True},
        }.get(str(op))
        if handler is None:
            return {"ok": False, "error": {"code": "unknown_op", "message": f"unknown op {op!r}"}}
        try:
            return {"ok": True, "result": handler(req)}
        except ToolFailure as exc:
            return {"ok": False, "error": {"code": exc.code, "message": str(exc)}}
        except (KeyError, TypeError, ValueError) as exc:
            return {"ok": False, "error": {"code": "invalid_arguments", "message": f"{type(exc).__name__}: {exc}"}}
        except OSError as exc:
            return {"ok": False, "error": {"code": "os_error", "message": str(exc)}}


class _ArchiveTooLarge(Exception):
    pass


class _BoundedBuffer(io.BytesIO):
    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def write(self, data: Any) -> int:
        if self.tell() + len(data) > self.limit:
            raise _ArchiveTooLarge
        return super().write(data)


def _open_nonblock(path: str) -> io.BufferedReader:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    return os.fdopen(fd, "rb")


def _read_region(path: str, start: int, end: int, cap: int) -> tuple[str, bool]:
    """Bytes ``start:end`` of a file as text, keeping only the first and last ``cap/2`` bytes with a
    marker between when the region is larger than ``cap``; reads no more than ``cap`` bytes."""
    if end <= start:
        return "", False
    capture = Capture(cap)
    with open(path, "rb") as fh:
        fh.seek(start)
        if end - start <= cap:
            capture.feed(fh.read(end - start))
        else:
            capture.feed(fh.read(capture.half))
            fh.seek(end - capture.half)
            # Capture counts what it is fed; the skipped middle is reported through `total`.
            capture.total += end - start - 2 * capture.half
            capture.feed(fh.read(capture.half))
    return capture.text()


PROMPT_END = b"]$ "


def _ends_with_prompt(path: str, size: int) -> bool:
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, size - 64))
            return fh.read().endswith(PROMPT_END)
    except OSError:
        return False


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def _limit_cpu(pid: int, seconds: Any) -> None:
    if seconds:
        try:
            resource.prlimit(pid, resource.RLIMIT_CPU, (int(seconds), int(seconds) + 1))
        except OSError:
            pass


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rfd, wfd = protocol_fds()
    apply_limits(cfg.get("limits", {}))
    if cfg.get("exec"):
        os.execvpe(cfg["exec"][0], cfg["exec"], dict(cfg.get("env", {})))
    sup = Supervisor(cfg)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    serve(rfd, wfd, sup.handle, idle=sup.idle)  # idle: the next warm bash starts after the reply


if __name__ == "__main__":
    main()
