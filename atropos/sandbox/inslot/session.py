"""The persistent Python session driver: runs *inside* a slot's third sandbox (after the
supervisor's and the terminal's) and executes the ``python_session`` tool's code in one
long-lived interpreter, so variables, imports and functions survive between calls like in a
notebook kernel.

It speaks the supervisor's protocol (length-prefixed JSON frames on its stdin/stdout, one
request at a time). The protocol pipes move to private descriptors at start; for each call,
descriptors 1 and 2 are pointed at capture pipes, so ``print`` and the output of child
processes (``os.system``, ``subprocess``) are captured alike, with the same head+tail caps as
``bash``.

Timeouts: a watchdog thread kills the call's child processes at the deadline (so a blocking
``os.system`` returns) and then raises ``SessionTimeout`` (a ``KeyboardInterrupt``) in the
running code, again every quarter second until it yields: well-behaved code stops and the
session keeps its state. Code that ignores the signal or swallows the interrupt is killed by
the host after a grace period, and the session is restarted empty.

Like the supervisor this file is standard-library only and self-contained: it is copied into
the host's data directory and run by the sandbox's own ``python3``. Everything here runs as the
untrusted code's identity; it protects the host (bounded output, bounded frames), not itself.
"""

from __future__ import annotations

import ast
import builtins
import functools
import io
import json
import linecache
import os
import selectors
import signal
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from atropos.sandbox.inslot.inslot_common import (
        Capture,
        apply_limits,
        clean_signals,
        make_undumpable,
        protocol_fds,
        serve,
    )
    from atropos.sandbox.inslot.inslot_protocol import InvalidRequest, check
else:  # run from the host's lib dir, beside inslot.py (isolated mode: the dir is not on sys.path)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from inslot_common import Capture, apply_limits, clean_signals, make_undumpable, protocol_fds, serve
    from inslot_protocol import InvalidRequest, check
    del sys.path[0]

INTERRUPT_EVERY_S = 0.25


class SessionTimeout(KeyboardInterrupt):
    """Raised in the running code at its deadline; a KeyboardInterrupt so `except Exception` lets it through."""


def _capped(text: str, cap: int) -> str:
    c = Capture(cap)
    c.feed(text.encode("utf-8", "replace"))
    return c.text()[0]


class _Reader(threading.Thread):
    """Drains the call's stdout/stderr pipes (so writers never block) into head+tail captures."""

    def __init__(self, pipes: dict[int, Capture], hard_cap: int, on_limit: Any) -> None:
        super().__init__(daemon=True)
        self.pipes = pipes
        self.hard_cap = hard_cap
        self.on_limit = on_limit
        self.limited = False
        self.stopping = False

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        for fd in self.pipes:
            sel.register(fd, selectors.EVENT_READ)
        try:
            while sel.get_map():
                events = sel.select(0.1)
                if not events and self.stopping:
                    break  # a background writer still holds a pipe: stop waiting for its EOF
                for key, _ in events:
                    try:
                        chunk = os.read(key.fd, 65536)
                    except OSError:
                        chunk = b""
                    if not chunk:
                        sel.unregister(key.fd)
                        continue
                    self.pipes[key.fd].feed(chunk)
                    if not self.limited and sum(c.total for c in self.pipes.values()) > self.hard_cap:
                        self.limited = True
                        self.on_limit()
        finally:
            sel.close()
            for fd in self.pipes:
                try:
                    os.close(fd)
                except OSError:
                    pass


class Session:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.isolated = bool(cfg.get("isolated", True))
        self.count = 0
        # The user's code gets its own __main__ module (pickle, `if __name__ == "__main__"` and
        # `import __main__` see the notebook's namespace, not this driver).
        self.module = types.ModuleType("__main__")
        self.module.__dict__["__builtins__"] = builtins
        self.ns = self.module.__dict__
        self.main_thread = threading.get_ident()
        self.why = ""
        # SIGALRM raises only while a call is being interrupted and has not finished: a signal
        # still in flight when the call ends must not hit the driver itself.
        self.armed = False
        self.call_done: threading.Event | None = None

    # -- interruption ------------------------------------------------------------------------
    def _on_alarm(self, _signum: int, _frame: Any) -> None:
        if self.armed and self.call_done is not None and not self.call_done.is_set():
            raise SessionTimeout(self.why)

    def kill_children(self) -> None:
        """Kill every process of this sandbox but us (and bwrap's init): what the call started.

        Only inside our own PID namespace; without isolation kill(-1) would hit the whole uid.
        """
        if not self.isolated:
            return
        try:
            os.kill(-1, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _interrupt(self, why: str, done: threading.Event) -> None:
        if done.is_set():
            return
        self.why = why
        self.kill_children()  # a blocking os.system/subprocess call returns now
        self.armed = True
        while not done.is_set():
            try:
                # A real signal to the main thread also breaks blocking sleeps and reads.
                signal.pthread_kill(self.main_thread, signal.SIGALRM)
            except (ProcessLookupError, OSError):
                return
            done.wait(INTERRUPT_EVERY_S)

    # -- one call ----------------------------------------------------------------------------
    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        # checked against the declaration, defaults filled in (inslot_protocol.check, in _handle)
        code, timeout, cap, hard_cap = req["code"], req["timeout"], req["max_output"], req["hard_output"]
        self.count += 1
        self.why = ""
        self.armed = False
        start = time.monotonic()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        out, err = Capture(cap), Capture(cap)
        done = self.call_done = threading.Event()
        state = {"timed_out": False}

        def on_limit() -> None:
            threading.Thread(target=self._interrupt, daemon=True,
                             args=(f"output over {hard_cap} bytes: the call was stopped", done)).start()

        def watchdog() -> None:
            if not done.wait(timeout):
                state["timed_out"] = True
                self._interrupt(f"the call exceeded its {timeout:g}s timeout; the session and its variables "
                                "are kept", done)

        _flush()
        saved_err = os.dup(2)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.close(out_w)
        os.close(err_w)
        reader = _Reader({out_r: out, err_r: err}, hard_cap, on_limit)
        reader.start()
        signal.signal(signal.SIGALRM, self._on_alarm)  # code of an earlier call may have replaced it
        threading.Thread(target=watchdog, daemon=True).start()
        value: str | None = None
        error: dict[str, str] | None = None
        filename = f"<cell {self.count}>"
        try:
            try:
                value = self._execute(code, filename, cap)
            finally:
                done.set()
                self.armed = False
        except BaseException as exc:  # the code's failure (SystemExit too): shown, the session lives on
            error = self._describe(exc, cap)
        _flush()
        self.kill_children()  # nothing of a call outlives it (like bash); Python state does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
        os.dup2(saved_err, 2)
        os.close(saved_err)
        reader.stopping = True
        reader.join(5.0)
        stdout, out_trunc = out.text()
        stderr, err_trunc = err.text()
        return {
            "stdout": stdout, "stderr": stderr, "value": value, "error": error,
            "timed_out": state["timed_out"], "output_limited": reader.limited,
            "stdout_bytes": out.total, "stderr_bytes": err.total,
            "stdout_truncated": out_trunc, "stderr_truncated": err_trunc,
            "execution_count": self.count, "duration_ms": round((time.monotonic() - start) * 1000, 3),
        }

    def _execute(self, code: str, filename: str, cap: int) -> str | None:
        """Run ``code`` in the session namespace; the repr of a final expression, as a notebook shows it."""
        # Registered so tracebacks show the cell's source lines.
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        tree = ast.parse(code, filename, "exec")
        last: ast.expr | None = None
        final = tree.body[-1] if tree.body else None
        if isinstance(final, ast.Expr):
            tree.body.pop()
            last = final.value
        exec(compile(tree, filename, "exec"), self.ns)
        if last is None:
            return None
        result = eval(compile(ast.Expression(last), filename, "eval"), self.ns)
        if result is None:
            return None
        self.ns["_"] = result
        return _capped(repr(result), cap)

    def _describe(self, exc: BaseException, cap: int) -> dict[str, str]:
        frames = traceback.extract_tb(exc.__traceback__)
        # Drop this driver's own frames: the model should see its cell, not our plumbing.
        keep = [f for f in frames if f.filename != __file__]
        lines = ["Traceback (most recent call last):\n", *traceback.format_list(keep)] if keep else []
        lines += traceback.format_exception_only(type(exc), exc)
        return {"type": type(exc).__name__, "message": _capped(_safe_str(exc), cap),
                "traceback": _capped("".join(lines), cap)}


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except BaseException:  # a hostile __str__ must not take the driver down
        return f"<unprintable {type(exc).__name__}>"


def _flush() -> None:
    for stream in {id(s): s for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)}.values():
        try:
            if stream is not None:
                stream.flush()
        except BaseException:  # closed or replaced by the code: its output is lost, the session is not
            pass


def _setup_python(workspace: str) -> None:
    """Make the interpreter look like `python3 -c` in the workspace: system and user site-packages
    (a `pip install --user` is importable), the working directory first on sys.path."""
    import site

    site.ENABLE_USER_SITE = True  # -I turned it off for the driver's own start-up
    site.main()
    sys.path.insert(0, "")
    try:
        os.chdir(workspace)
    except OSError:  # an image's WorkingDir the slot's root user removed: start at / (see supervisor)
        os.chdir("/")
    # stdout is a pipe, so block-buffered: a print would show up after the output of an
    # os.system that ran after it. Line buffering keeps them in order.
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True)


def main() -> None:
    make_undumpable()  # the slot's other processes cannot read the driver's memory or descriptors
    clean_signals()  # the code runs in this process: SIGINT must raise KeyboardInterrupt, as in python3
    cfg = json.loads(sys.argv[1])
    rfd, wfd = protocol_fds()  # the code's stdio is ours to redirect
    try:
        with open("/proc/self/oom_score_adj", "w") as fh:
            fh.write("1000")  # under memory pressure the session dies, never the host
    except OSError:
        pass
    apply_limits(cfg.get("limits", {}))
    os.environ.clear()  # children of the code (os.system) get the sandbox's environment, nothing else
    os.environ.update({str(k): str(v) for k, v in (cfg.get("env") or {}).items()})
    _setup_python(cfg.get("cwd") or cfg.get("workspace", "/workspace"))
    session = Session(cfg)
    sys.modules["__main__"] = session.module
    serve(rfd, wfd, functools.partial(_handle, session))


# The ops the session driver answers (the python_session tool's definition in atropos/sandbox/contract/tools.py
# names "session").
OPS: dict[str, Callable[[Session, dict[str, Any]], Any]] = {
    "ping": lambda _session, _req: {"pong": True},
    "session": Session.run,
}


def _handle(session: Session, req: dict[str, Any]) -> dict[str, Any]:
    handler = OPS.get(str(req.get("op")))
    if handler is not None:
        try:
            req = check(req)
        except InvalidRequest as exc:
            return {"ok": False, "error": {"code": "invalid_arguments", "message": str(exc)}}
        return {"ok": True, "result": handler(session, req)}
    return {"ok": False, "error": {"code": "unknown_op", "message": f"unknown op {req.get('op')!r}"}}


if __name__ == "__main__":
    main()
