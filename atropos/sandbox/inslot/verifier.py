"""The verification runner: runs *inside* a slot's verification sandbox, once per ``verify``.

The host starts it in a fresh sandbox of the slot only after every process of the slot was
killed (see docs/verification.md): the workspace is bound read-only, ``HOME`` and the working
directory are a private ``/tmp``, and no process of the agent exists any more. It makes itself
non-dumpable before anything arrives, so what it receives (the verifier program, its secrets:
hidden tests, expected answers, keys) can be read by no other process, not even by the agent's
code that the program itself runs in child processes.

One request on the protocol pipe: ``{"op": "verify", "program", "secrets", "args", "timeout"}``.
``program`` is Python source that defines ``verify(workspace, secrets, args)``; it runs in this
process, and what it returns is the verdict, sent back on the protocol pipe (never a file: nothing
in the workspace or in ``/tmp`` decides the score). The program's own stdout/stderr go to a
capture pipe whose tail comes back as ``log`` (a child it starts may write there too: it is for
reading, never for scoring).

On a slot whose root is a task image the runner's own root is made of host files and the slot's
root is the directory ``cfg["root"]`` of it (atropos/sandbox/host/isolation/verification.py): the
runner never loads, reads configuration from or executes anything of the root it checks. Every
child the program starts with ``subprocess`` runs *in* that root instead (``confine_children``): it
is chrooted there, its working directory taken inside it, its capabilities dropped before its exec,
and it gets the image's ``Env`` unless the program gives it an environment of its own.

Standard library only, like the supervisor: copied into the host's lib dir and run with the
sandbox's ``python3 -I -S``.
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import os
import signal
import stat
import sys
import threading
import traceback
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from atropos.sandbox.inslot.inslot_common import (
        Capture,
        apply_limits,
        make_undumpable,
        protocol_fds,
        serve,
    )
    from atropos.sandbox.inslot.inslot_fs import read_at_most
    from atropos.sandbox.inslot.inslot_protocol import InvalidRequest, check
else:  # run from the host's lib dir, beside inslot.py (isolated mode: the dir is not on sys.path)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from inslot_common import Capture, apply_limits, make_undumpable, protocol_fds, serve
    from inslot_fs import read_at_most
    from inslot_protocol import InvalidRequest, check
    del sys.path[0]

LOG_CAP = 16384
# openat2(2): resolve as if the workspace were /, no /proc magic links (linux/openat2.h)
RESOLVE_NO_MAGICLINKS, RESOLVE_IN_ROOT = 0x02, 0x10
SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(os.uname().machine)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def open_in_workspace(workspace: str, path: str) -> int:
    """An fd of ``path`` read-only, resolved inside ``workspace`` (``..``, absolute paths and
    symlinks stay inside it): a link the agent planted (``answer.txt -> /tmp/expected``) cannot
    make the verifier read its own files. Non-blocking, so a FIFO does not hang it."""
    if SYS_OPENAT2 is None:
        raise OSError(errno.ENOSYS, "openat2 is not available on this architecture")
    root = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        how = _OpenHow(os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY, 0,
                       RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
        fd = libc.syscall(SYS_OPENAT2, root, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
        return int(fd)
    finally:
        os.close(root)


def read_workspace(workspace: str, path: str, limit: int = 64 << 20) -> bytes:
    """The bytes of a regular file of the workspace (see ``open_in_workspace``), at most ``limit``."""
    import stat

    fd = open_in_workspace(workspace, path)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        return read_at_most(fd, limit)
    finally:
        os.close(fd)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def in_root(root: str, path: str) -> str:
    """``path`` (the runner's, under ``root``, or already the root's own) as the root's own path."""
    path = os.path.normpath(os.path.join(os.getcwd(), path))
    if path == root:
        return "/"
    if path.startswith(root.rstrip("/") + "/"):
        return path[len(root.rstrip("/")):]
    return path


def confine_children(root: str, child_env: dict[str, str]) -> None:
    """Every ``subprocess`` child of the runner runs with ``root`` as its ``/``: chrooted (the
    runner's CAP_SYS_CHROOT, in its sandbox's user namespace), its working directory the one asked
    for (a path of the runner's under ``root``, or of the root itself; the runner's own when none)
    resolved inside the root, every capability dropped before its exec (no_new_privs, set by
    bubblewrap, keeps uid 0 from regaining them there), and ``child_env`` as its environment unless
    the program gives one. The runner never executes anything of ``root`` itself."""
    import inspect
    import subprocess

    libc = ctypes.CDLL(None, use_errno=True)
    capset = libc.capset
    header, data = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0), (_CapData * 2)()  # made before any fork
    original = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    signature = inspect.signature(original)

    def execute_child(self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        given = bound.arguments
        where = in_root(root, given.get("cwd") or os.getcwd())
        where_b = os.fsencode(where)
        root_b = os.fsencode(root)
        then = given.get("preexec_fn")

        def enter() -> None:
            os.chroot(root_b)
            os.chdir(where_b)
            if capset(ctypes.byref(header), data) != 0:
                raise OSError(ctypes.get_errno(), "capset")
            if then is not None:
                then()

        given["cwd"] = None
        given["preexec_fn"] = enter
        if given.get("env") is None:
            given["env"] = dict(child_env)
        return original(*bound.args, **bound.kwargs)

    subprocess.Popen._execute_child = execute_child  # type: ignore[attr-defined]


class VerifierTimeout(BaseException):
    """Raised in the program at its deadline (a BaseException: ``except Exception`` lets it through)."""


def _capture_stdio() -> tuple[Capture, threading.Thread]:
    """Point fds 1 and 2 at a pipe drained into a bounded capture."""
    r, w = os.pipe2(os.O_CLOEXEC)
    for fd in (1, 2):
        os.dup2(w, fd)  # dup2 clears O_CLOEXEC: children inherit 1 and 2, as with any program
    os.close(w)
    capture = Capture(LOG_CAP)

    def drain() -> None:
        while True:
            try:
                chunk = os.read(r, 65536)
            except OSError:
                return
            if not chunk:
                return
            capture.feed(chunk)

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    return capture, thread


def _plain(value: Any) -> Any:
    """The verdict as plain JSON values (a program's own objects never cross)."""
    return json.loads(json.dumps(value, allow_nan=False))


def restore_from_image(pristine: str, paths: list[str], root: str = "/") -> list[str]:
    """Put every absolute path of ``paths`` back exactly as the image has it (``pristine`` is the
    image's read-only view): whatever the agent made of it (an edit, a deletion, a symlink or a
    file in its place, new files inside a restored directory) is removed first, and a path the image
    does not have is removed. The parents on the way become what the image has there too (a
    directory the agent swapped for a symlink would otherwise carry the restored files elsewhere).
    ``root`` is where the runner sees the slot's ``/`` (``paths`` are the slot's own). Runs inside
    the verifier's sandbox and never follows a link of the slot's.

    What is already as the image has it (same type, mode, owner, size and bytes; same link target)
    is left in place: cheaper than a copy, and the image's files of a uid the slot does not map
    cannot be removed by the slot at all (EOVERFLOW), only left as they are."""
    done = []
    for path in paths:
        norm = os.path.normpath(str(path))
        if not norm.startswith("/") or norm == "/" or norm.startswith("//") or "\0" in norm:
            raise ValueError(f"restore: not an absolute path below /: {path!r}")
        mine = os.path.join(root, norm.lstrip("/"))
        if mine == pristine or mine.startswith(pristine + "/"):
            raise ValueError(f"restore: {path!r} is the image's own view")
        parts = norm.strip("/").split("/")
        here = root
        for i, part in enumerate(parts):
            target, source = os.path.join(here, part), os.path.join(pristine, *parts[: i + 1])
            last = i == len(parts) - 1
            if not last and os.path.isdir(source) and not os.path.islink(source):
                if not (os.path.isdir(target) and not os.path.islink(target)):
                    _remove(target)
                    os.mkdir(target, os.lstat(source).st_mode & 0o7777)
                here = target
                continue
            if os.path.lexists(source):
                _sync(source, target)
            else:
                _remove(target)
            break  # the image has a file or nothing here: what lies beyond is gone with it
        done.append(norm)
    return done


def _sync(source: str, target: str) -> None:
    """Make ``target`` what ``source`` is, touching only what differs."""
    import shutil

    src = os.lstat(source)
    try:
        dst: os.stat_result | None = os.lstat(target)
    except FileNotFoundError:
        dst = None
    if stat.S_ISDIR(src.st_mode):
        if dst is None or not stat.S_ISDIR(dst.st_mode):
            if dst is not None:
                _remove(target)
            shutil.copytree(source, target, symlinks=True)
            return
        if stat.S_IMODE(dst.st_mode) != stat.S_IMODE(src.st_mode):
            os.chmod(target, stat.S_IMODE(src.st_mode))
        want = set(os.listdir(source))
        for name in set(os.listdir(target)) - want:
            _remove(os.path.join(target, name))
        for name in sorted(want):
            _sync(os.path.join(source, name), os.path.join(target, name))
        return
    if dst is not None and _same(source, src, target, dst):
        return
    _remove(target)
    if stat.S_ISLNK(src.st_mode):
        os.symlink(os.readlink(source), target)
    else:
        shutil.copy2(source, target, follow_symlinks=False)


def _same(a: str, sa: os.stat_result, b: str, sb: os.stat_result) -> bool:
    if (sa.st_mode, sa.st_uid, sa.st_gid) != (sb.st_mode, sb.st_uid, sb.st_gid):
        return False
    if stat.S_ISLNK(sa.st_mode):
        return os.readlink(a) == os.readlink(b)
    if not stat.S_ISREG(sa.st_mode) or sa.st_size != sb.st_size:
        return False
    try:
        with open(a, "rb") as fa, open(b, "rb") as fb:
            while True:
                x, y = fa.read(1 << 20), fb.read(1 << 20)
                if x != y:
                    return False
                if not x:
                    return True
    except PermissionError:
        # Unreadable to the slot's root: an owner or group the slot does not map (root reads
        # everything else). Such a file cannot be written, moved or made by the slot (EOVERFLOW),
        # so with the same metadata it is the image's own, untouched.
        return sa.st_mtime_ns == sb.st_mtime_ns


def _remove(path: str) -> None:
    import shutil

    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def run_program(req: dict[str, Any]) -> dict[str, Any]:
    secrets = {str(k): str(v) for k, v in (req.get("secrets") or {}).items()}
    restore = [str(p) for p in req.get("restore") or []]
    if restore:
        pristine = req.get("pristine")
        if not pristine:
            return {"error": {"code": "bad_program", "message": "restore needs a slot whose root is an image"}}
        try:
            restore_from_image(str(pristine), restore, str(req.get("root") or "/"))
        except (OSError, ValueError) as exc:
            return {"error": {"code": "restore_failed", "message": f"{type(exc).__name__}: {exc}"}}
    if req.get("cwd"):  # an image's WorkingDir: where its tests expect to run
        try:
            os.chdir(str(req["cwd"]))
        except OSError:
            pass
    workspace = str(req.get("workspace", "/workspace"))
    namespace: dict[str, Any] = {
        "__name__": "__verifier__", "__builtins__": __builtins__, "ROOT": str(req.get("root") or "/"),
        "read_workspace": lambda path, limit=64 << 20: read_workspace(workspace, path, limit),
        "open_in_workspace": lambda path: open_in_workspace(workspace, path),
    }

    def expire(_sig: int, _frame: Any) -> None:
        raise VerifierTimeout(f"the verifier program ran past its {req['timeout']}s")

    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, float(req["timeout"]))
    try:
        exec(compile(str(req["program"]), "<verifier>", "exec"), namespace)
        fn = namespace.get("verify")
        if not callable(fn):
            return {"error": {"code": "bad_program",
                              "message": "the program defines no verify(workspace, secrets, args)"}}
        verdict = fn(workspace, secrets, req.get("args"))
    except VerifierTimeout as exc:
        return {"error": {"code": "timed_out", "message": str(exc)}}
    except BaseException as exc:  # the program's failure, reported with its traceback in the log
        sys.stderr.write(traceback.format_exc())
        return {"error": {"code": "program_failed", "message": f"{type(exc).__name__}: {exc}"}}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if isinstance(verdict, bool) or not isinstance(verdict, (int, float, dict)):
        return {"error": {"code": "bad_verdict", "message": f"verify() returned {type(verdict).__name__}; "
                                                           "return a number or a dict with 'score'"}}
    if not isinstance(verdict, dict):
        verdict = {"score": verdict}
    score = verdict.get("score")
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        return {"error": {"code": "bad_verdict", "message": "the verdict's 'score' is not a finite number"}}
    try:
        return {"verdict": _plain(verdict)}
    except (TypeError, ValueError) as exc:
        return {"error": {"code": "bad_verdict", "message": f"the verdict is not plain JSON: {exc}"}}


def main() -> None:
    make_undumpable()  # first: the secrets arrive only after the ready frame
    cfg = json.loads(sys.argv[1])
    rfd, wfd = protocol_fds()
    apply_limits(cfg.get("limits", {}))
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in cfg.get("env", {}).items()})
    root = cfg.get("root")
    if root:  # an image slot's: the runner's own root is the host's, the programs it checks run in ``root``
        confine_children(str(root), {str(k): str(v) for k, v in cfg.get("child_env", {}).items()})
    log, _drain = _capture_stdio()
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    done = False

    def handle(req: dict[str, Any]) -> dict[str, Any]:
        nonlocal done
        if done or req.get("op") != "verify":
            return {"ok": False, "error": {"code": "invalid_request", "message": "one verify request per sandbox"}}
        done = True
        try:
            req = check(req)
        except InvalidRequest as exc:
            return {"ok": False, "error": {"code": "invalid_request", "message": str(exc)}}
        outcome = run_program({**req, "root": root})
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        text, _ = log.text()
        return {"ok": True, "result": {**outcome, "log": text}}

    serve(rfd, wfd, handle)


if __name__ == "__main__":
    main()
