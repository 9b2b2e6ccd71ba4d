"""Warm interpreters inside a slot: a ``bash`` (and a ``python3``) started while the slot is idle,
waiting for the source of the slot's next default call.

Standard library only; copied into the host's lib dir beside ``supervisor.py`` (see there).
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
from collections.abc import Callable
from typing import Any

# Warm interpreters: a `bash` (and, once the slot has used `python`, a `python3`) that has already
# paid for its start (exec, dynamic loading, start-up), waiting for its command: the next default
# call only writes the source into a memfd and says go through a pipe.
BASH = "/bin/bash"
PYTHON = "python3"


def _bash_boot(go_fd: int, src_fd: int, env: dict[str, str]) -> str:
    # The waiting bash execs a real `bash -c SOURCE`: only a fresh `-c` parse behaves exactly as
    # `bash -c` (it execs the script's last simple command, so a program that dies of a signal
    # there is reported as that signal with no "Killed" line; `set -x` traces `+ cmd`, a syntax
    # error keeps `-c:` and the previous status, /proc/$$/fd and cmdline are those of `bash -c`).
    # The start-up paid in advance is what the exec still gains over a call's own spawn from the
    # supervisor (a Python fork; see benchmarks/scenario_call_latency.py). What this bash exported on
    # its own (PWD, and SHLVL, which `exec` lowers back to the value it was given) goes back to the
    # environment the slot gives a fresh `bash -c`.
    unexport = " ".join(name for name in ("PWD", "SHLVL") if name not in env)
    return (f'IFS= read -r -n 1 -u {go_fd} __atropos_go || exit 0; '
            f'IFS= read -r -d "" -u {src_fd} __atropos_cmd; exec {go_fd}<&- {src_fd}<&-; '
            + (f'export -n {unexport}; ' if unexport else '')
            + f'exec {BASH} -c "$__atropos_cmd"')


def _python_boot(go_fd: int, src_fd: int, env: dict[str, str]) -> str:
    # One function, deleted from __main__ before the source runs in __main__'s namespace. An
    # uncaught exception is reported as the interpreter reports it (Python/pythonrun.c,
    # _PyErr_PrintEx): sys.last_* set first (atexit handlers read them), then sys.excepthook without
    # the bootstrap's frame, outside any exception handler (an exception raised by the hook chains
    # onto nothing), "Error in sys.excepthook" or "sys.excepthook is missing" as there (a hook set to
    # None is called, and fails, as there: only a deleted one is missing); exit status 1.
    # SystemExit propagates to the interpreter as usual.
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
    sys.orig_argv = [{PYTHON!r}, "-c", source]
    try:
        exec(compile(source, "<string>", "exec"), namespace)
        return
    except SystemExit:
        raise
    except BaseException as exc:
        error = exc
    error.__traceback__ = error.__traceback__.tb_next
    sys.last_type, sys.last_value, sys.last_traceback = type(error), error, error.__traceback__
    if sys.version_info >= (3, 12):
        sys.last_exc = error
    hook = getattr(sys, "excepthook", parts)  # parts: a sentinel (None is a hook that fails, as there)
    if hook is parts:
        sys.stderr.write("sys.excepthook is missing\\n")
        sys.__excepthook__(type(error), error, error.__traceback__)
    else:
        try:
            hook(type(error), error, error.__traceback__)
        except SystemExit:
            raise
        except BaseException as exc2:
            failed = exc2
            failed.__traceback__ = failed.__traceback__.tb_next
            sys.stdout.flush()
            sys.stderr.write("Error in sys.excepthook:\\n")
            sys.__excepthook__(type(failed), failed, failed.__traceback__)
            sys.stderr.write("\\nOriginal exception was:\\n")
            sys.__excepthook__(type(error), error, error.__traceback__)
    if type(error) is not KeyboardInterrupt:
        raise SystemExit(1)
    # An uncaught KeyboardInterrupt ends python3 by SIGINT once atexit handlers ran (Modules/main.c):
    # it must leave the code the interpreter runs, so it passes through the interpreter's printer,
    # which this one-shot hook silences, putting back what the real report set.
    tb, hook = error.__traceback__, getattr(sys, "excepthook", parts)
    def _quiet(*_):
        error.__traceback__ = sys.last_traceback = tb
        sys.last_value = error
        if hook is parts:
            del sys.excepthook
        else:
            sys.excepthook = hook
    sys.excepthook = _quiet
    raise error
_atropos_boot()
"""


WARM_KINDS = {BASH: _bash_boot, PYTHON: _python_boot}


class Child:
    """A process this supervisor spawned and has not reaped, with its stdout/stderr pipe ends as raw
    non-blocking descriptors (no file objects)."""

    def __init__(self, popen: subprocess.Popen[bytes], out_fd: int, err_fd: int) -> None:
        self.popen = popen  # reaps it: nothing else may wait for this pid
        self.pid = popen.pid
        self.out_fd = out_fd
        self.err_fd = err_fd

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait(self) -> int:
        return self.popen.wait()

    def kill(self) -> None:
        if self.popen.returncode is None:
            os.kill(self.pid, signal.SIGKILL)  # unreaped: the pid is still ours

    def close_pipes(self) -> None:
        for fd in (self.out_fd, self.err_fd):
            if fd >= 0:
                os.close(fd)
        self.out_fd = self.err_fd = -1


def executable(name: str, env: dict[str, str]) -> str:
    """``name`` looked up in the PATH of ``env``, as Popen looks up a program for that environment."""
    if os.sep in name:
        return name
    for d in os.get_exec_path(env):
        path = os.path.join(d, name)
        if os.access(path, os.X_OK) and not os.path.isdir(path):
            return path
    raise FileNotFoundError(2, f"{name}: not found in PATH", name)


def cpu_limit(seconds: Any) -> Callable[[], None] | None:
    """What a child runs before its exec to set its own RLIMIT_CPU (the slot's seccomp filter lets
    no process change another's limits); None without a limit, so the spawn stays a vfork."""
    if not seconds:
        return None
    limit = (int(seconds), int(seconds) + 1)
    return lambda: resource.setrlimit(resource.RLIMIT_CPU, limit)


def spawn(argv: list[str], env: dict[str, str], cwd: str, cpu: int | None = None) -> Child:
    """Start ``argv`` in its own session in ``cwd`` with stdin from /dev/null (read-only, as a call's
    own process gets it) and stdout/stderr into fresh non-blocking pipes. The child inherits this
    process's inheritable descriptors at their numbers; every other descriptor here is close-on-exec
    (see ``inslot.cloexec_all``).

    Popen (a vfork in CPython's own child code), not libc's posix_spawn: glibc's posix_spawn leaves
    its two internal signals (32 and 33) *ignored* in the child, and exec keeps them so, which a
    process started by bash or Popen never has (visible in /proc/<pid>/status); and not os.fork,
    which costs a Python process several times the CPU. Popen resets what Python ignores (SIGPIPE,
    SIGXFSZ); the supervisor keeps nothing else ignored or blocked (``inslot.clean_signals``)."""
    path = executable(argv[0], env)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        popen = subprocess.Popen(argv, executable=path, stdin=null, stdout=out_w, stderr=err_w, cwd=cwd, env=env,
                                 close_fds=False, start_new_session=True, preexec_fn=cpu_limit(cpu))
    except BaseException:
        os.close(out_r)
        os.close(err_r)
        raise
    finally:
        os.close(null)
        os.close(out_w)
        os.close(err_w)
    os.set_blocking(out_r, False)
    os.set_blocking(err_r, False)
    return Child(popen, out_r, err_r)


class WarmInterpreter:
    """A pre-started interpreter for the slot's next default call of its kind (workspace cwd, slot
    env, no stdin), fed its source through a memfd. Its pidfd is opened at the start too: the call
    it serves pays for nothing but the go."""

    def __init__(self, kind: str, cwd: str, env: dict[str, str], cpu: int | None = None) -> None:
        # Both inheritable only until the spawn below (this process starts nothing else meanwhile).
        self.src_fd = os.memfd_create("source", 0)
        go_r, self.go_w = os.pipe2(os.O_CLOEXEC)
        os.set_inheritable(go_r, True)
        try:
            self.proc = spawn([kind, "-c", WARM_KINDS[kind](go_r, self.src_fd, env)], env, cwd, cpu)
        except BaseException:
            os.close(self.src_fd)
            os.close(self.go_w)
            raise
        finally:
            os.close(go_r)
        os.set_inheritable(self.src_fd, False)
        self.kind = kind
        self.cwd = cwd
        self.cpu = cpu or None  # the RLIMIT_CPU it set itself before its exec
        try:
            self.pidfd = os.pidfd_open(self.proc.pid)
        except BaseException:
            self.drop()
            raise

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
        self.proc.close_pipes()
        pidfd, self.pidfd = getattr(self, "pidfd", -1), -1
        if pidfd >= 0:
            os.close(pidfd)
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()
