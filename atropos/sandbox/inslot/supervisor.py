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

Its parts, one module each (all copied beside it into the host's lib dir, see ``atropos.sandbox.inslot.LIB_FILES``):
``inslot_warm`` (waiting interpreters), ``inslot_files`` (file tools beneath the workspace),
``inslot_archive`` (the archive tool), ``inslot_terminal`` (the tmux terminal), ``inslot_fs`` (the
descriptor-relative walk and read, shared with the host's ``trees.py``), ``inslot`` (the wire and
what the session driver shares). This module runs commands and keeps the slot's process
table clean.
"""

from __future__ import annotations

import json
import math
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from atropos.sandbox.inslot.inslot_archive import archive
    from atropos.sandbox.inslot.inslot_common import (
        Capture,
        apply_limits,
        clean_signals,
        cloexec_all,
        make_undumpable,
        ns_last_pid,
        protocol_fds,
        serve,
    )
    from atropos.sandbox.inslot.inslot_files import SlotFiles, ToolFailure
    from atropos.sandbox.inslot.inslot_protocol import OPS, check
    from atropos.sandbox.inslot.inslot_terminal import run_terminal
    from atropos.sandbox.inslot.inslot_warm import BASH, PYTHON, WARM_KINDS, Child, WarmInterpreter, cpu_limit
else:  # run from the host's lib dir, beside inslot.py (isolated mode: the dir is not on sys.path)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from inslot_common import (
        Capture,
        apply_limits,
        clean_signals,
        cloexec_all,
        make_undumpable,
        ns_last_pid,
        protocol_fds,
        serve,
    )
    from inslot_files import SlotFiles, ToolFailure
    from inslot_protocol import OPS, check
    from inslot_warm import BASH, PYTHON, WARM_KINDS, Child, WarmInterpreter, cpu_limit
    del sys.path[0]


def _sibling(name: str) -> Any:
    """A module of the lib dir imported on first use: the archive and terminal tools (tarfile, the
    compressors, tmux's driver) cost every sandbox's start-up but serve few leases."""
    module = sys.modules.get(name)
    if module is None:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        try:
            module = __import__(name)
        finally:
            del sys.path[0]
    return module


class Supervisor:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.workspace = cfg.get("workspace", "/workspace")
        self.run_dir = cfg.get("run_dir", "/run/term")
        self.env = dict(cfg.get("env", {}))
        self.warm_cpu: int | None = None  # the CPU limit the last call asked for (see run)
        self.isolated = bool(cfg.get("isolated", True))
        cwd = cfg.get("cwd")  # an image's WorkingDir (the workspace is then "/")
        if cwd is not None and not os.path.isdir(cwd):
            cwd = "/"  # removed by the slot's root user: calls start at / (docker exec would refuse)
        self.files = SlotFiles(self.workspace, cwd)
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
        # Waiting interpreters killed but not reaped yet: one of them may hold ``mark``'s pid (see
        # retire_python); reaped once a later start has moved the mark past it.
        self.retired: list[WarmInterpreter] = []

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
        timeout, cap, hard_cap = req["timeout"], req["max_output"], req["hard_output"]  # checked: inslot_protocol
        where = req["cwd"] or "."
        # The workspace root never moves while this sandbox lives (see idle): no lookup for it.
        cwd = self.root_dir if where == "." and self.root_dir is not None else self.files._resolve_dir(where)
        self.guard()  # again, right before a waiting interpreter is handed the call
        warm = self._take_warm(argv, req, cwd)
        self.warm_cpu = req.get("cpu_seconds") or None  # what the next waiting interpreters set themselves
        # While the mark holds after the call, nothing was created in the sandbox during it (see below).
        mark = self.mark if warm is not None and not self.warm else None
        if warm is not None:
            proc: Child | _PopenChild = warm.proc
            pidfd = warm.pidfd
            warm.pidfd = -1  # ours to close now
            start = time.monotonic()
            warm.go(argv[2])
        else:
            env = dict(self.env)
            env.update(req["env"])
            start = time.monotonic()
            try:
                proc = _PopenChild(self._popen(argv, req, cwd, env))
            except OSError as exc:
                return {"exit_code": 127, "signal": None, "timed_out": False, "stdout": "",
                        "stderr": f"cannot start {argv[0]}: {exc.strerror}\n", "stdout_bytes": 0,
                        "stderr_bytes": 0, "stdout_truncated": False, "stderr_truncated": False,
                        "duration_ms": 0.0, "output_limited": False}
            pidfd = os.pidfd_open(proc.pid)
        out, err = Capture(cap), Capture(cap)
        streams = {proc.out_fd: out, proc.err_fd: err}
        poller = select.poll()
        for fd in (proc.out_fd, proc.err_fd, pidfd):
            poller.register(fd, select.POLLIN)
        open_fds = 3
        deadline = start + timeout
        timed_out = output_limited = exited = False
        while open_fds:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            # Once the main process is gone, a background child holding the pipe must not keep
            # the call open: give the pipes a short grace to drain, then stop.
            events = poller.poll(50 if exited else math.ceil(remaining * 1000))
            if exited and not events:
                break
            for fd, _ in events:
                if fd == pidfd:
                    exited = True
                    poller.unregister(pidfd)
                    open_fds -= 1
                    continue
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    poller.unregister(fd)
                    open_fds -= 1
                    continue
                streams[fd].feed(chunk)
            if out.total + err.total > hard_cap:
                output_limited = True
                break
        os.close(pidfd)
        if (mark is not None and exited and not timed_out and not output_limited and not self.warm
                and ns_last_pid() == mark):
            # No pid was handed out in the sandbox since the interpreter that ran the call was
            # started (it was the last, and is unreaped): the call created no process or thread,
            # and no waiting interpreter is left that it could have touched. Nothing to sweep.
            pass
        else:
            self.kill_leftovers()
            if self.isolated:
                self._drop_warm()  # kill(-1) took them too: reap them, new ones start when we are idle
                self.mark = ns_last_pid()  # the call's process is still unreaped: its pid stays taken
        if not self.isolated and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
        proc.close_pipes()
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
                close_fds=True, start_new_session=True, preexec_fn=cpu_limit(req.get("cpu_seconds")),
            )
        finally:
            os.close(stdin_fd)

    def _take_warm(self, argv: list[str], req: dict[str, Any], cwd: str) -> WarmInterpreter | None:
        """The waiting interpreter of this call's kind, if the call is exactly what it was started for."""
        if not argv or argv[0] not in WARM_KINDS:
            return None
        self.last_kind = argv[0]
        warm = self.warm.get(argv[0])
        # a CPU limit is set by the process itself before its exec (cpu_limit): a waiting one has its own
        if (len(argv) != 3 or argv[1] != "-c" or warm is None or req.get("stdin") or req.get("env") or cwd != warm.cwd
                or warm.cpu != (req.get("cpu_seconds") or None) or not warm.alive()):
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
                if warm.alive() and warm.cpu == self.warm_cpu:
                    continue
                del self.warm[kind]
                warm.drop()
            try:
                if self.root_dir is None:  # the workspace root never moves while this sandbox lives
                    self.root_dir = self.files._resolve_dir(".")
                if self.isolated and not self.untouched():
                    self.clean_slate()
                before = self.mark
                started = WarmInterpreter(kind, self.root_dir, self.env, self.warm_cpu)
                self.warm[kind] = started
                if self.isolated:
                    if before is None or started.proc.pid != before + 1:
                        self.clean_slate()  # someone else took a pid in between: no warm ones now
                        return
                    self.mark = started.proc.pid
            except (OSError, ToolFailure, subprocess.SubprocessError):
                return  # e.g. the process limit: calls start their own
        self._reap_retired()

    def _drop_warm(self) -> None:
        warm, self.warm = self.warm, {}
        for interpreter in [*warm.values(), *self.retired]:
            interpreter.drop()
        self.retired = []

    def retire_python(self) -> None:
        """After a file tool wrote: the waiting python3 started before the write (its start-up read the
        user site, its .pth files, sitecustomize) never serves a later call, as a fresh ``python3 -c``
        would see the files. Killed now; reaped (``_reap_retired``) only once a later start has moved
        ``mark`` past its pid, which it holds until then (see ``untouched``). The waiting bash read
        nothing of the workspace at its start: it stays."""
        warm = self.warm.pop(PYTHON, None)
        if warm is None:
            return
        warm.close_fds()
        try:
            warm.proc.kill()
        except OSError:
            pass
        self.retired.append(warm)

    def _reap_retired(self) -> None:
        keep = [w for w in self.retired if self.mark == w.proc.pid]
        for interpreter in self.retired:
            if interpreter not in keep:
                interpreter.drop()
        self.retired = keep

    # -- tools -----------------------------------------------------------------------------
    def archive(self, req: dict[str, Any]) -> dict[str, Any]:
        if TYPE_CHECKING:
            return archive(self.files, req)
        return _sibling("inslot_archive").archive(self.files, req)

    # -- terminal --------------------------------------------------------------------------
    def terminal(self, req: dict[str, Any]) -> dict[str, Any]:
        # Its tmux clients take pids: with no waiting interpreter alive meanwhile, all of them are
        # ours, and counting can go on from the last one (new interpreters start when idle).
        self.clean_slate()
        try:
            run = run_terminal if TYPE_CHECKING else _sibling("inslot_terminal").run_terminal
            return run(req, self.files.cwd or self.workspace, self.run_dir, self.env, self.cfg.get("tmux"),
                       self.cfg.get("terminal_shell"))
        finally:
            if self.isolated:
                self.mark = ns_last_pid()

    # -- protocol --------------------------------------------------------------------------
    def ops(self) -> dict[str, Callable[[dict[str, Any]], Any]]:
        """The ops this supervisor answers (declared in inslot_protocol.OPS, served_by "supervisor"; the
        tools' definitions in atropos/sandbox/contract/tools.py name them)."""
        return {
            "exec": self.run, "read_file": self.files.read_file, "write_file": self.files.write_file,
            "edit_file": self.files.edit_file, "list_dir": self.files.list_dir, "stat": self.files.stat,
            "archive": self.archive, "terminal": self.terminal, "ping": lambda _r: {"pong": True},
        }

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        handler = self.ops().get(str(op))
        if handler is None:
            return {"ok": False, "error": {"code": "unknown_op", "message": f"unknown op {op!r}"}}
        if self.sealed and op in SEALED_REFUSED:
            return {"ok": False, "error": {"code": "verification_phase", "message":
                    f"{op}: the slot is in its verification phase; only reading the workspace is allowed"}}
        try:
            req = check(req)  # its op's declared fields, defaults filled in; anything else refused
            self.guard()
            result = handler(req)
            if OPS[req["op"]].writes_files:
                self.retire_python()
            return {"ok": True, "result": result}
        except ToolFailure as exc:
            return {"ok": False, "error": {"code": exc.code, "message": str(exc)}}
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            return {"ok": False, "error": {"code": "invalid_arguments", "message": f"{type(exc).__name__}: {exc}"}}
        except OSError as exc:
            return {"ok": False, "error": {"code": "os_error", "message": str(exc)}}
        except Exception as exc:  # whatever a request provokes, the slot keeps its supervisor
            return {"ok": False, "error": {"code": "tool_error", "message": f"{op}: {type(exc).__name__}: {exc}"}}


class _PopenChild:
    """A call's own process (not a warm one): the ``Child`` view of its Popen."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        self.proc = proc
        self.pid = proc.pid
        self.out_fd = proc.stdout.fileno()
        self.err_fd = proc.stderr.fileno()
        os.set_blocking(self.out_fd, False)
        os.set_blocking(self.err_fd, False)

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self) -> int:
        return self.proc.wait()

    def close_pipes(self) -> None:
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


# The ops a sealed supervisor refuses (the host refuses their tools first; this holds if it did not).
# Stdlib-only, so not derived from the definitions: tests/test_tool_definitions.py checks it against them.
SEALED_REFUSED = frozenset({"exec", "terminal", "write_file", "edit_file"})




def main() -> None:
    make_undumpable()  # before the first request arrives
    clean_signals()
    cfg = json.loads(sys.argv[1])
    rfd, wfd = protocol_fds()
    apply_limits(cfg.get("limits", {}))
    cloexec_all()  # what bwrap handed us stays here: interpreters are spawned without a close-all
    sup = Supervisor(cfg)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    serve(rfd, wfd, sup.handle, idle=sup.idle)  # idle: the next warm bash starts after the reply


if __name__ == "__main__":
    main()
