"""The per-slot supervisor: runs *inside* a slot's sandbox and executes every call of the slot.

One supervisor lives per leased slot (started once inside bubblewrap), so a call costs a
fork+exec, not a sandbox start. It talks to the host over its stdin/stdout with length-prefixed
JSON frames and handles one request at a time (calls of one slot run in order).

This file must stay standard-library only and self-contained: it is copied into the host's data
directory and executed by whatever ``python3`` the sandbox's ``/usr`` offers.

Threat model: everything here runs with the same identity as the untrusted code. The supervisor
protects the *host* from the slot (bounded output, bounded reads, no hangs on FIFOs, nothing of a
call survives it), not itself from its own slot: a command that kills the supervisor only kills
its own slot's sandbox, which the host then restarts. It is non-dumpable (``make_undumpable``), so
the slot's code cannot read the requests it holds through ``/proc/<pid>/mem``, ``environ`` or
``fd/*``; and nothing that start-up code of a warm interpreter forks between calls lives into the
next operation (see ``Supervisor.untouched``). A *sealed* supervisor (the slot's verification
phase, see docs/verification.md) starts no interpreter and runs no command at all.
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
    from atropos.sandbox.inslot import Capture, apply_limits, make_undumpable, ns_last_pid, protocol_fds, serve
else:  # run from the host's lib dir, beside inslot.py (isolated mode: the dir is not on sys.path)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from inslot import Capture, apply_limits, make_undumpable, ns_last_pid, protocol_fds, serve
    del sys.path[0]

# openat2(2) resolution flags (linux/openat2.h)
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08
SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(os.uname().machine)
MAX_OFFSET = (1 << 63) - 1  # off_t


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
        # The verification phase: read-only file operations only, no interpreter is ever started.
        self.sealed = bool(cfg.get("sealed", False))
        # The pid of the last process this supervisor started (and has not reaped) while no other
        # process of the sandbox existed, or None. While ns_last_pid still equals it, nobody else
        # has forked since: start-up code of a waiting interpreter (a .pth file, sitecustomize)
        # has not left a process behind. See `untouched`.
        self.mark: int | None = None

    # -- what start-up code may leave behind -----------------------------------------------
    def untouched(self) -> bool:
        """No pid was handed out in our PID namespace since ``mark``.

        ``mark`` is a pid we hold unreaped (alive or a zombie), so the kernel cannot hand it out
        again: ns_last_pid can equal it only if no process or thread was created since. Exact,
        unlike a scan of /proc, which a process forking and exiting in a loop can outrun."""
        return self.mark is not None and ns_last_pid() == self.mark

    def clean_slate(self) -> None:
        """Kill every process of the sandbox but us (waiting interpreters included) and start counting
        pids afresh: from here on, every pid handed out here is one we asked for."""
        self.kill_leftovers()
        self._drop_warm()
        self.mark = ns_last_pid() if self.isolated else None

    def guard(self) -> None:
        """Before any operation: if anything was forked since our last own start of a process (only
        the start-up code of a waiting interpreter can have), it and the interpreters go."""
        if self.isolated and self.warm and not self.untouched():
            self.clean_slate()

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
        self.guard()  # again, right before a waiting interpreter is handed the call
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
            self.mark = ns_last_pid()  # the call's process is still unreaped: its pid stays taken
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
        """Between calls: have interpreters waiting for the next ones (start-up off the call's path).

        Each is started only while nothing but us runs in the sandbox, and must get the very next
        pid (else something forked in between); then ``mark`` moves to it (see ``untouched``)."""
        if self.sealed:
            return
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
                if self.isolated and not self.untouched():
                    self.clean_slate()
                before = self.mark
                started = WarmInterpreter(kind, self.root_dir, self.env)
                self.warm[kind] = started
                if self.isolated:
                    if before is None or started.proc.pid != before + 1:
                        self.clean_slate()  # someone else took a pid in between: no warm ones now
                        return
                    self.mark = started.proc.pid
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
        if not 0 <= offset <= MAX_OFFSET or limit < 0:
            raise ToolFailure("invalid_arguments", f"offset must be 0..{MAX_OFFSET} and limit >= 0")
        fd = self._open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise ToolFailure("is_directory", f"{path}: is a directory (use list_dir)")
            if not stat.S_ISREG(st.st_mode):
                raise ToolFailure("not_regular", f"{path}: not a regular file")
            want = max(st.st_size - offset, 0) if limit <= 0 else limit
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
            with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT, encoding="utf-8",
                              errors="surrogateescape") as tar:
                walk = _TarWalk(tar, fd)
                fd = -1  # the walk owns it now
                walk.run()
        except _ArchiveTooLarge:
            raise ToolFailure("too_large", f"{path}: archive exceeds the limit of {max_bytes} bytes") from None
        finally:
            if fd >= 0:
                os.close(fd)
        return {"content": base64.b64encode(buf.getvalue()).decode(), "encoding": "base64",
                "format": "tar.gz", "size": len(buf.getvalue()), "members": walk.members,
                "skipped": walk.skipped[:_SKIPPED_SHOWN], "skipped_total": len(walk.skipped)}

    # -- terminal --------------------------------------------------------------------------
    def terminal(self, req: dict[str, Any]) -> dict[str, Any]:
        # Its tmux clients take pids: with no waiting interpreter alive meanwhile, all of them are
        # ours, and counting can go on from the last one (new interpreters start when idle).
        self.clean_slate()
        try:
            return self._terminal(req)
        finally:
            if self.isolated:
                self.mark = ns_last_pid()

    def _terminal(self, req: dict[str, Any]) -> dict[str, Any]:
        sock = os.path.join(self.run_dir, "tmux.sock")
        log = os.path.join(self.run_dir, "terminal.log")
        tmux = ["tmux", "-S", sock]
        env = dict(self.env)

        def tmux_run(*args: str) -> subprocess.CompletedProcess[bytes]:
            try:
                return subprocess.run([*tmux, *args], env=env, capture_output=True, timeout=TMUX_TIMEOUT,
                                      stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                # e.g. tmux.sock replaced from inside the slot by a socket nobody answers on
                raise ToolFailure("terminal_unavailable", f"the terminal did not answer within {TMUX_TIMEOUT} s; "
                                                          "reset the slot for a new terminal") from None

        try:
            is_socket = stat.S_ISSOCK(os.lstat(sock).st_mode)
        except OSError:
            is_socket = False
        if not is_socket:
            raise ToolFailure("terminal_unavailable", f"{sock} is not the terminal's socket any more (replaced from "
                                                      "inside the slot); the next terminal call starts a new one")
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
        if self.sealed and op in SEALED_REFUSED:
            return {"ok": False, "error": {"code": "verification_phase", "message":
                    f"{op}: the slot is in its verification phase; only reading the workspace is allowed"}}
        try:
            self.guard()
            return {"ok": True, "result": handler(req)}
        except ToolFailure as exc:
            return {"ok": False, "error": {"code": exc.code, "message": str(exc)}}
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            return {"ok": False, "error": {"code": "invalid_arguments", "message": f"{type(exc).__name__}: {exc}"}}
        except OSError as exc:
            return {"ok": False, "error": {"code": "os_error", "message": str(exc)}}
        except Exception as exc:  # whatever a request provokes, the slot keeps its supervisor
            return {"ok": False, "error": {"code": "tool_error", "message": f"{op}: {type(exc).__name__}: {exc}"}}


SEALED_REFUSED = frozenset({"exec", "terminal", "write_file", "edit_file"})


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


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_SKIPPED_SHOWN = 100


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


class _TarWalk:
    """Adds a directory's tree to a tar, safe against the slot that owns the tree (see docs/containment.md).

    Iterative (any depth), one directory descriptor open at a time: every entry is opened relative to
    its directory's descriptor with O_NOFOLLOW, so a symlink is stored as a link and never followed,
    whatever is swapped in meanwhile. Going back up reopens ``..`` and checks it is the directory that
    was left; otherwise the tree moved under the walk and the call fails (no archive of a mixture).
    Member names are the walked names joined by ``/``: relative, never ``.``/``..``/absolute. Each
    regular file is read through the one descriptor its member describes, exactly ``st_size`` bytes;
    one that shrinks meanwhile fails the call. Sockets, FIFOs and devices are skipped and reported,
    as are entries that vanished, changed type or cannot be read.
    """

    def __init__(self, tar: tarfile.TarFile, root_fd: int) -> None:
        self.tar = tar
        self.fd = root_fd
        self.skipped: list[dict[str, str]] = []
        self.members = 0
        self.links: dict[tuple[int, int], str] = {}  # hard links: (dev, ino) -> first member name

    def run(self) -> None:
        try:
            st = os.fstat(self.fd)
            # per open level: member-name prefix, names still to visit, identity of the directory
            stack: list[tuple[str, Any, tuple[int, int]]] = [("", iter(sorted(os.listdir(self.fd))), _identity(st))]
            while stack:
                prefix, names, _ = stack[-1]
                name = next(names, None)
                if name is None:
                    stack.pop()
                    if stack:
                        self._up(stack[-1][2])
                    continue
                child = self._entry(prefix + name, name)
                if child is not None:
                    stack.append(child)
        finally:
            os.close(self.fd)

    def _up(self, expected: tuple[int, int]) -> None:
        parent = os.open("..", _DIR_FLAGS, dir_fd=self.fd)
        os.close(self.fd)
        self.fd = parent
        if _identity(os.fstat(parent)) != expected:
            raise ToolFailure("changed_during_archive", "a directory was moved while it was being archived; "
                                                        "archive again once the tree is still")

    def _skip(self, rel: str, why: str) -> None:
        self.skipped.append({"path": rel, "reason": why})

    def _info(self, rel: str, st: os.stat_result, kind: bytes) -> tarfile.TarInfo:
        info = tarfile.TarInfo(rel)
        info.type = kind
        info.mode = stat.S_IMODE(st.st_mode)
        info.mtime = int(st.st_mtime)
        info.uid, info.gid = st.st_uid, st.st_gid
        return info

    def _add(self, info: tarfile.TarInfo, data: Any = None) -> None:
        self.tar.addfile(info, data)
        self.members += 1

    def _entry(self, rel: str, name: str) -> tuple[str, Any, tuple[int, int]] | None:
        """Add one entry; for a directory, enter it and return its stack level."""
        try:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None  # removed since the listing: as if listed a moment later
        except OSError as exc:
            self._skip(rel, f"unreadable: {exc.strerror}")
            return None
        mode = st.st_mode
        if stat.S_ISLNK(mode):
            try:
                target = os.readlink(name, dir_fd=self.fd)
            except OSError as exc:
                self._skip(rel, f"changed while archived: {exc.strerror}")
                return None
            info = self._info(rel, st, tarfile.SYMTYPE)
            info.linkname = target
            self._add(info)
            return None
        if stat.S_ISDIR(mode):
            return self._enter(rel, name, st)
        if stat.S_ISREG(mode):
            self._file(rel, name, st)
            return None
        kind = ("socket" if stat.S_ISSOCK(mode) else "fifo" if stat.S_ISFIFO(mode)
                else "device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "other")
        self._skip(rel, kind)
        return None

    def _open_at(self, rel: str, name: str, flags: int, st: os.stat_result) -> tuple[int, os.stat_result] | None:
        """Open ``name`` without following a link; None (reported) unless it is still what was listed."""
        try:
            fd = os.open(name, flags, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._skip(rel, "changed while archived" if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO)
                       else f"unreadable: {exc.strerror}")
            return None
        now = os.fstat(fd)
        if _identity(now) != _identity(st) or stat.S_IFMT(now.st_mode) != stat.S_IFMT(st.st_mode):
            os.close(fd)
            self._skip(rel, "changed while archived")
            return None
        return fd, now

    def _enter(self, rel: str, name: str, st: os.stat_result) -> tuple[str, Any, tuple[int, int]] | None:
        opened = self._open_at(rel, name, _DIR_FLAGS, st)
        if opened is None:
            return None
        fd, st = opened
        try:
            names = sorted(os.listdir(fd))
            # The walk comes back up through `..`: a directory it could not leave is not entered.
            os.close(os.open("..", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd))
        except OSError as exc:
            os.close(fd)
            self._add(self._info(rel, st, tarfile.DIRTYPE))
            self._skip(rel + "/", f"contents unreadable: {exc.strerror}")
            return None
        try:
            self._add(self._info(rel, st, tarfile.DIRTYPE))
        except BaseException:
            os.close(fd)
            raise
        os.close(self.fd)
        self.fd = fd
        return rel + "/", iter(names), _identity(st)

    def _file(self, rel: str, name: str, st: os.stat_result) -> None:
        opened = self._open_at(rel, name, _FILE_FLAGS, st)
        if opened is None:
            return
        fd, st = opened
        try:
            if st.st_nlink > 1:
                first = self.links.get(_identity(st))
                if first is not None:
                    info = self._info(rel, st, tarfile.LNKTYPE)
                    info.linkname = first
                    self._add(info)
                    return
                self.links[_identity(st)] = rel
            info = self._info(rel, st, tarfile.REGTYPE)
            info.size = st.st_size
            self._add(info, _ExactReader(fd, st.st_size, rel))
        finally:
            os.close(fd)


class _ExactReader:
    """A file's first ``size`` bytes (what its tar header announced), or a tool error if it shrank."""

    def __init__(self, fd: int, size: int, rel: str) -> None:
        self.fd, self.left, self.rel = fd, size, rel

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        parts: list[bytes] = []
        got = 0
        while got < n:
            chunk = os.read(self.fd, min(n - got, 1 << 20))
            if not chunk:
                raise ToolFailure("changed_during_archive", f"{self.rel}: shrank while it was being archived; "
                                                            "archive again once it is still")
            parts.append(chunk)
            got += len(chunk)
        self.left -= got
        return b"".join(parts)


def _read_region(path: str, start: int, end: int, cap: int) -> tuple[str, bool]:
    """Bytes ``start:end`` of a file as text, keeping only the first and last ``cap/2`` bytes with a
    marker between when the region is larger than ``cap``; reads no more than ``cap`` bytes."""
    if end <= start:
        return "", False
    capture = Capture(cap)
    fh = _open_log(path)
    if fh is None:
        return "", False
    with fh:
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
TMUX_TIMEOUT = 5


def _open_log(path: str) -> io.FileIO | None:
    """The terminal log for reading, never blocking on whatever the slot may have put in its place."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return io.FileIO(fd, "rb")


def _ends_with_prompt(path: str, size: int) -> bool:
    fh = _open_log(path)
    if fh is None:
        return False
    with fh:
        fh.seek(max(0, size - 64))
        return (fh.read(64) or b"").endswith(PROMPT_END)


def _size(path: str) -> int:
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


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
    make_undumpable()  # before the first request arrives
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
